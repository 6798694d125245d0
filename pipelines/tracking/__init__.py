"""MLflow as the pipeline uses it: runs and stores (``runs``; ``best_effort``, the one way a tracking outage is
survived), rank 0's asynchronous metric logger and the run's spool (``spool``), the registered-model contract
(``registry``) and how a checkpoint becomes the MLflow Model every version is (``mlflow_model``)."""
