"""The page "Train on your own data" (docs/usage/own-data.md), run from the page itself: every command block it
marks runs, in its order, in bash, as a user's shell would run it, so the page cannot drift from what runs.

What stands in for the user's world: a moto S3 server (the bucket; slices of the bundled corpus as the user's JSONL
files), an MLflow tracking server whose artifacts live in that bucket, and a Ray cluster on this machine with token
authentication (a 0-CPU head and one 2-CPU node) whose nodes know the work directory and the tracking server, as
cluster.yaml's do. The test replaces the page's settings block with its own values (the same names), and runs the
page's commands at toy size: ``TOY_TEXT`` lists every piece of command text it changes and ``TOY_FILES`` every key
of the files the page writes, each checked to be on the page. Before shrinking them, it checks that the page's own
recipe and search space are valid as written and that the recipe fits the data the page's ``prepare_data`` line
makes (vocabulary, mask id, length)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import away_from_session_ray, free_port
from tests.support.cluster import (
    BIN,
    ROOT,
    http_ok,
    mlflow_server,
    node_settings,
    ray_cluster_process,
    s3_server,
    stop_group,
    tracked_files,
)

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "usage" / "own-data.md"
TOKEN = "journey0123456789abcdef01234567"
BUCKET = "your-bucket"

BLOCK = re.compile(r"<!-- journey: (\w+) -->\n```bash\n(.*?)```", re.S)


def page_blocks() -> list[tuple[str, str]]:
    """(kind, code) of each marked block of the page, in order: ``settings``, ``run`` or ``background``."""
    return BLOCK.findall(PAGE.read_text())


def settings_names(code: str) -> set[str]:
    return set(re.findall(r"^(?:export )?([A-Z_]+)=", code, re.M))


def toy_text(port: int) -> dict[str, str]:
    """Page text -> what the test runs instead (each must be on the page): the toy sizes, and a free port."""
    return {
        "--train-tokenizer 32768 --length 1024": "--train-tokenizer 512 --length 32 --actor-cpus 0.25",
        "--set num_samples=500": "--set num_samples=8 --set sample_batch_size=8 --set steps=8 --set max_rows=32 "
                                 "--set batch_size=8 --set cpus_per_task=0.5 --set stage1_rows=16 "
                                 "--set stage2_suite=ppl,generate",
        "--port 5001": f"--port {port}",
        "127.0.0.1:5001": f"127.0.0.1:{port}",
    }


TOY_FILES: dict[str, dict] = {
    "configs/mine_adlm.yaml": {
        "model": {"preset": "tiny", "hidden": 32, "heads": 2, "n_blocks": 1, "denoiser_blocks": 1, "cond_dim": 16,
                  "vocab_size": 512, "seq_len": 32},
        "batch": {"global_batch": 8, "micro_batch": 8},
        "run": {"max_steps": 8, "val_every": 4, "ckpt_every": 4, "log_every": 4, "val_batches": 1},
        # the run in its job's (or trial's) own process: no Ray Train worker group to start at this size
        "scaling": {"num_workers": 0, "use_gpu": False, "cpus_per_worker": 0.5},
    },
    "tune_spaces/mine.yaml": {
        "params": {"tau": {"distribution": "grid", "values": [2, 5]}},
        "scheduler": {"grace_period": 4, "reduction_factor": 2, "max_t": 8},
        "num_samples": 1,
        "resources": {"trial_cpu": 0.01},
        "overrides": {"run.max_steps": 8, "model.gamma_horizon": 8, "run.val_every": 4, "run.ckpt_every": 4,
                      "run.log_every": 4, "run.val_batches": 1},
    },
}
"""The files the page writes, shrunk to toy size: each section's keys over the page's (the page's section must
exist; a key the page's file lacks is added)."""


def _overlay(page: dict, toy: dict, where: str) -> dict:
    out = dict(page)
    for key, value in toy.items():
        assert key in page, f"{where}: the page's file has no {key!r} (TOY_FILES is out of date)"
        if isinstance(value, dict) and isinstance(page[key], dict) and key != "overrides":
            out[key] = {**page[key], **value}
        else:
            out[key] = value
    return out


def _valid_as_written(path: Path, prepare: str) -> None:
    """A file the page writes loads and validates at its real size; a recipe fits what the page's
    ``prepare_data`` line makes (a trained BPE of N entries: vocab_size N, its mask token at id 2)."""
    from pipelines.training.config import load_config
    from pipelines.tuning.space import load_space

    if path.parent.name == "tune_spaces":
        load_space(path)
        return
    cfg = load_config(path)
    vocab = int(re.search(r"--train-tokenizer (\d+)", prepare).group(1))
    length = int(re.search(r"--length (\d+)", prepare).group(1))
    assert (cfg.model.vocab_size, cfg.model.mask_id, cfg.model.seq_len) == (vocab, 2, length)
    assert cfg.scaling.use_gpu and cfg.batch.global_batch % (cfg.batch.micro_batch * cfg.scaling.num_workers) == 0


def _user_env(s3_env: dict[str, str]) -> dict[str, str]:
    """A fresh shell on the user's machine: no Ray or pipeline setting, the venv first on PATH, the object
    store's endpoint and credentials (on AWS: the user's own)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("MLFLOW_TRACKING_URI", "ADLM_WORKDIR", "PYTHONPATH")}
    return {**env, **s3_env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
            "NO_PROXY": "127.0.0.1,localhost"}


def _checkout(dest: Path) -> Path:
    """The user's checkout: this repository's files (tracked, or new and not ignored)."""
    for f in tracked_files():
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def _corpus(s3, tmp: Path) -> None:
    """The user's files: slices of the bundled corpus as JSONL, the text under ``body``, in the bucket."""
    import boto3

    from pipelines.data.embedded import embedded_slices

    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for split, path in embedded_slices(tmp, {"train": 60_000, "validation": 12_000}).items():
        lines = [json.dumps({"id": i, "body": line}) for i, line in enumerate(Path(path).read_text().splitlines())]
        client.put_object(Bucket=s3.bucket, Key=f"corpus/{split}/part-0.jsonl", Body=("\n".join(lines) + "\n").encode())


def test_the_own_data_page_runs_from_corpus_to_served_model(tmp_path: Path) -> None:
    import mlflow

    blocks = page_blocks()
    kinds = [k for k, _ in blocks]
    assert kinds[0] == "settings" and kinds.count("settings") == 1 and "background" in kinds, kinds
    page_settings = settings_names(blocks[0][1])
    used = {v for _, code in blocks[1:] for v in re.findall(r"\$\{?([A-Z_]+)", code)}
    assert used <= page_settings, f"the page's commands read {used - page_settings}, which its settings lack"
    port = free_port()
    toy = toy_text(port)
    page_text = "".join(code for _, code in blocks)
    for text in toy:
        assert text in page_text, f"{text!r} is no longer on the page (toy_text is out of date)"

    token_file = tmp_path / "auth_token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    with away_from_session_ray(), s3_server(BUCKET) as s3:
        _corpus(s3, tmp_path / "corpus-text")
        workdir = f"s3://{BUCKET}/adlm"
        with mlflow_server(tmp_path / "mlflow.db", f"s3://{BUCKET}/mlartifacts", tmp_path / "mlflow.log") as ml:
            node_env = {**_user_env(s3.env), **node_settings(), "RAY_AUTH_MODE": "token",
                        "RAY_AUTH_TOKEN_PATH": str(token_file), "ADLM_WORKDIR": workdir, "MLFLOW_TRACKING_URI": ml.url}
            with ray_cluster_process(node_env, tmp_path / "cluster.log", nodes=1, cpus=2) as rc:
                settings = {"AWS_REGION": s3.env["AWS_DEFAULT_REGION"], "ADLM_WORKDIR": workdir,
                            "MLFLOW_TRACKING_URI": ml.url, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN,
                            "JOBS": rc.dashboard, "CORPUS": f"s3://{BUCKET}/corpus"}
                assert set(settings) == page_settings, (set(settings) ^ page_settings)
                _run_page(blocks[1:], toy, _checkout(tmp_path / "checkout"), _user_env(s3.env), settings, tmp_path)

            client = mlflow.MlflowClient(ml.url)
            versions = client.search_model_versions("name='mine'")
            assert len(versions) == 2, [v.tags for v in versions]  # the trained run and the sweep's best
            champion = client.get_model_version_by_alias("mine", "champion")
            assert champion.tags["eval.status"] == "promoted"
        keys = s3.keys()
        for pattern in (r"adlm/data/mine/train/part-\d+\.parquet", r"adlm/data/mine/tokenizer\.json",
                        r"adlm/ray_results/mine-adlm/.+", r"adlm/sweeps/mine-gamma-tau/trials\.csv",
                        r"mlartifacts/.+/model\.safetensors"):
            assert any(re.fullmatch(pattern, k) for k in keys), f"nothing in the bucket matches {pattern}"
        assert not (tmp_path / "checkout" / "work").exists()  # nothing of the run on the user's disk


def _run_page(blocks: list[tuple[str, str]], toy: dict[str, str], checkout: Path, env: dict[str, str],
              settings: dict[str, str], tmp_path: Path) -> None:
    """Each block in its own bash (``set -euo pipefail``) in the checkout, after the settings; a file the page
    writes is checked as written, then shrunk; the background block (the server) runs until the end."""
    prelude = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in settings.items())
    server, log = None, tmp_path / "page.log"
    outputs: list[str] = []
    try:
        for i, (kind, code) in enumerate(blocks):
            for page, test in toy.items():
                code = code.replace(page, test)
            script = "set -euo pipefail\n" + prelude + code
            if kind == "background":
                fh = (tmp_path / "server.log").open("wb")
                server = subprocess.Popen(["bash", "-c", script], cwd=checkout, env=env, stdout=fh,
                                          stderr=subprocess.STDOUT, start_new_session=True)
                url = re.search(r"--port (\d+)", code).group(1)
                deadline = time.monotonic() + 180
                while not http_ok(f"http://127.0.0.1:{url}/ping"):
                    assert server.poll() is None and time.monotonic() < deadline, \
                        (tmp_path / "server.log").read_text(errors="replace")[-4000:]
                    time.sleep(1)
                continue
            r = subprocess.run(["bash", "-c", script], cwd=checkout, env=env, capture_output=True, text=True,
                               timeout=900)
            outputs.append(r.stdout)
            with log.open("a") as fh:
                fh.write(f"---- block {i}\n{code}\n---- rc {r.returncode}\n{r.stdout}\n{r.stderr}\n")
            assert r.returncode == 0, f"block {i} failed:\n{code}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
            for name in re.findall(r"cat > (\S+) <<'EOF'", code):
                # the file is shrunk after its block, so nothing in that block may read it
                assert code.rstrip().endswith("EOF") and code.count("<<'EOF'") == 1, code
                path = checkout / name
                assert name in TOY_FILES, f"the page writes {name}, which TOY_FILES does not shrink"
                _valid_as_written(path, next(c for _, c in blocks if "pipelines.prepare_data" in c))
                path.write_text(yaml.safe_dump(_overlay(yaml.safe_load(path.read_text()), TOY_FILES[name], name)))
        answer = json.loads(outputs[-1])
        prediction = answer["predictions"][0]
        assert prediction["seed"] == 7 and prediction["text"].startswith("The") and prediction["new_tokens"] > 0
    finally:
        if server is not None:
            stop_group(server)
