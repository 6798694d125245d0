"""Adapters for the private names of Ray and MLflow: the only modules of ``pipelines`` that may import one.

One module per package (``ray``, ``mlflow``), each naming why no public API serves and failing in one line when a
name has gone (``adlm_model.compat.PrivateName``); ``tests/test_compat.py`` loads every one of them. Nothing here
imports Ray or MLflow until a function is called: a command's ``--help`` stays fast.
"""
