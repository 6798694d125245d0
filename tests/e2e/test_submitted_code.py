"""A job runs exactly the code it was submitted with. A node whose venv holds an editable install of
some checkout has that install's import hook, which maps ``pipelines`` and ``adlm_model`` and their modules to the
checkout's folders after the path finder: a module the submitter deleted would still import from there.
``pipelines/__init__.py`` drops such a hook when the package is not the folder it maps. Here in one process; the
whole job (driver, Ray Train workers, Tune trials, Ray Data actors, evaluation tasks) in tests/e2e/test_cluster.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import importlib.util, json, sys
import pipelines
out = {"file": pipelines.__file__,
       "deleted": importlib.util.find_spec("pipelines.import_model") is not None,
       "deleted_model": importlib.util.find_spec("adlm_model.testbed") is not None,
       "hook": any(hasattr(sys.modules.get(getattr(f, "__module__", "") or ""), "MAPPING") for f in sys.meta_path)}
try:
    from pipelines import _added
    out["added"] = _added.MARK
except ImportError:
    out["added"] = None
print(json.dumps(out))
"""


def _editable_hook() -> bool:
    """Whether this venv installs the project editable (``make install`` does), with a mapping import hook."""
    return any(p.name.startswith("__editable__") and p.name.endswith("_finder.py")
               for p in Path(sys.prefix).glob("lib/python*/site-packages/*"))


def _check(cwd: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _copy(dest: Path, guard: bool) -> Path:
    """``pipelines`` and ``adlm_model`` as a submitter's edited copy: a module added, one deleted from each."""
    for pkg in ("pipelines", "adlm_model"):
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "pipelines" / "import_model.py").unlink()
    # A whole subpackage deleted, and the package's import of it: the hook maps a package's immediate children
    # (a module nested deeper is looked up in its parent's folder, the copy's), so this is what it could supply.
    shutil.rmtree(dest / "adlm_model" / "testbed")
    init = dest / "adlm_model" / "__init__.py"
    lines = init.read_text().splitlines(keepends=True)
    init.write_text("".join(line for line in lines if not line.startswith("from .testbed")))
    (dest / "pipelines" / "_added.py").write_text('MARK = "submitted"\n')
    if not guard:  # the package's __init__ as it was before the fix
        init = (dest / "pipelines" / "__init__.py").read_text()
        (dest / "pipelines" / "__init__.py").write_text(init[:init.index("import sys as _sys")])
    return dest


@pytest.mark.skipif(not _editable_hook(), reason="this venv has no editable install of the project")
def test_a_submitted_copy_imports_its_own_modules_and_not_a_deleted_one_from_the_nodes_install(tmp_path: Path) -> None:
    got = _check(_copy(tmp_path / "job", guard=True))
    assert got["file"].startswith(str(tmp_path / "job")) and got["added"] == "submitted"
    assert not got["deleted"] and not got["deleted_model"] and not got["hook"], got
    # Without the guard the node's install supplies both deleted modules, from this checkout: what it fixes.
    unguarded = _check(_copy(tmp_path / "old", guard=False))
    assert unguarded["deleted"] and unguarded["deleted_model"] and unguarded["hook"], unguarded


@pytest.mark.skipif(not _editable_hook(), reason="this venv has no editable install of the project")
def test_the_checkout_itself_keeps_its_editable_install(tmp_path: Path) -> None:
    got = _check(tmp_path)  # from elsewhere: the installed package, which is this checkout
    assert got["file"] == str(ROOT / "pipelines" / "__init__.py") and got["hook"] and got["deleted"], got
