"""Training's machinery (the CLI is ``pipelines/train.py``).

``config`` (typed recipe sections), ``data`` (the splits checked against the model), ``optim`` (AdamW and
the learning-rate schedule), ``worker`` (a worker's live objects, build and resume), ``init`` (start from a
version: ``run.init``), ``loop`` (the worker loop as named steps), ``checkpoints`` (what a worker writes and
reads, what the driver finds and exports), ``context`` (the facts of one run the driver's steps share),
``trainer`` (the driver as named steps: MLflow run, Ray Train fit, export, registration).
"""
