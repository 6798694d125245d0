"""The work directory is an argument: resolved once at the entry point (``--workdir`` > ``$ADLM_WORKDIR`` >
``./work``) and passed down; a stage given one never falls back on a different ``$ADLM_WORKDIR``, and Ray's
workers are not sent it through their environment (they receive it as an argument)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_a_stage_with_an_explicit_workdir_ignores_a_different_adlm_workdir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.prepare_data import main
    from pipelines.runtime import forwarded_env
    from pipelines.tracking import resolve_tracking_uri

    explicit, elsewhere = tmp_path / "explicit", tmp_path / "elsewhere"
    monkeypatch.setenv("ADLM_WORKDIR", str(elsewhere))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    opts = {"length": 16, "entropy_rows": 200, "train_rows": 64, "validation_rows": 32, "test_rows": 16, "seed": 5,
            "shard_rows": 32}
    assert main(["--source", "testbed", "--workdir", str(explicit), "-q",
                 *(a for k, v in opts.items() for a in ("--testbed", f"{k}={v}"))]) == 0
    manifest = explicit / "data" / "testbed" / "train" / "manifest.json"
    assert json.loads(manifest.read_text())["rows"] == 64
    assert not elsewhere.exists()  # nothing written, not even created, under $ADLM_WORKDIR
    # The tracking store of that work directory is its own, and Ray's workers get no work directory by environment.
    assert resolve_tracking_uri(str(explicit)) == f"sqlite:///{explicit / 'mlflow.db'}"
    assert "ADLM_WORKDIR" not in forwarded_env()
