"""The deployment recipes: cluster.yaml against Ray's own schema, runtime_env.yaml, mlflow/."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _validate(cfg: dict) -> None:
    # A private module of Ray: checked with ray==2.60.0, the version pyproject.toml pins.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cfg)))


def _cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_validates_with_rays_schema() -> None:
    cfg = _cluster()
    _validate(cfg)
    nodes = cfg["available_node_types"]
    assert nodes[cfg["head_node_type"]]["resources"] == {"CPU": 0}  # nothing of a job runs on the head
    for name, node in nodes.items():
        if name != cfg["head_node_type"]:
            assert node["min_workers"] == 0 and node["max_workers"] > 0, f"{name} does not scale from zero"
    assert any(n["resources"].get("GPU", 0) > 0 for n in nodes.values())
    import ray

    assert cfg["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-py311")
    assert cfg["idle_timeout_minutes"] > 0
    start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start  # never opened to the internet
    env = " ".join(cfg["docker"]["run_options"])
    assert "MLFLOW_TRACKING_URI" in env and "ADLM_WORKDIR" in env


def test_gpu_nodes_boot_a_prebuilt_image_instead_of_compiling_flash_attn() -> None:
    cfg = _cluster()
    for name, node in cfg["available_node_types"].items():
        if node["resources"].get("GPU", 0) > 0:
            assert node["docker"]["worker_image"], name
            setup = " ".join(node.get("worker_setup_commands", []))
            assert "[gpu]" not in setup and "flash" not in setup and "--no-deps" in setup, setup
    assert "[gpu]" not in " ".join(cfg.get("setup_commands", []) + cfg.get("worker_setup_commands", []))
    image = (ROOT / "configs" / "gpu.Dockerfile").read_text()
    assert "flash-attn" in image and "torch==2.13.0" in image


def _recipes() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda p: p.name)
def test_every_recipe_fits_one_node_type_of_the_cluster(recipe: Path) -> None:
    """A trainer's worker group packs onto one node with the CPUs and GPUs it asks for (plus the CPUs its Ray
    Data read tasks take), so the autoscaler can launch a node that runs it."""
    from pipelines.training.config import load_config

    cfg = load_config(recipe)
    s = cfg.scaling
    workers = max(1, s.num_workers)
    need_cpu = workers * s.cpus_per_worker + cfg.data.read_cpus
    need_gpu = workers if s.use_gpu else 0
    nodes = _cluster()["available_node_types"]
    fits = [name for name, n in nodes.items()
            if n["resources"].get("CPU", 0) >= need_cpu and n["resources"].get("GPU", 0) >= need_gpu]
    assert fits, f"{recipe.name}: {workers} workers x {s.cpus_per_worker} CPU (+ reads) and {need_gpu} GPUs fit no node"


def test_no_credential_travels_in_the_job_runtime_env_or_the_cluster_config() -> None:
    """Ray's token authentication stays on; tokens and keys come from the nodes, never from files a job
    uploads or the dashboard shows."""
    env = yaml.safe_load((ROOT / "runtime_env.yaml").read_text())
    secret = re.compile(r"TOKEN(?!IZERS)|SECRET|PASSWORD|KEY|CREDENTIAL", re.I)
    assert not [k for k in env.get("env_vars", {}) if secret.search(k)]
    assert env.get("env_vars", {}).get("RAY_AUTH_MODE", "token") != "disabled"
    cluster = (ROOT / "cluster.yaml").read_text()
    assert "RAY_AUTH_MODE=disabled" not in cluster and "RAY_AUTH_MODE=token" in cluster
    assert not re.search(r"RAY_AUTH_TOKEN=\S", cluster.replace("RAY_AUTH_TOKEN=$(", ""))
    assert not re.search(r"AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY)=", cluster)


def test_cluster_yaml_schema_rejects_a_misspelt_key() -> None:
    cfg = _cluster()
    cfg["idle_timeout_minuts"] = 5
    with pytest.raises(Exception, match="Additional properties are not allowed"):
        _validate(cfg)


def test_runtime_env_excludes_heavy_folders() -> None:
    env = yaml.safe_load((ROOT / "runtime_env.yaml").read_text())
    for folder in (".git", ".venv", "work", "data"):
        assert folder in env["excludes"]


def test_mlflow_folder_does_not_shadow_the_package() -> None:
    folder = ROOT / "mlflow"
    assert not (folder / "__init__.py").exists() and not (folder / "mlflow.py").exists()
    import mlflow

    assert Path(mlflow.__file__).resolve().parent != folder.resolve()
