"""The deployment recipes: cluster.yaml against Ray's own schema, runtime_env.yaml, mlflow/."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _validate(cfg: dict) -> None:
    # A private module of Ray: checked with ray==2.60.0, the version pyproject.toml pins.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cfg)))


def test_cluster_yaml_validates_with_rays_schema() -> None:
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    _validate(cfg)
    nodes = cfg["available_node_types"]
    gpu = nodes["gpu_worker"]
    assert gpu["min_workers"] == 0 and gpu["max_workers"] > 0 and gpu["resources"]["GPU"] > 0
    assert nodes["cpu_worker"]["resources"]["CPU"] > 0 and "GPU" not in nodes["cpu_worker"]["resources"]
    assert nodes[cfg["head_node_type"]]["resources"].get("GPU", 0) == 0
    import ray

    assert f"rayproject/ray:{ray.__version__}-py311" in cfg["docker"]["image"]
    assert any("[gpu]" in c for c in cfg["setup_commands"])
    assert cfg["idle_timeout_minutes"] > 0
    start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start  # never opened to the internet
    env = " ".join(cfg["docker"]["run_options"])
    assert "MLFLOW_TRACKING_URI" in env and "ADLM_WORKDIR" in env


def test_cluster_yaml_schema_rejects_a_misspelt_key() -> None:
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
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
