"""Careless and hostile input to the commands' settings, environment, tracking, placement, data and training inputs:
each is one ``error:`` line and exit 2 before any work (nothing written), or works as a user would expect. The
commands run in this process (their ``main()``), against real files, a real sqlite store, a real port with nothing
listening and the session's Ray."""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.support.data import TINY_MODEL, data_overrides, set_args

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")


def one_error(capsys: pytest.CaptureFixture[str], starts: str = "error: ") -> str:
    """The command's one stderr line (asserted to be one, starting with ``starts``)."""
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith(("INFO ", "WARNING "))]
    assert len(err) == 1 and err[0].startswith(starts), err
    return err[0]


def _main(module: str):
    return __import__(f"pipelines.{module}", fromlist=["main"]).main


# ---- ADLM_* settings: one parser, one line ------------------------------------------------------------------


@pytest.mark.parametrize("command, argv", [
    ("evaluate", ["--model", "models:/adlm@candidate"]),
    ("generate", ["--model", "models:/adlm@candidate"]),
    ("import_model", ["nowhere.ckpt"]),
    ("train", ["--config", DEMO]),
])
@pytest.mark.parametrize("var, value, says", [
    ("ADLM_PLACEMENT_TIMEOUT_S", "abc", "is not a finite number"),
    ("ADLM_PLACEMENT_TIMEOUT_S", "-5", "must be at least 0"),
    ("ADLM_VERBOSITY", "loud", "is not a whole number"),
    ("ADLM_MAX_WORK", "nan", "is not a finite number"),
    ("ADLM_MAX_ROWS", "inf", "is not a whole number"),
    ("ADLM_MAX_BODY_BYTES", "0", "must be above 0"),
    ("ADLM_FAULT", "train.crash_at_step=x", "is not a whole number"),
])
def test_a_bad_setting_is_one_line_before_any_work(command: str, argv: list[str], var: str, value: str, says: str,
                                                    workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(var, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # reached only if the check is late
    assert _main(command)(argv) == 2
    line = one_error(capsys)
    assert var in line and says in line
    assert list(workdir.iterdir()) == []


def test_the_served_limits_refuse_what_would_turn_them_off() -> None:
    """``adlm_model.inference.limits`` (the served model reads them itself): a NaN compares false with everything, so
    ``ADLM_MAX_WORK=nan`` let every request through."""
    from adlm_model.inference.limits import LimitError, RequestLimits

    for value in ("nan", "inf", "-inf", "abc"):
        with pytest.raises(LimitError, match="ADLM_MAX_WORK.*is not a finite number"):
            RequestLimits.for_model(32, environ={"ADLM_MAX_WORK": value})
    assert RequestLimits.for_model(32, environ={"ADLM_MAX_WORK": "2e9"}).max_work == 2e9


# ---- Tracking: a server that does not answer, a URI no store can be made of ------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("command, argv", [
    ("evaluate", ["--model", "models:/adlm@candidate"]),
    ("generate", ["--model", "models:/adlm@candidate"]),
    ("export", ["models:/adlm@candidate", "--out", "OUT"]),
    ("serve", ["--model", "models:/adlm@candidate"]),
    ("import_model", ["nowhere.ckpt"]),
    ("run_all", []),
])
def test_a_command_that_needs_the_store_refuses_a_server_that_does_not_answer(
        command: str, argv: list[str], workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens on the port: MLflow's own client retried for over 300 s. These commands cannot do their
    work without the store, so they say so at once (training, sweeps and studies go on and spool instead:
    tests/e2e/test_tracking_outage.py)."""
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    for var in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"):  # run_all's defaults
        monkeypatch.setenv(var, os.environ.get(var, "2" if "INTERVAL" in var else "1"))  # restored after the test
    out = tmp_path / "out"
    assert _main(command)([a.replace("OUT", str(out)) for a in argv]) == 2
    line = one_error(capsys)
    assert line.startswith(f"error: no tracking server at {url} (connection refused)") and "mlflow/server.sh" in line
    assert not out.exists() and not (workdir / "ray_results").exists()


def test_a_tracking_uri_no_store_can_be_made_of_is_one_line(workdir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    not_a_db = tmp_path / "notes.db"
    not_a_db.write_text("a notes file, not a database\n")
    for uri, says in ((f"ftp://127.0.0.1:{free_port()}/x", "MLflow has no store for the scheme 'ftp'"),
                      (f"sqlite:///{not_a_db}", "is not an SQLite database"),
                      (f"sqlite:///{tmp_path}", "is a folder, not an SQLite database file"),
                      (str(tmp_path / "mlruns"), "is a folder store")):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        for command, argv in (("generate", ["--model", "models:/adlm@candidate"]), ("train", ["--config", DEMO])):
            assert _main(command)(argv) == 2, (uri, command)
            line = one_error(capsys)
            assert says in line, line
    assert not_a_db.read_text() == "a notes file, not a database\n"
    assert not (workdir / "ray_results").exists()


# ---- Placement ----------------------------------------------------------------------------------------------


def test_an_evaluation_task_no_node_can_take_is_refused(ray_session) -> None:
    """``evaluate --set cpus_per_task=1000`` waited for over 400 s on a Ray that will not grow."""
    from pipelines.core.placement import Unplaceable
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.run import make_executor

    with pytest.raises(Unplaceable, match=r"the evaluation asks for \{'CPU': 1000.0.*cpus_per_task") as e:
        make_executor(EvalConfig(cpus_per_task=1000), in_process=False)
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    assert make_executor(EvalConfig(cpus_per_task=1), in_process=False).cpus == 1


def test_the_placement_watch_reads_nothing_from_a_half_imported_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval imports Ray in the main thread while the watch polls: the module is in ``sys.modules`` without its
    attributes yet ("partially initialized module 'ray'"), and the watch's thread printed a traceback."""
    from pipelines.core.placement import PlacementWatch

    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    assert PlacementWatch(60, lambda w: None)._status() is None


# ---- Config text: --set values, files, numbers ----------------------------------------------------------------


@pytest.mark.parametrize("assignment, says", [
    ("run.name={", "the value is not valid YAML: expected the node content"),
    ("run.name=!!python/object/apply:os.system ['true']", "tags such as !!python are not read"),
    ("optim.lr=.inf", "optim.lr=inf: expected a finite number"),
    ("model.gamma=.nan", "model.gamma=nan: expected a finite number"),
])
def test_bad_set_values_are_one_line(assignment: str, says: str, workdir: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert _main("train")(["--config", DEMO, "--set", assignment]) == 2
    assert says in one_error(capsys)


def test_evaluation_settings_refuse_bad_yaml_and_non_finite_numbers_but_keep_inf_thresholds() -> None:
    from adlm_model.config import ConfigError
    from pipelines.core.configlib import apply_to
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.promotion import PromotionConfig

    cfg, promo = EvalConfig(), PromotionConfig()
    with pytest.raises(ConfigError, match=r"sampler.x=\{'.*not valid YAML"):
        apply_to([cfg, promo], ["sampler.x={"], dict_prefixes={"sampler": "sampler_kwargs"})
    with pytest.raises(ConfigError, match="cpus_per_task=inf: expected a finite number"):
        apply_to([cfg, promo], ["cpus_per_task=inf"])
    with pytest.raises(ConfigError, match="stage1_max_ppl=nan: expected a finite number"):
        apply_to([cfg, promo], ["stage1_max_ppl=nan"])
    apply_to([cfg, promo], ["stage1_max_ppl=inf"])  # inf: no threshold, the field's default
    assert promo.stage1_max_ppl == float("inf")


def test_a_study_file_that_is_not_utf8_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    study = tmp_path / "study.yaml"
    study.write_bytes(b"\xff\xfename: latin \xe9\n")
    assert _main("study")([str(study), "--check", "--workdir", str(tmp_path / "work")]) == 2
    assert "is not UTF-8 text" in one_error(capsys)
    assert not (tmp_path / "work").exists()


# ---- Data: the manifest and its shards agree before any work ------------------------------------------------------


def _edited(tiny_data: Path, dest: Path, edit=None, shard=None) -> Path:
    shutil.copytree(tiny_data, dest)
    mf = dest / "train" / "manifest.json"
    if edit is not None:
        m = json.loads(mf.read_text())
        edit(m)
        mf.write_text(json.dumps(m))
    if shard is not None:
        shard(dest / "train" / "part-00001.parquet")
    return dest


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


@pytest.mark.parametrize("edit, shard, model, says", [
    (lambda m: m.update(shards=[1]), None, [], "shards[0] is 1, not a shard's name, rows and sha256"),
    # A model sized to the manifest's word: it trained, then failed in a worker (index 503 is out of bounds).
    (lambda m: m.update(vocab_size=500), None, ["model.vocab_size=500"],
     "counts token id 511 outside its vocabulary (vocab_size 500"),
    (lambda m: m.update(length=64), None, ["model.seq_len=64"], "does not hold rows of 64 int32 ids"),
    (None, _truncate, [], "part-00001.parquet has"),
    (lambda m: [s.pop("bytes") for s in m["shards"]], _truncate, [],
     "part-00001.parquet is not a readable Parquet file"),
])
def test_a_manifest_that_does_not_match_its_shards_is_refused_before_any_work(
        edit, shard, model: list[str], says: str, tiny_data: Path, workdir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each trained, or failed in a worker after Ray's start-up and an MLflow run (``index 503 is out of bounds``;
    a truncated shard: two lines without its name). Now: the manifest's shape, each shard's size and Parquet footer,
    and the ids the manifest counted, before Ray or MLflow."""
    data = _edited(tiny_data, tmp_path / "data", edit, shard)
    sets = [*data_overrides(tiny_data), *TINY_MODEL, "run.name=lies"]
    sets = [*(s.replace(str(tiny_data), str(data)) for s in sets), *model]
    assert _main("train")(["--config", DEMO, *set_args(sets)]) == 2
    line = one_error(capsys, "error: data.train: ")
    assert says in line, line
    assert not (workdir / "mlflow.db").exists() and not (workdir / "ray_results").exists()


# ---- prepare_data -----------------------------------------------------------------------------------------------


def test_prepare_data_refuses_bad_options_and_inputs_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from pipelines.prepare_data import main

    text = tmp_path / "corpus.txt"
    text.write_text("a line of text\n" * 50)
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    out = tmp_path / "out"
    ok = ["--source", f"train={text}", "--out", str(out), "--train-tokenizer", "300"]
    monkeypatch.chdir(tmp_path)  # an empty path must not mean "this folder"
    for argv, says in (
            ([*ok[:4], "--train-tokenizer", str(10**12)], "--train-tokenizer 1000000000000: a byte-level BPE has"),
            ([*ok, "--unit-mb", "-1"], "--unit-mb -1.0: must be a number above 0"),
            ([*ok, "--unit-mb", "nan"], "--unit-mb nan: must be a number above 0"),
            ([*ok, "--unit-docs", "0"], "--unit-docs 0: must be at least 1"),
            ([*ok, "--progress-interval", "-2"], "--progress-interval -2.0: must be a number above 0"),
            (["--source", "train=", *ok[2:]], "--source has an empty path"),
            (["--source", f"train={binary}", *ok[2:]], f"{binary} is a binary file, not text"),
            ([*ok[:2], "--out", str(a_file / "sub"), *ok[4:]], f"{a_file} is a file, not a folder")):
        assert main(argv) == 2, argv
        assert says in one_error(capsys, "prepare_data: error: "), argv
    assert not out.exists() and a_file.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "corpus.txt", "model.bin"]


# ---- A resume whose checkpoints were deleted --------------------------------------------------------------------


def _ray_train_run(run_dir: Path, steps: list[int]) -> None:
    """A run folder as Ray Train leaves it: a complete checkpoint folder a step (its config and trainer state, the
    files written last) and Ray Train's record of them."""
    from pipelines.training.checkpoints import RAY_TRAIN_RECORD, TRAINER_STATE, checkpoint_name

    run_dir.mkdir(parents=True)
    for s in steps:
        (run_dir / checkpoint_name(s)).mkdir()
        for f in ("config.json", f"{TRAINER_STATE}.json"):
            (run_dir / checkpoint_name(s) / f).write_text("{}")
    (run_dir / RAY_TRAIN_RECORD).write_text(json.dumps({"ray_version": "2.60.0", "checkpoint_results": [
        {"version": 0, "checkpoint_dir_name": checkpoint_name(s), "metrics": {"step": s}} for s in steps]}))


def test_a_resume_after_checkpoints_were_deleted_resumes_from_what_is_left_or_says_it_cannot(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Ray Train restores its record of a run's checkpoints and failed on one deleted by hand
    (``CheckpointManagerInitializationError``): with one left, the record is dropped and the run resumes from it;
    with none left, one line says why it cannot resume and what to do, and nothing is touched."""
    from adlm_model.config import ConfigError
    from pipelines.training.checkpoints import (
        RAY_TRAIN_RECORD,
        forget_missing_checkpoints,
        latest_checkpoint,
        missing_recorded_checkpoints,
    )

    some = tmp_path / "some"
    _ray_train_run(some, [2, 4])
    shutil.rmtree(some / "checkpoint_00000004")
    assert missing_recorded_checkpoints(some) == ["checkpoint_00000004"]
    prev = latest_checkpoint(some)
    assert prev is not None and prev[0] == 2
    forget_missing_checkpoints(some, prev, "some")
    assert not (some / RAY_TRAIN_RECORD).exists() and (some / "checkpoint_00000002").is_dir()
    assert "resuming from step 2, the latest one left" in caplog.text

    gone = tmp_path / "gone"
    _ray_train_run(gone, [2, 4])
    for s in (2, 4):
        shutil.rmtree(gone / f"checkpoint_0000000{s}")
    with pytest.raises(ConfigError, match=r"run 'gone' cannot resume: its checkpoints in .* were deleted") as e:
        forget_missing_checkpoints(gone, latest_checkpoint(gone), "gone")
    assert "\n" not in str(e.value) and "another run.name" in str(e.value)
    assert (gone / RAY_TRAIN_RECORD).is_file()

    intact = tmp_path / "intact"
    _ray_train_run(intact, [2])
    forget_missing_checkpoints(intact, latest_checkpoint(intact), "intact")
    assert (intact / RAY_TRAIN_RECORD).is_file()
