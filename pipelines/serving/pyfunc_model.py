"""The code of every registered version's MLflow Model (models-from-code: MLflow runs this file when it loads
the model; nothing is pickled).

It imports only ``mlflow``, ``pandas`` (and its ``numpy``) and ``adlm_model`` (shipped in the model's ``code/`` folder), never
the rest of ``pipelines``, so ``mlflow models serve`` and ``mlflow.pyfunc.load_model`` need no more than the
model's ``requirements.txt``.

- Input: a DataFrame, one row per request (``pipelines.tracking.mlflow_model.REQUEST_FIELDS``): ``prompt``, and optionally
  ``suffix``, ``length``, ``steps``, ``sampler``, ``nucleus_p``, ``seed``, the confidence sampler's
  ``threshold``, ``block``, ``refresh``, ``kv_cache``, and ``stop_at_eos``; a missing value takes
  ``adlm_model.inference.textgen``'s default. A field the model does not know is refused with the known ones listed
  (the model has no enforced input schema because MLflow's drops unknown columns silently: a typo such as
  ``lenght`` would be answered with the default length).
- Output: one row per input row: ``text`` (starts with the prompt, ends with the suffix; the completion
  stops at the first EOS unless ``stop_at_eos`` is false, and shows no special token), ``completion``,
  ``new_tokens``, ``seconds``, ``seed``, ``sampler``, ``steps``, ``settings`` (JSON: every setting used) and
  ``network_calls``.
- Every row is validated, and the request's cost bounded (``adlm_model.inference.limits``: ``ADLM_MAX_STEPS``,
  ``ADLM_MAX_LENGTH``, ``ADLM_MAX_ROWS``, ``ADLM_MAX_WORK``; ``ADLM_MAX_CHARS`` before the text is tokenized),
  before any row is generated; a bad row or a
  request over a limit raises ``RequestError`` (an ``MlflowException`` with ``INVALID_PARAMETER_VALUE``), which
  the scoring server answers with HTTP 400 and the one-line reason, without the request echoed.
- Input formats: ``dataframe_records``/``dataframe_split``, and ``inputs`` as records, columns or a list of
  prompt strings (``FORMATS``); anything else is refused in one line. ``prompt`` is required in every row.
- The weights load on the first request and stay loaded for the process (``adlm_model.load_generator``);
  the device is ``$ADLM_DEVICE`` (default ``auto``: the GPU when there is one).
- Each row samples with its own generator seeded by its ``seed``: a row's text does not depend on the
  other rows of the batch, and equals ``python -m pipelines.generate`` with the same settings.
"""

from __future__ import annotations

import json
import os
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

OUTPUT_COLUMNS = ("text", "completion", "new_tokens", "seconds", "seed", "sampler", "steps", "settings",
                  "network_calls")
SERVED_EXCLUDED = ("num_samples",)
"""Request fields the served model does not take: one output row per input row."""


class RequestError(MlflowException):
    """A refused request: ``INVALID_PARAMETER_VALUE`` (HTTP 400) with one line naming the problem.

    The scoring server rewrites the message of any ``MlflowException`` from ``predict`` to ``Failed to predict
    data '<the request as a DataFrame>'. Error: ...`` (``mlflow.pyfunc.scoring_server.invocations``), which
    echoes up to a kilobyte of the request into the answer and the server's log: this one keeps its own line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)

    @property  # type: ignore[override]
    def message(self) -> str:
        return self._line

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_line"):  # the first assignment is MlflowException.__init__'s: later ones wrap it
            self._line = value


def _plain(value: Any) -> Any:
    """A JSON value as the ``inputs`` format hands it over (numpy arrays and scalars) made plain Python."""
    if isinstance(value, np.ndarray):
        return value.item() if value.ndim == 0 else [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


FORMATS = ('records ({"dataframe_records": [{"prompt": ...}, ...]} or {"inputs": [{"prompt": ...}, ...]}), '
           'columns ({"inputs": {"prompt": [...], ...}}) or a list of prompts ({"inputs": ["...", ...]})')


def _rows(model_input: Any) -> list[dict[str, Any]]:
    """One dict per request row, from every input format the scoring server passes on (``FORMATS``)."""
    if isinstance(model_input, pd.DataFrame):
        return [{k: _plain(v) for k, v in r.items()} for r in model_input.to_dict(orient="records")]
    model_input = _plain(model_input)
    if isinstance(model_input, dict):  # one request, or columns of several ({"prompt": [...], ...})
        values = {k: _plain(v) for k, v in model_input.items()}
        sizes = {len(v) for v in values.values() if isinstance(v, list)}
        if not sizes:
            return [values]
        if len(sizes) > 1:
            raise RequestError(f"columns of different lengths ({', '.join(map(str, sorted(sizes)))} values): give "
                               "every field one value per request, or one value for all")
        n = sizes.pop()  # a single value (not a list) holds for every request
        return [{k: v[i] if isinstance(v, list) else v for k, v in values.items()} for i in range(n)]
    if isinstance(model_input, list) and all(isinstance(r, dict) for r in model_input):
        return [{k: _plain(v) for k, v in r.items()} for r in model_input]
    if isinstance(model_input, list) and all(isinstance(r, str) for r in model_input):
        return [{"prompt": r} for r in model_input]
    raise RequestError(f"requests must be {FORMATS}; got {type(model_input).__name__}")


def _check_prompt(i: int, row: dict[str, Any]) -> None:
    """``prompt`` is required (an empty string asks for text from nothing): a row without it is a mistake
    (``[{}]``, a misnamed column), not a request for the defaults."""
    v = row.get("prompt")
    if v is None or isinstance(v, float) and v != v:  # absent, null, or NaN (a DataFrame's missing cell)
        raise RequestError(f"request row {i}: prompt is required (\"\" for text from nothing)")


class ADLMTextModel(mlflow.pyfunc.PythonModel):
    """Prompt (+ suffix) in, generated text out (module docstring)."""

    def load_context(self, context: Any) -> None:
        self.checkpoint = context.artifacts["checkpoint"]
        self.device = os.environ.get("ADLM_DEVICE", "auto")

    # model_input is hinted pd.DataFrame, a hint MLflow derives no schema from: the signature validates.
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        # lazy: keeps torch out of this module's import
        from adlm_model.inference.limits import LimitError
        from adlm_model.inference.textgen import load_generator

        gen = load_generator(self.checkpoint, self.device)
        rows = _rows(model_input)
        checked, work = [], 0.0
        try:
            limits = gen.limits()
            limits.check_request(len(rows), 0.0)
            for i, row in enumerate(rows):
                _check_prompt(i, row)
                try:
                    req = gen.request(exclude=SERVED_EXCLUDED, **row)
                    limits.check_text(i, len(req.prompt) + len(req.suffix))  # before the text is tokenized
                    checked.append(gen.check(req))
                    limits.check_row(i, checked[-1].request.steps, checked[-1].request.length)
                except LimitError:
                    raise
                except ValueError as e:  # GenerationError: one line naming the fix
                    raise RequestError(f"request row {i}: {e}") from e
                work += gen.cost(checked[-1])[1]
            limits.check_request(len(rows), work)
        except LimitError as e:
            raise RequestError(str(e)) from e
        out = [gen.generate(c)[0] for c in checked]
        return pd.DataFrame([{k: json.dumps(g.settings, sort_keys=True) if k == "settings" else getattr(g, k)
                              for k in OUTPUT_COLUMNS} for g in out], columns=list(OUTPUT_COLUMNS))


mlflow.models.set_model(ADLMTextModel())
