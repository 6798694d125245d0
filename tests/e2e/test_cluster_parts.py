"""The pieces of the cluster story that need no cluster: secrets never shown, what drivers forward to
workers, the tokenizer actor pool's bounds, evaluation tasks asking for a GPU, and the node-local path warning
on a one-node Ray. (Hugging Face splits on a cluster are read as the hub's Parquet files: tests/pipelines/test_prepare_hub.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cluster import ROOT, s3_server


def test_uris_lose_their_secrets_in_everything_the_pipeline_prints() -> None:
    from pipelines.orchestration.summary import summary_markdown
    from pipelines.tracking.runs import redact_uri

    assert redact_uri("postgresql://mlflow:hunter2@db:5432/mlflow") == "postgresql://mlflow:***@db:5432/mlflow"
    assert redact_uri("https://alice:p%40ss@mlflow.internal") == "https://alice:***@mlflow.internal"
    assert redact_uri("https://mlflow.internal/?token=abc&x=1") == "https://mlflow.internal/?token=***&x=1"
    for plain in ("http://127.0.0.1:5000", "sqlite:////tmp/mlflow.db", "databricks"):
        assert redact_uri(plain) == plain
    summary = {"profile": "smoke", "model_name": "adlm", "champion": None, "rows": [], "timings_s": {"total": 1.0},
               "tracking_uri": "https://alice:hunter2@mlflow.internal", "comparable": False}
    shown = summary_markdown(summary)
    assert "hunter2" not in shown and "alice:***@mlflow.internal" in shown


def test_drivers_forward_no_credential_to_a_clusters_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines.core.runtime import FORWARDED_ENV, forwarded_env

    secrets = {"AWS_SECRET_ACCESS_KEY": "s", "AWS_ACCESS_KEY_ID": "a", "AWS_SESSION_TOKEN": "t", "HF_TOKEN": "h",
               "MLFLOW_TRACKING_PASSWORD": "p", "MLFLOW_TRACKING_TOKEN": "t", "RAY_AUTH_TOKEN": "r",
               "MLFLOW_TRACKING_URI": "https://u:p@mlflow", "GOOGLE_APPLICATION_CREDENTIALS": "/k.json"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ADLM_CACHE", "/tmp/adlm-cache")
    monkeypatch.setenv("ADLM_WORKDIR", "s3://bucket/run")
    env = forwarded_env()
    assert env["ADLM_CACHE"] == "/tmp/adlm-cache" and not set(secrets) & set(env)
    assert "ADLM_WORKDIR" not in env  # the work directory is an argument of every task, never their environment
    import re

    secret_like = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|CREDENTIALS?|KEY)(_|$)")
    assert not [k for k in FORWARDED_ENV if secret_like.search(k)]


def test_the_tokenizer_actor_pool_grows_and_shrinks_within_its_bounds() -> None:
    from pipelines.data.plan import MAX_ACTORS, PrepareConfig
    from pipelines.data.prepare import ACTOR_BYTES, actor_pool_bounds

    # Not sized from the CPUs present at start: one actor at first, up to one a unit (or --actors).
    assert actor_pool_bounds(PrepareConfig(), 1000) == (1, MAX_ACTORS)
    assert actor_pool_bounds(PrepareConfig(), 3) == (1, 3)
    assert actor_pool_bounds(PrepareConfig(actors=8, min_actors=2), 1000) == (2, 8)
    assert actor_pool_bounds(PrepareConfig(actors=8, min_actors=4), 2) == (2, 2)
    # A small text input gets no actor its units would leave idle: one per ACTOR_BYTES at most, unless --actors.
    assert actor_pool_bounds(PrepareConfig(), 8, text_bytes=132_000) == (1, 1)
    assert actor_pool_bounds(PrepareConfig(), 8, text_bytes=3 * ACTOR_BYTES + 1) == (1, 4)
    assert actor_pool_bounds(PrepareConfig(), 1000, text_bytes=10**12) == (1, MAX_ACTORS)
    assert actor_pool_bounds(PrepareConfig(actors=8), 8, text_bytes=132_000) == (1, 8)


def test_evaluation_asks_for_a_gpu_for_large_work_even_before_one_is_up(ray_session) -> None:
    from adlm_model.kinds import parameter_count
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.executors import RayExecutor
    from pipelines.training.config import load_config
    from tests.conftest import ROOT

    assert ray_session.cluster_resources().get("GPU", 0) == 0  # this machine: no GPU is up
    auto = RayExecutor(cpus=0.5, gpus=-1)
    assert auto.gpus_for(large=True) == 1.0  # the autoscaler launches a GPU node; no silent CPU fallback
    assert auto.gpus_for(large=False) == 0.0
    assert RayExecutor(cpus=0.5, gpus=0).gpus_for(large=True) == 0.0  # told: CPU
    threshold = EvalConfig().gpu_min_params
    assert parameter_count(load_config(ROOT / "configs" / "owt_adlm_small.yaml").model) >= threshold
    assert parameter_count(load_config(ROOT / "configs" / "demo.yaml").model) < threshold


def test_a_one_node_ray_needs_no_shared_storage(ray_session, tmp_path) -> None:
    from pipelines.core.storage import warn_if_node_local

    assert not warn_if_node_local([str(tmp_path)], "test")  # every task runs here: a local path is fine


def test_a_cache_entry_is_built_once_per_cluster_through_the_work_directorys_store(tmp_path) -> None:
    """What the converted evaluation LM goes through (a GGUF file dequantised once: about a minute of CPU): with
    a remote work directory the entry goes to ``<workdir>/cache`` in the store, and a node without it fetches it
    there instead of building it again."""
    from pipelines.core.storage import SHARED_DONE, shared_cache_entry

    built: list[str] = []

    def build(d):
        built.append(d.name)
        d.mkdir()
        (d / "config.json").write_text('{"a": 1}')
        (d / "model.safetensors").write_bytes(bytes(range(256)) * 1000)

    def complete(d):
        return (d / "config.json").is_file() and (d / "model.safetensors").is_file()

    with s3_server() as s3:
        shared = f"s3://{s3.bucket}/run/cache/gguf/lm-f32-0123"
        node_a = shared_cache_entry(tmp_path / "a" / "lm-f32-0123", build, complete, shared)
        assert len(built) == 1 and complete(node_a)
        assert {"run/cache/gguf/lm-f32-0123/model.safetensors", f"run/cache/gguf/lm-f32-0123/{SHARED_DONE}"} <= set(
            s3.keys("run/cache/"))
        node_b = shared_cache_entry(tmp_path / "b" / "lm-f32-0123", build, complete, shared)
        assert len(built) == 1  # fetched, not built
        assert (node_b / "model.safetensors").read_bytes() == (node_a / "model.safetensors").read_bytes()
        assert shared_cache_entry(node_a, build, complete, shared) == node_a and len(built) == 1
        # A node that built its entry before the store had one shares it then.
        s3_keys = s3.keys("run/cache/")
        import boto3

        boto3.client("s3", endpoint_url=s3.endpoint).delete_objects(
            Bucket=s3.bucket, Delete={"Objects": [{"Key": k} for k in s3_keys]})
        shared_cache_entry(node_a, build, complete, shared)
        assert f"run/cache/gguf/lm-f32-0123/{SHARED_DONE}" in s3.keys("run/cache/") and len(built) == 1
    assert not list(tmp_path.rglob("*.tmp-*"))
    # Without a shared store: this node's entry alone.
    assert shared_cache_entry(tmp_path / "c" / "x", build, complete) == tmp_path / "c" / "x" and len(built) == 2


_BUILD_ONCE = """
import sys, time
from pathlib import Path
from pipelines.core.storage import shared_cache_entry

log, entry = Path(sys.argv[1]), Path(sys.argv[2])

def build(d):
    with log.open("a") as fh:
        fh.write("built\\n")
    d.mkdir()
    time.sleep(1.0)  # long enough that the other process asks while this one builds
    (d / "model.safetensors").write_bytes(b"w")

shared_cache_entry(entry, build, lambda d: (d / "model.safetensors").is_file())
"""


def test_processes_of_one_node_that_ask_for_a_cache_entry_at_once_build_it_once(tmp_path) -> None:
    """Two processes (two test workers, two Ray tasks of a node) ask for the same missing entry at the same time:
    one builds it, the other waits and takes it."""
    log, entry = tmp_path / "log", tmp_path / "cache" / "lm-f32-0123"
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_ONCE, str(log), str(entry)], cwd=ROOT) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert log.read_text() == "built\n" and (entry / "model.safetensors").read_bytes() == b"w"
    assert not list(tmp_path.rglob("*.tmp-*"))


@pytest.mark.slow
def test_a_best_checkpoint_cut_short_mid_upload_is_never_registered(tiny_data, tmp_path, ray_session) -> None:
    """The training process dies after the first file of a new best checkpoint is uploaded (the fault
    ``train.crash_writing_best``): the run's best is still the previous, complete one, and the rerun of the same
    command resumes, finishes and registers complete weights (model and EMA) of its best step. The command in local
    mode (``num_workers: 0``, on the session's Ray): the process that dies is the one writing, as a Ray Train
    worker would be; the writer is the same code (``publish_best``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mlflow
    from safetensors.torch import load_file

    from adlm_model.interop.checkpoint import read_config
    from pipelines.training.checkpoints import BEST, best_checkpoint
    from tests.support.data import TINY_MODEL, data_overrides, set_args

    root = Path(__file__).resolve().parents[2]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    wd = tmp_path / "work"
    run_dir = wd / "ray_results" / "cut-best"
    sets = [*data_overrides(tiny_data), *TINY_MODEL, "run.name=cut-best", "run.max_steps=8", "run.val_every=2",
            "run.ckpt_every=2", "run.log_every=2", "run.val_batches=1", "batch.global_batch=8", "batch.micro_batch=8",
            "scaling.num_workers=0", "scaling.threads=1", "optim.warmup_steps=1", "optim.lr=3e-3",
            "mlflow.experiment=cut-best"]
    cmd = [sys.executable, "-m", "pipelines.train", "--config", str(root / "configs" / "demo.yaml"), "--workdir",
           str(wd), *set_args(sets)]
    env = {**os.environ, "PYTHONPATH": str(root), "MLFLOW_TRACKING_URI": uri,
           "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}

    died = subprocess.run(cmd, env={**env, "ADLM_FAULT": "train.crash_writing_best=4"}, capture_output=True,
                          text=True, timeout=300)
    assert died.returncode == 1, died.stderr[-3000:]  # os._exit(1) mid-upload
    assert (run_dir / ".crashed_writing_best").read_text() == "4", "the fault never fired (step 4 no better?)"
    cut = [p for p in run_dir.glob(f"{BEST}-00000004-*")]
    assert len(cut) == 1 and sorted(p.name for p in cut[0].iterdir()) == ["config.json"]  # cut short
    best = Path(best_checkpoint(run_dir))
    assert best != cut[0] and read_config(best)[1]["step"] == 2 and (best / "ema.safetensors").is_file()

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]  # registered (a run left unregistered exits 3)
    assert not cut[0].exists()  # the folder the killed writer left is gone
    mv = mlflow.MlflowClient(uri).get_model_version_by_alias("adlm", "candidate")
    assert mv.tags["run_name"] == "cut-best" and int(mv.tags["final_step"]) == 8
    local = Path(mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path="checkpoint",
                                                     dst_path=str(tmp_path / "dl"), tracking_uri=uri))
    assert {"config.json", "model.safetensors", "ema.safetensors"} <= {p.name for p in local.iterdir()}
    assert read_config(local)[1]["step"] == int(mv.tags["step"])
    assert load_file(str(local / "ema.safetensors")) and load_file(str(local / "model.safetensors"))


def test_an_export_without_its_ema_weights_is_an_error(tmp_path) -> None:
    from pipelines.training.checkpoints import fetch_export

    src = tmp_path / "ckpt"
    src.mkdir()
    for f in ("config.json", "model.safetensors"):
        (src / f).write_bytes(b"{}")
    with pytest.raises(FileNotFoundError, match="lacks ema.safetensors"):
        fetch_export(src, tmp_path / "out")


def test_a_ray_start_that_misses_rays_start_up_window_is_tried_once_more_and_nothing_else_is() -> None:
    """The tests' one retry policy for every Ray they start (tests/conftest.py): a raylet that timed out during
    start-up gets one more try from scratch, after its remains are undone; any other failure, or a second timeout,
    is raised as it came."""
    from tests.conftest import start_ray_once_more_if_late

    calls: list[str] = []

    def late_then_up() -> str:
        calls.append("start")
        if calls.count("start") == 1:
            raise RuntimeError("The current node timed out during startup.")
        return "up"

    assert start_ray_once_more_if_late(late_then_up, undo=lambda: calls.append("undo")) == "up"
    assert calls == ["start", "undo", "start"]

    def broken() -> None:
        calls.append("broken")
        raise ValueError("bad resources")

    calls.clear()
    with pytest.raises(ValueError, match="bad resources"):
        start_ray_once_more_if_late(broken, undo=lambda: calls.append("undo"))
    assert calls == ["broken", "undo"]

    def always_late() -> None:
        raise RuntimeError("timed out during startup")

    with pytest.raises(RuntimeError, match="timed out"):
        start_ray_once_more_if_late(always_late, undo=lambda: None)
