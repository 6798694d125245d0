"""Private names of other packages: used only through the adapters (``adlm_model/compat``, ``pipelines/compat``),
and every name an adapter lists still there in the installed versions."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from adlm_model.compat import PrivateName

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("adlm_model", "pipelines", "benchmarks", "tools")
ADAPTERS = ("adlm_model.compat.torch", "adlm_model.compat.stdlib", "pipelines.compat.ray", "pipelines.compat.mlflow")
FIRST_PARTY = {"adlm_model", "pipelines", "tests", "tools"}
DOCUMENTED = {"_thread"}
"""Standard-library modules whose names start with an underscore but are documented public API."""
STDLIB = frozenset(sys.stdlib_module_names) - {n for n in sys.stdlib_module_names if n.startswith("_")}
"""The standard library moves with the interpreter, not with the lock: its modules' underscore names (``os._exit``)
are not counted; a private module of it (``_compat_pickle``) is."""
MARK = "# private:"
"""A test's import of a private name carries this comment (on its line or the line above) saying why no public
route serves."""


def _local_modules(path: Path) -> set[str]:
    """Top-level names a script imports from its own folders (benchmarks put theirs on ``sys.path``)."""
    names = set()
    for folder in {path.parent, ROOT / "benchmarks", ROOT / "tests"}:
        names |= {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path, source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each import of, or attribute reached through, another package's private name."""
    local = _local_modules(path) | FIRST_PARTY
    found: list[tuple[int, str]] = []
    modules: dict[str, str] = {}  # name bound in the file -> the third-party module it is
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in local:
                    continue
                if any(_private(p) for p in parts) and parts[0] not in DOCUMENTED:
                    found.append((node.lineno, f"import {a.name}"))
                if parts[0] not in STDLIB:
                    modules[a.asname or parts[0]] = a.name if a.asname else parts[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] in local or parts[0] in STDLIB:
                continue
            names = [a.name for a in node.names if _private(a.name)]
            if any(_private(p) for p in parts) and parts[0] not in DOCUMENTED or names:
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
            for a in node.names:
                modules.setdefault(a.asname or a.name, f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                found.append((node.lineno, f"{ast.unparse(node)} (of {modules[root.id]})"))
    return sorted(set(found))


def _files(top: str) -> list[Path]:
    return [p for p in sorted((ROOT / top).rglob("*.py")) if "compat" not in p.relative_to(ROOT).parts]


def test_no_private_name_of_another_package_outside_the_adapters() -> None:
    """adlm_model, pipelines and benchmarks reach other packages' private names only through ``compat``."""
    found = [f"{p.relative_to(ROOT)}:{line} {what}" for top in SCANNED for p in _files(top)
             for line, what in private_uses(p, p.read_text())]
    assert not found, "private names outside the compat adapters (move them there): " + "; ".join(found)


def test_a_private_import_put_back_in_the_registry_is_found() -> None:
    """The check is not blind: the import MLflow 3.18 broke, put back into ``pipelines/tracking/registry.py``."""
    path = ROOT / "pipelines" / "tracking" / "registry.py"
    source = path.read_text() + "\n\ndef check():\n    from mlflow.utils.validation import _validate_model_name\n"
    assert [what for _, what in private_uses(path, source)] == [
        "from mlflow.utils.validation import _validate_model_name"]
    attr = path.read_text() + "\nimport ray\nray._private.worker.global_worker\n"
    assert any("ray._private (of ray)" in what for _, what in private_uses(path, attr))


def test_tests_say_why_they_use_a_private_name() -> None:
    """A test may import a private name only where no public route exists, with a ``# private:`` comment."""
    unmarked = []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        lines = p.read_text().splitlines()
        for line, what in private_uses(p, p.read_text()):
            near = lines[max(0, line - 2):line]
            if not any(MARK in x for x in near):
                unmarked.append(f"{p.relative_to(ROOT)}:{line} {what}")
    assert not unmarked, f"private names in tests without a '{MARK} <why>' comment: " + "; ".join(unmarked)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_every_private_name_an_adapter_lists_is_there(adapter: str) -> None:
    """What a release of torch, Ray or MLflow removed is found here, naming the adapter to update."""
    names = importlib.import_module(adapter).PRIVATE
    assert names, adapter
    for name in names:
        assert name.load() is not None, name


def test_every_adapter_is_listed() -> None:
    found = {".".join(p.relative_to(ROOT).with_suffix("").parts) for top in SCANNED
             for p in (ROOT / top).glob("compat/*.py") if p.name != "__init__.py"}
    assert found == set(ADAPTERS)


@pytest.mark.parametrize("where", ["adlm_model", "pipelines"])
def test_a_missing_private_name_says_which_adapter_to_update(where: str) -> None:
    """Both packages' ``PrivateName`` (``pipelines.compat`` keeps its own so that it imports no torch)."""
    compat = importlib.import_module(f"{where}.compat")
    gone = compat.PrivateName("mlflow.utils.validation", "_validate_no_such_name", "a validator",
                              "the adapter of this test")
    with pytest.raises(compat.MissingPrivateAPI) as e:
        gone.load()
    msg = str(e.value)
    assert "mlflow.utils.validation._validate_no_such_name is not in the installed mlflow 3." in msg, msg
    assert "update the adapter of this test for this release" in msg and "\n" not in msg


def test_the_pipelines_adapters_import_no_torch() -> None:
    """A command's ``--help`` and the data stage import ``pipelines.core.logs``, and so its Ray adapter: no torch there."""
    import subprocess

    code = "import sys, pipelines.core.logs, pipelines.compat.ray, pipelines.compat.mlflow; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_the_foreach_fallback_equals_the_fused_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """EMA's update without torch's fused lerp (a release without it) gives the same tensors."""
    import torch

    from adlm_model.compat import torch as compat_torch

    g = torch.Generator().manual_seed(0)
    a, b = [torch.randn(5, generator=g) for _ in range(3)], [torch.randn(5, generator=g) for _ in range(3)]
    fused = [t.clone() for t in a]
    compat_torch.foreach_lerp_(fused, b, 0.3)
    monkeypatch.setattr(compat_torch, "FOREACH_LERP", PrivateName("torch", "_no_such_lerp", "gone", "x"))
    looped = [t.clone() for t in a]
    compat_torch.foreach_lerp_(looped, b, 0.3)
    for f, lo, x, y in zip(fused, looped, a, b, strict=True):
        assert torch.allclose(f, lo) and torch.allclose(f, x + 0.3 * (y - x))
