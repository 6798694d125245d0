"""A tracking server that goes down mid-training, with MLflow's default retry settings (a single call waits
about 4 minutes before it gives up): training keeps its step rate through an outage and waits on no call, the
metrics reach the server once it is back, and the run registers at its end; a run that ends during an outage
says so in one clear message and the next run of the same command sends its metrics and registers it."""

from __future__ import annotations

import contextlib
import http.server
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.support.cluster import Gate, mlflow_server, outage_step_rates, tracking_outage

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def answering(status: int) -> Iterator[str]:
    """A real HTTP server on loopback that answers every request with ``status`` (a tracking server that
    refuses this client: 401/403, or one that fails: 5xx); yields its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error_code": "UNAUTHENTICATED", "message": "no"}' if status in (401, 403) else b"{}")

        do_GET = do_POST = do_PATCH = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_refused_credentials_are_not_an_outage() -> None:
    from pipelines.tracking.runs import TrackingAuthError, tracking_reachable

    for status in (401, 403):
        with answering(status) as url, pytest.raises(TrackingAuthError, match=f"HTTP {status}.*MLFLOW_TRACKING_USERNAME"):
            tracking_reachable(url)
    with answering(503) as url:
        assert tracking_reachable(url) is False  # a failing server: an outage, training goes on
    assert tracking_reachable(f"http://127.0.0.1:{free_port()}", timeout=2) is False  # connection refused
    assert tracking_reachable("sqlite:///x.db") is True


def test_training_against_a_server_that_answers_401_fails_in_one_line_before_any_work(tmp_path: Path) -> None:
    """The command a user runs, against a tracking server that refuses its credentials: exit 2, one line naming
    what to set, before the data is read or Ray starts (the recipe's data does not even exist here)."""
    with answering(401) as url:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": url}
        env.pop("MLFLOW_TRACKING_USERNAME", None)
        r = subprocess.run([sys.executable, "-m", "pipelines.train", "--config", str(ROOT / "configs" / "demo.yaml"),
                            "--workdir", str(tmp_path / "work")], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=60)
    err = r.stderr.strip()
    assert r.returncode == 2 and err.count("\n") == 0, err[-3000:]
    assert err.startswith("error: the MLflow tracking server at") and "HTTP 401" in err
    assert "MLFLOW_TRACKING_USERNAME" in err and "~/.mlflow/credentials" in err
    assert "Ray" not in r.stdout and not (tmp_path / "work" / "ray_results").exists()


def test_a_stopped_server_trains_on_and_the_command_ends_non_zero_with_the_line_to_rerun(
        tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """An outage for the whole run: training goes on (the metrics wait in the spool), but a run that was to be
    registered and is not ends the command non-zero, with the one line that finishes it."""
    from pipelines.train import main
    from tests.support.data import TINY_MODEL, data_overrides, set_args

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    sets = [*data_overrides(tiny_data), *TINY_MODEL, "run.name=stopped", "run.max_steps=4", "run.val_every=2",
            "run.ckpt_every=2", "run.val_batches=1", "batch.global_batch=4", "batch.micro_batch=4",
            "scaling.num_workers=0", "optim.warmup_steps=1"]
    rc = main(["--config", str(ROOT / "configs" / "demo.yaml"), "--workdir", str(tmp_path / "work"),
               *set_args(sets)])
    out, err = capfd.readouterr()
    assert rc == 3, err[-3000:]
    assert '"step": 4' in out  # trained to the end
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: run 'stopped' is trained") and "rerun the same command to register it" in line
    assert (tmp_path / "work" / "ray_results" / "stopped" / "tracking_spool").is_dir()


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory: pytest.TempPathFactory):
    """One real MLflow tracking server for the module's outage tests (each its own experiment); each test outages
    a ``Gate`` in front of it, so the server itself starts once (5-25 s of start-up under the suite's load)."""
    base = tmp_path_factory.mktemp("tracking")
    with mlflow_server(base / "mlflow.db", str(base / "artifacts"), base / "mlflow.log") as server:
        yield server


@pytest.fixture()
def gate(tracking_server):
    """A test's own ``Gate`` in front of the module's server, closed when the test ends, whatever its outcome."""
    g = Gate(tracking_server.port)
    yield g
    g.stop()


TRAIN_S = 35.0
"""The long run's planned length at the pace measured just before it: the outage needs about 25 s of it (five
windows, then OUTAGE_S down); if the pace rises under a load that drops, BACK_BY shortens the outage so that the
run still ends with the server up."""
LOG_EVERY = 10
STEP_PAUSE_S = 0.1
"""What each step of the calibration and the long run waits after its update (in this process: the loop's
``optimiser_step``): the runs idle rather than compute."""
MICRO = 16
"""Their micro-batch: a step's compute well under STEP_PAUSE_S, so that a window of LOG_EVERY steps lasts about a
second and the outage holds a dozen of them."""
BACK_BY = 0.7
"""The share of the long run by which the server is back at the latest (its checkpoint there ends the outage)."""
OUTAGE_S = 20.0
"""Long enough that a call in flight when the server stops is still retrying when it comes back (MLflow's default
retries: 7, backoff factor 2, capped at 120 s: waits of 0, 4, 8 and 16 s, so the retry about 28 s after the stop
finds the server up, restarted after 20 s down plus its few seconds of start-up), and that a loop which waited on
it would show a stall of tens of seconds; short enough to keep the suite fast. The path where a
call's retries run out before the server is back (the batch queued again, sent later, once) is
``test_a_call_whose_retries_run_out_is_sent_again_once_the_server_is_back``: at 0 retries it takes seconds,
at the defaults it would take over four minutes and prove nothing more."""


def _cfg(tiny_data: Path, name: str, steps: int, micro: int = 8, ckpt_every: int = 2000):
    from pipelines.training.config import load_config
    from tests.support.data import TINY_MODEL, data_overrides

    root = Path(__file__).resolve().parents[2]
    return load_config(root / "configs" / "demo.yaml", [
        *data_overrides(tiny_data), *TINY_MODEL, f"run.name={name}", f"run.max_steps={steps}", f"run.log_every={LOG_EVERY}",
        "run.val_every=1000", f"run.ckpt_every={ckpt_every}", "run.val_batches=1", f"batch.global_batch={micro}",
        f"batch.micro_batch={micro}", "scaling.num_workers=0", "scaling.threads=1",
        "optim.warmup_steps=2",
        "mlflow.experiment=outage", "mlflow.drain_timeout_s=30"])


@pytest.mark.slow
def test_training_outlives_a_tracking_outage(tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture[str], tracking_server, gate) -> None:
    import mlflow

    from pipelines.training import loop as loop_mod
    from pipelines.training.trainer import train

    for k in [k for k in __import__("os").environ if k.startswith("MLFLOW_HTTP_REQUEST")]:
        monkeypatch.delenv(k)  # MLflow's own defaults
    real = tracking_server
    # Training talks to the server through a gate that goes down and comes back at once (a restarted server
    # takes up to 25 s to answer under the suite's load: a run meant to end with it up ended first); the
    # test reads the server directly. A real server's restart: benchmarks/tracking_outage.py.
    server = gate
    wd = tmp_path / "work"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    client = mlflow.MlflowClient(real.url)
    # The run must outlast the outage (a few windows, then OUTAGE_S down), whatever this
    # machine's pace: a fixed step count long enough on a quiet machine is two minutes under the suite's load.
    # So the loop's own pace is measured first (the median window of a short run of the same recipe) and the
    # long run is sized to about TRAIN_S at that pace.
    # Each optimiser step then pauses STEP_PAUSE_S, as a step on an accelerator leaves the CPU idle: the run lasts
    # TRAIN_S without keeping a core busy (the suite is CPU-bound), and its pace moves less with the suite's load.
    real_step = loop_mod.optimiser_step

    def paced_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        time.sleep(STEP_PAUSE_S)
        return out

    monkeypatch.setattr(loop_mod, "optimiser_step", paced_step)
    calib = train(_cfg(tiny_data, "calibrate", 40, micro=MICRO), workdir=str(wd), tracking_uri=server.url)
    tok_s = statistics.median(m.value for m in client.get_metric_history(calib.run_id, "train/tokens_per_s"))
    steps = min(max(LOG_EVERY * round(tok_s / (MICRO * 32) * TRAIN_S / LOG_EVERY), 200), 2000)
    # The pace can still change under the suite's load (the other worker's tests end: twice as fast, seen once,
    # and the run ended with the server down). So the outage also ends once the run has a checkpoint at
    # BACK_BY of its steps, whichever comes first: the server is back by then, whatever the pace.
    back = LOG_EVERY * round(steps * BACK_BY / LOG_EVERY)
    outage = tracking_outage(server, "long", OUTAGE_S, back_by=lambda: any(
        (wd / "ray_results" / "long").glob(f"checkpoint_{back:08d}*")))
    # In this process: what is under test is the loop and its tracker, which are the same in a Ray Train
    # worker, not Ray Train's 20 s of start-up. (Each epoch's reread of the shards shows in no window's pace:
    # 1.007 measured alone.) The outage starts after a few windows and ends with training still running.
    res = train(_cfg(tiny_data, "long", steps, micro=MICRO, ckpt_every=back), workdir=str(wd), tracking_uri=server.url)
    ended = time.time()
    outage.thread.join(timeout=OUTAGE_S + 60)
    assert outage.end, "the outage never happened"
    # Training went on well into the outage, and the server answered again before it ended (BACK_BY).
    assert ended > outage.start + 10, f"training ended {ended - outage.start:.0f} s into the outage ({steps} steps)"
    assert ended > outage.end, f"training ended {outage.end - ended:.1f} s before the server was back"
    assert res.step == steps and res.registered_version is not None  # the server was back for the run's end

    # The loop never waited on the server: windows kept coming at the rate they came with it up. A stall
    # (a call waiting out MLflow's ~250 s of retries) would leave a handful of windows at a fraction of it.
    # How close the rates are is a measurement, not an assertion: benchmarks/tracking_outage.py.
    up, down = outage_step_rates(real.url, res.run_id, outage)
    assert len(up) >= 3 and len(down) >= 5, (len(up), len(down))
    ratio = statistics.median(down) / statistics.median(up)
    with capfd.disabled():
        print(f"\nstep rate during the outage / with the server up: {ratio:.3f} ({len(down)} windows in "
              f"{OUTAGE_S:.0f} s down, {steps} steps)")
    # A loop that waited on the server would log no window while it is down (len(down) above); one that paid a
    # refused connection a window would crawl. The margin is wide: other processes on a loaded 2-core
    # machine move this ratio more than tracking does (0.56 seen at load 13; about 1.0 on a quiet machine).
    assert ratio > 0.3, ratio
    logged = [m.step for m in client.get_metric_history(res.run_id, "train/loss")]
    assert sorted(logged) == list(range(LOG_EVERY, steps + 1, LOG_EVERY))  # every window once, the outage's included

    # A run that ends while the server is down: one clear message, nothing registered; the next run of the
    # same command (server back) trains nothing, sends the metrics it kept and registers. In-process (Ray Train
    # is not what this part tests; one epoch of data, so no reread either).
    monkeypatch.setattr(loop_mod, "optimiser_step", real_step)
    server.stop()
    short = train(_cfg(tiny_data, "short", 60), workdir=str(wd), tracking_uri=server.url)
    assert short.registered_version is None
    assert "is unreachable: the run is trained" in capfd.readouterr().err  # a log line: WARNING on stderr
    server.start()
    again = train(_cfg(tiny_data, "short", 60), workdir=str(wd), tracking_uri=server.url)
    assert again.registered_version is not None and again.step == 60
    logged = [m.step for m in client.get_metric_history(again.run_id, "train/loss")]
    assert sorted(logged) == list(range(LOG_EVERY, 61, LOG_EVERY))


@pytest.mark.slow
def test_a_call_whose_retries_run_out_is_sent_again_once_the_server_is_back(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           tracking_server, gate) -> None:
    """The sender's give-up path against a real server (behind a gate that goes down): a batch whose call fails
    (here at once: no retries) goes back to the front of the queue, the logger keeps queuing, and once the server
    is back every step arrives exactly once, in order, without close() having to spool anything."""
    import mlflow

    from pipelines.tracking.runs import ensure_experiment, find_or_create_run
    from pipelines.tracking.spool import ResilientLogger

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    server = gate
    run_id, _ = find_or_create_run(server.url, ensure_experiment("giveup", server.url, tmp_path), "r")
    log = ResilientLogger(server.url, run_id, spool_dir=str(tmp_path / "spool"), retry_s=0.2, max_retry_s=0.5)
    log.log_metrics({"train/loss": 1.0}, 1)
    assert log.flush(timeout=60) is True
    server.stop()
    for step in range(2, 6):
        log.log_metrics({"train/loss": 1.0 / step}, step)
    deadline = time.time() + 30
    while log.failures < 2 and time.time() < deadline:  # the call failed, was queued again, failed again
        time.sleep(0.1)
    assert log.failures >= 2 and log.pending() == 4, (log.failures, log.pending())
    server.start()
    assert log.flush(timeout=60) is True and log.close() == 0
    assert not (tmp_path / "spool").exists()
    hist = mlflow.MlflowClient(tracking_server.url).get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in hist) == [1, 2, 3, 4, 5]


def test_a_sweep_and_a_study_say_refused_credentials_are_refused_and_go_on_through_an_outage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The sweep's and the study's MLflow runs go through the one ``best_effort`` helper the trainer uses: a server
    that answers 401 stops them in the line naming what to set (not "MLflow unavailable"), one that answers 503
    is an outage they go on without; after the work, a refusal is a warning that says so."""
    import dataclasses

    from pipelines.studies.runner import _mlflow_runs, plan_study
    from pipelines.studies.spec import parse_study
    from pipelines.tracking.runs import TrackingAuthError, best_effort, client
    from pipelines.tuning.space import load_space
    from pipelines.tuning.sweep import _parent_run, plan_sweep

    sweep_plan = plan_sweep(load_space(ROOT / "tune_spaces" / "demo.yaml"), ROOT / "configs" / "demo.yaml",
                            check_data=False, workdir=tmp_path, tracking_uri="sqlite:///:memory:")
    study = parse_study({"name": "t", "config": "configs/demo.yaml", "steps": 40, "arms": [{"name": "a"}]}, "t.yaml")
    study_plan = plan_study(study, workdir=str(tmp_path), tracking_uri="sqlite:///:memory:", root=ROOT)
    for status in (401, 403):
        with answering(status) as url:
            with pytest.raises(TrackingAuthError, match=f"refused this client's credentials \\(HTTP {status}\\)"):
                _parent_run(dataclasses.replace(sweep_plan, tracking_uri=url))
            with pytest.raises(TrackingAuthError, match="refused.*MLFLOW_TRACKING_USERNAME"):
                _mlflow_runs(dataclasses.replace(study_plan, tracking_uri=url))
            # MLflow's own client error for a 401/403 (no probe first): refused too, a warning after the work.
            caplog.clear()
            with best_effort(url, "the table is on disk", stop_on_refusal=False) as t:
                client(url).get_experiment_by_name("x")
            assert t.failed and t.refused
            assert "refused this client's credentials" in caplog.text and "unavailable" not in caplog.text
    with answering(503) as url:
        caplog.clear()
        assert _parent_run(dataclasses.replace(sweep_plan, tracking_uri=url)) is None
        assert "is unavailable" in caplog.text and "sweeping without a parent run" in caplog.text
        assert "refused" not in caplog.text
