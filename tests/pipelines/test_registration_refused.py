"""A registry that refuses the new version after training: the command ends non-zero with the one line that
finishes it, and that line is true (once the registry accepts versions again, the same command registers the
run without training it again)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _refuse_versions(db: Path) -> None:
    """A real MLflow sqlite store whose database refuses new model versions (a trigger aborts the insert, as a
    read-only or quota-limited registry would): tracking works, registering fails inside MLflow's own store."""
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{db}").search_experiments()  # creates the store's tables
    with sqlite3.connect(db) as con:
        con.execute("CREATE TRIGGER refuse_versions BEFORE INSERT ON model_versions "
                    "BEGIN SELECT RAISE(ABORT, 'the registry accepts no new versions'); END")


def test_a_refused_registration_ends_the_command_non_zero_with_the_line_to_rerun(
        tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from mlflow.tracking import MlflowClient

    from pipelines.train import main
    from tests.support.data import TINY_MODEL, data_overrides, set_args

    db = tmp_path / "mlflow.db"
    _refuse_versions(db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    sets = [*data_overrides(tiny_data), *TINY_MODEL, "run.name=refused", "run.max_steps=4", "run.val_every=2",
            "run.ckpt_every=2", "run.val_batches=1", "batch.global_batch=4", "batch.micro_batch=4",
            "scaling.num_workers=0", "optim.warmup_steps=1", "mlflow.experiment=refused"]
    argv = ["--config", str(ROOT / "configs" / "demo.yaml"), "--workdir", str(tmp_path / "work"),
            *set_args(sets)]
    rc = main(argv)
    out, err = capfd.readouterr()
    assert rc == 3, err[-3000:]
    assert '"step": 4' in out and '"registered_version": null' in out  # trained to the end, not registered
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: run 'refused' is trained") and "registration failed" in line, line
    assert "rerun the same command to register it" in line
    client = MlflowClient(f"sqlite:///{db}")
    assert client.search_model_versions("name='adlm'") == []

    # The line is true: the registry accepts versions again, the same command registers and trains nothing.
    with sqlite3.connect(db) as con:
        con.execute("DROP TRIGGER refuse_versions")
    assert main(argv) == 0, capfd.readouterr().err[-3000:]
    (version,) = client.search_model_versions("name='adlm'")
    assert version.tags["step"] in ("2", "4") and version.tags["run_name"] == "refused"
    runs = client.search_runs([client.get_experiment_by_name("refused").experiment_id])
    assert len(runs) == 1  # the same run, not a new one
