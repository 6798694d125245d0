"""The code of every registered version's MLflow Model (models-from-code: MLflow runs this file when it loads
the model; nothing is pickled).

It imports only ``mlflow``, ``pandas`` and ``adlm_model`` (shipped in the model's ``code/`` folder), never
the rest of ``pipelines``, so ``mlflow models serve`` and ``mlflow.pyfunc.load_model`` need no more than the
model's ``requirements.txt``.

- Input: a DataFrame, one row per request (``mlflow_model.REQUEST_FIELDS``): ``prompt``, and optionally
  ``suffix``, ``length``, ``steps``, ``sampler``, ``nucleus_p``, ``seed``, the confidence sampler's
  ``threshold``, ``block``, ``refresh``, ``kv_cache``, and ``stop_at_eos``; a missing value takes
  ``adlm_model.textgen``'s default. A field the model does not know is refused with the known ones listed
  (the model has no enforced input schema because MLflow's drops unknown columns silently: a typo such as
  ``lenght`` would be answered with the default length).
- Output: one row per input row: ``text`` (starts with the prompt, ends with the suffix; the completion
  stops at the first EOS unless ``stop_at_eos`` is false, and shows no special token), ``completion``,
  ``new_tokens``, ``seconds``, ``seed``, ``sampler``, ``steps``, ``settings`` (JSON: every setting used) and
  ``network_calls``.
- Every row is validated, and the request's cost bounded (``adlm_model.limits``: ``ADLM_MAX_STEPS``,
  ``ADLM_MAX_LENGTH``, ``ADLM_MAX_ROWS``, ``ADLM_MAX_WORK``), before any row is generated; a bad row or a
  request over a limit raises ``MlflowException`` with ``INVALID_PARAMETER_VALUE``, which the scoring server
  answers with HTTP 400 and the one-line reason.
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
import pandas as pd
from mlflow.exceptions import MlflowException

OUTPUT_COLUMNS = ("text", "completion", "new_tokens", "seconds", "seed", "sampler", "steps", "settings",
                  "network_calls")
SERVED_EXCLUDED = ("num_samples",)
"""Request fields the served model does not take: one output row per input row."""


def _rows(model_input: Any) -> list[dict[str, Any]]:
    if isinstance(model_input, pd.DataFrame):
        return model_input.to_dict(orient="records")
    if isinstance(model_input, dict):  # one request, or columns of several ({"prompt": [...], ...})
        lists = any(isinstance(v, list | tuple) or hasattr(v, "__len__") and not isinstance(v, str)
                    for v in model_input.values())
        return pd.DataFrame(model_input).to_dict(orient="records") if lists else [model_input]
    if isinstance(model_input, list) and all(isinstance(r, dict) for r in model_input):
        return list(model_input)
    raise MlflowException.invalid_parameter_value(
        f"expected a table of requests (columns prompt, suffix, length, ...), got {type(model_input).__name__}")


class ADLMTextModel(mlflow.pyfunc.PythonModel):
    """Prompt (+ suffix) in, generated text out (module docstring)."""

    def load_context(self, context: Any) -> None:
        self.checkpoint = context.artifacts["checkpoint"]
        self.device = os.environ.get("ADLM_DEVICE", "auto")

    # model_input is hinted pd.DataFrame, a hint MLflow derives no schema from: the signature validates.
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        from adlm_model.limits import LimitError, RequestLimits
        from adlm_model.textgen import load_generator

        gen = load_generator(self.checkpoint, self.device)
        rows = _rows(model_input)
        checked, work = [], 0.0
        try:
            limits = RequestLimits.for_model(gen.cfg.seq_len, any_length=gen.cfg.kind == "bd3lm")
            limits.check_request(len(rows), 0.0)
            for i, row in enumerate(rows):
                try:
                    checked.append(gen.check(gen.request(exclude=SERVED_EXCLUDED, **row)))
                    limits.check_row(i, checked[-1].request.steps, checked[-1].request.length)
                except LimitError:
                    raise
                except ValueError as e:  # GenerationError: one line naming the fix
                    raise MlflowException.invalid_parameter_value(f"request row {i}: {e}") from e
                work += gen.cost(checked[-1])[1]
            limits.check_request(len(rows), work)
        except LimitError as e:
            raise MlflowException.invalid_parameter_value(str(e)) from e
        out = [gen.generate(c)[0] for c in checked]
        return pd.DataFrame([{k: json.dumps(g.settings, sort_keys=True) if k == "settings" else getattr(g, k)
                              for k in OUTPUT_COLUMNS} for g in out], columns=list(OUTPUT_COLUMNS))


mlflow.models.set_model(ADLMTextModel())
