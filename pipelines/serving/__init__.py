"""Calling a model: registered versions as MLflow Models, generation and export.

How a checkpoint becomes the MLflow Model every registered version is lives beside the registry
(``pipelines.tracking.mlflow_model``: the registry writes it, this package reads it; neither imports the other's
package). Here: ``pyfunc_model`` (that model's code,
models-from-code: what ``mlflow.pyfunc.load_model`` and ``mlflow models serve`` run), ``generate`` (the
``python -m pipelines.generate`` machinery) and ``export`` (the Hugging Face-style folder and its model card).
Text in, text out is ``adlm_model.inference.textgen``: the served model and the CLI run the same code.
"""
