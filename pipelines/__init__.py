"""Orchestration of the ADLM pipeline: Ray Data, Ray Train, Ray Tune and MLflow.

Thin scripts over ``adlm_model``: ``prepare_data``, ``train``, ``tune``, ``evaluate``, ``run_all``.
"""
