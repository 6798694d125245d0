"""The work directory is an argument: resolved once at the entry point (``--workdir`` > ``$ADLM_WORKDIR`` >
``./work``) and passed down; a stage given one never falls back on a different ``$ADLM_WORKDIR``, and Ray's
workers are not sent it through their environment (they receive it as an argument)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_a_stage_with_an_explicit_workdir_ignores_a_different_adlm_workdir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.core.runtime import forwarded_env
    from pipelines.prepare_data import main
    from pipelines.tracking.runs import resolve_tracking_uri

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


# Every command that takes --workdir, with the least else it needs to reach the work directory.
COMMANDS = {
    "train": ["--config", "configs/demo.yaml"],
    "distill": ["--config", "configs/demo.yaml", "--teacher", "models:/adlm@champion"],
    "tune": ["--space", "tune_spaces/demo.yaml", "--config", "configs/demo.yaml", "--check"],
    "evaluate": ["--model", "models:/adlm@champion"],
    "generate": ["--model", "models:/adlm@champion", "--prompt", "x"],
    "export": ["models:/adlm@champion", "--out", "OUT"],
    "study": ["studies/testbed_sedd.yaml"],
    "run_all": [],
    "prepare_data": ["--source", "testbed"],
    "serve": ["--model", "models:/adlm@champion"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_workdir_under_a_regular_file_is_one_line(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--workdir`` naming a path under a regular file (NotADirectoryError from the storage layer) is bad input to
    every command: one ``error:`` line naming the folder, exit code 2, and nothing written beside the file."""
    import importlib

    from pipelines.core.storage import resolve_workdir

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in COMMANDS[command]]
    main = importlib.import_module(f"pipelines.{command}").main
    assert main([*argv, "--workdir", str(blocker / "work")]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "(pid=" not in ln[:40]]
    assert len(err) == 1 and "error: the work directory" in err[0] and "cannot be created (Not a directory)" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and blocker.read_text() == "not a folder"
    # the same from $ADLM_WORKDIR, and a regular file named as the work directory itself
    monkeypatch.setenv("ADLM_WORKDIR", str(blocker))
    with pytest.raises(ValueError, match="cannot be created") as e:
        resolve_workdir(None)
    assert getattr(e.value, "exit_code", None) == 2
