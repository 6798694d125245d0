"""The shape of the code: every module imports, no import circle inside ``adlm_model`` or ``pipelines``
(counting the imports inside functions too), the model core stays pure PyTorch, and files stay small."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("adlm_model", "pipelines")
MAX_LINES = 500
ARCHITECTURE = ROOT / "docs" / "design" / "architecture.md"
"""The page whose layout table names every module and whose list says what a new kind, sampler, metric touches."""
REASON = "Longer than 500 lines because"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).with_suffix("")
            out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return out


MODULES = _modules()


def _from_module(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in module ``name`` (file ``path``) reads from."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _unit(name: str) -> str:
    """The package a module counts under: ``adlm_model.nn``, ``pipelines.training``, ``adlm_model.kinds``."""
    return ".".join(name.split(".")[:2])


def _imports(name: str, path: Path) -> set[str]:
    """Project modules that ``name`` imports anywhere in its file (top level and inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(name, path, node)
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    # Packages are nodes too (importing one runs its __init__, and whatever that imports); a package's own
    # __init__ re-exporting its submodules is not a circle, so those edges are left out.
    return {n: {t for t in _imports(n, p) if not (p.name == "__init__.py" and t.startswith(n + "."))}
            for n, p in MODULES.items()}


def test_every_module_imports() -> None:
    for name in MODULES:
        importlib.import_module(name)


def test_every_project_import_names_something_that_exists() -> None:
    """``from pipelines.x import y`` inside functions is not checked at import time: check every one here."""
    missing = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.split(".")[0] not in PACKAGES:
                continue
            mod = importlib.import_module(node.module)
            for a in node.names:
                if not hasattr(mod, a.name) and f"{node.module}.{a.name}" not in MODULES:
                    missing.append(f"{name}:{node.lineno} from {node.module} import {a.name}")
    assert not missing, "imports of names that do not exist: " + "; ".join(missing)


def test_no_import_circle() -> None:
    """No circle between modules, nor between the packages and shared modules of ``pipelines``
    (``pipelines.tracking.registry`` and ``pipelines.serving`` once imported each other inside functions: the registry
    packaged versions with ``serving``'s module, ``serving`` resolved them with the registry's; the packaging now
    sits beside the registry, ``pipelines.tracking.mlflow_model``)."""
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)

    packages: dict[str, set[str]] = {}
    for n, targets in graph.items():
        packages.setdefault(_unit(n), set()).update(_unit(t) for t in targets if _unit(t) != _unit(n))
    cycles = _cycles(packages)
    assert not cycles, "circles between packages: " + "; ".join(" -> ".join(c) for c in cycles)


MODEL_LAYERS = ("compat", "config", "nn", "objectives", "sampling", "baselines", "kinds", "interop", "train", "inference",
                "testbed")
"""``adlm_model``'s top-level modules and subpackages in the order they may import each other: each only those
before it (docs/design/architecture.md says the same)."""


def test_the_model_package_is_layered() -> None:
    """``adlm_model``'s subpackages import only the layers before them (``MODEL_LAYERS``): the networks know nothing
    of objectives, the samplers nothing of the kinds table, the kinds table nothing of training, files or text."""
    graph = _graph()
    units = {n.split(".")[1] for n in graph if n.startswith("adlm_model.")}
    assert units == set(MODEL_LAYERS), f"adlm_model's units are {sorted(units)}: name each in MODEL_LAYERS"
    wrong = []
    for n, targets in graph.items():
        if not n.startswith("adlm_model."):
            continue
        here = MODEL_LAYERS.index(n.split(".")[1])
        for t in targets:
            if t.startswith("adlm_model.") and MODEL_LAYERS.index(t.split(".")[1]) > here:
                wrong.append(f"{n} -> {t}")
    assert not wrong, "imports of a later layer of adlm_model: " + "; ".join(sorted(wrong))


def test_no_module_imports_another_subpackages_private_names() -> None:
    """A ``_name`` is its subpackage's own: a module of another subpackage (or of ``pipelines``) that imports one
    ties itself to what its owner may change freely. Make it public or move the code."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            mod = _from_module(name, path, node)
            if mod.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                target = f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod
                private = any(p.startswith("_") and not p.startswith("__") for p in [a.name, *target.split(".")])
                if private and _unit(target) != _unit(name):
                    found.append(f"{name}:{node.lineno} from {mod} import {a.name}")
    assert not found, "private names imported across subpackages: " + "; ".join(found)


def test_the_layer_and_private_name_checks_see_a_crossing(tmp_path: Path) -> None:
    """A network module importing the kinds table is a layer crossed backwards; a baseline importing a sampler's
    ``_name`` a private name crossing subpackages; a sampler importing it from its own subpackage is neither."""
    up, private, own = tmp_path / "up.py", tmp_path / "private.py", tmp_path / "own.py"
    up.write_text("def f():\n    from adlm_model.kinds import KINDS\n")
    private.write_text("from ..sampling.samplers import _sigma\n")
    own.write_text("from .samplers import _sigma\n")
    saved = dict(MODULES)
    try:
        MODULES.update({"adlm_model.nn.up": up, "adlm_model.baselines.private": private, "adlm_model.sampling.own": own})
        with pytest.raises(AssertionError, match=r"later layer of adlm_model: adlm_model\.nn\.up -> adlm_model\.kinds\n"):
            test_the_model_package_is_layered()
        with pytest.raises(AssertionError, match=r"imported across subpackages: adlm_model\.baselines\.private:1 from "
                                                 r"adlm_model\.sampling\.samplers import _sigma\n"):
            test_no_module_imports_another_subpackages_private_names()
    finally:
        MODULES.clear()
        MODULES.update(saved)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif not state.get(m):
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if not state.get(n):
            visit(n)
    return cycles


def test_the_circle_detector_sees_through_a_package(tmp_path: Path) -> None:
    """A circle through a package's __init__ counts: b imports the package whose __init__ imports a, which
    imports b."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pipelines.a import f\n")
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from pipelines.b import g\ndef f():\n    pass\n")
    b.write_text("import pipelines.pkg\ndef g():\n    pass\n")
    saved = dict(MODULES)
    try:
        MODULES.update({"pipelines.a": a, "pipelines.b": b, "pipelines.pkg": pkg / "__init__.py"})
        with pytest.raises(AssertionError, match="pipelines.a -> pipelines.b -> pipelines.pkg -> pipelines.a"):
            test_no_import_circle()
    finally:
        MODULES.clear()
        MODULES.update(saved)


def test_the_circle_detector_finds_a_circle(tmp_path: Path) -> None:
    """The check above can fail: two modules importing each other (inside a function) form a circle."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from pipelines import b\n")
    b.write_text("from pipelines.a import f\n")
    saved = dict(MODULES)
    try:
        MODULES.update({"pipelines.a": a, "pipelines.b": b})
        with pytest.raises(AssertionError, match="pipelines.a -> pipelines.b -> pipelines.a"):
            test_no_import_circle()
    finally:
        MODULES.clear()
        MODULES.update(saved)


def test_the_model_core_is_pure_pytorch() -> None:
    """adlm_model imports neither Ray, MLflow nor the pipelines (the dependency points one way)."""
    for name, path in MODULES.items():
        if not name.startswith("adlm_model"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for m in mods:
                assert m.split(".")[0] not in ("ray", "mlflow", "pipelines"), f"{name} imports {m}"


def test_files_stay_small_or_say_why() -> None:
    long = []
    files = {**MODULES, **{str(p.relative_to(ROOT)): p for d in ("tests", "benchmarks") for p in (ROOT / d).rglob("*.py")}}
    for name, path in files.items():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and REASON not in doc:
            long.append(f"{name} ({lines} lines)")
    assert not long, f"files above {MAX_LINES} lines without '{REASON} ...' in their docstring: {', '.join(long)}"


def test_stage_entry_points_are_thin() -> None:
    """The CLIs users and the docs name stay argument parsing, the plan, the calls and the exit code."""
    for cli in ("prepare_data", "train", "tune", "evaluate", "generate", "export", "run_all", "study"):
        path = ROOT / "pipelines" / f"{cli}.py"
        assert path.read_text().count("\n") < 160, f"pipelines/{cli}.py grew: move its machinery into a subpackage"


def test_the_readme_layout_table_names_every_module() -> None:
    """The layout table (docs/design/architecture.md) is where a newcomer looks for the one file to open: every
    module of ``adlm_model`` and ``pipelines`` is named in the row of its folder, and every file it names exists."""
    import re

    rows = {}
    for line in ARCHITECTURE.read_text().splitlines():
        m = re.match(r"\| `((?:adlm_model|pipelines)/[^`]*)`([^|]*)\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(0)
    unnamed, missing = [], []
    for path in MODULES.values():
        if path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        row = rows.get(folder) or " ".join(r for k, r in rows.items() if k.rpartition("/")[0] + "/" == folder)
        if f"`{path.name}`" not in row and f"`{folder}{path.name}`" not in row:
            unnamed.append(f"{folder}{path.name}")
    for folder, row in rows.items():
        base = ROOT / (folder if folder.endswith("/") else folder.rpartition("/")[0])
        for f in re.findall(r"`([\w/]+\.py)`", row):
            if not (base / f.split("/")[-1]).is_file():
                missing.append(f"{folder}: {f}")
    assert not unnamed, f"modules the layout table of {ARCHITECTURE.name} does not name: {', '.join(unnamed)}"
    assert not missing, f"files the layout table of {ARCHITECTURE.name} names that do not exist: {', '.join(missing)}"


PRINTS_RESULTS = {("pipelines.core.cli", "run_command"),  # the one `error:` line of every command
                  ("pipelines.evaluation.eval_lm", "run"),  # the eval-LM command's body (`--prepare` prints a path)
                  ("pipelines.run_all", "run"), ("pipelines.run_all", "_banner"),  # the demo's stage titles and tables
                  ("pipelines.core.placement", "last_resort")}  # the command's `error:` line when the driver cannot say it
"""Functions outside a command's ``main``/``_run`` that print: the result-printing ones, named one by one."""


def test_library_code_never_prints() -> None:
    """One output channel: progress and warnings go to the logger, results alone on stdout from the command
    (its ``main``/``_run``, or a function in ``PRINTS_RESULTS``). A ``print(`` anywhere else in ``adlm_model`` or
    ``pipelines`` is a second channel that ``-q`` cannot silence and a pipe of the results would mix in."""
    found, printing = [], set()

    def walk(name: str, node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "print":
                printing.add((name, function))
                if function not in ("main", "_run") and (name, function) not in PRINTS_RESULTS:
                    found.append(f"{name}:{child.lineno} (in {function or 'the module'})")
            walk(name, child, inner)

    for name, path in MODULES.items():
        walk(name, ast.parse(path.read_text()), None)
    assert not found, "print( outside a command's main/_run: log it (pipelines.core.logs.get_logger) or return it: " + \
        ", ".join(found)
    assert PRINTS_RESULTS <= printing, f"allowed but printing nothing (drop them): {PRINTS_RESULTS - printing}"


TABLE_ENTRIES = {  # what makes a new one, and the architecture page's word for it
    "metric": lambda n: isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("register_suite", "Suite", "Figure"),
    "sampler": lambda n: isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Sampler",
    "model kind": lambda n: isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ModelKind",
    "store": lambda n: isinstance(n, ast.Constant) and n.value in ("s3", "gs"),  # a scheme named in code
}


def test_the_docs_say_which_files_a_new_metric_sampler_kind_and_store_touch() -> None:
    """The architecture page's list of what a new one touches names, for each of a metric, a sampler, a model kind
    and a store, the file of its table (the first file of its line); a table's entries are made there and nowhere
    else in ``adlm_model`` or ``pipelines``, so that adding one is the change the docs say."""
    import re

    page = ARCHITECTURE.read_text()
    layout = page[page.index("## What a new one touches"):]
    nodes = {str(path.relative_to(ROOT)): list(ast.walk(ast.parse(path.read_text()))) for path in MODULES.values()}
    for what, is_entry in TABLE_ENTRIES.items():
        line = re.search(rf"^- a \*\*{what}\*\*[^`]*`([^`]+)`", layout, re.M)
        assert line, f"{ARCHITECTURE.name} says nothing of a new {what}"
        table = line.group(1)
        assert (ROOT / table).is_file(), f"{ARCHITECTURE.name} names {table} for a new {what}: no such file"
        where = {f for f, found in nodes.items() if any(is_entry(n) for n in found)}
        assert where == {table}, \
            f"a {what}'s table entries are made in {sorted(where)}, {ARCHITECTURE.name} says {table}"


def test_no_kind_name_is_compared_outside_the_kinds_table() -> None:
    """What a kind does is a field of its row in ``adlm_model.kinds.KINDS`` (diffusion, anchored, block_diffusion,
    distillable, ...): ``kind == "ar"`` elsewhere is a second table that a new kind silently falls through. Any
    comparison in ``pipelines`` or ``adlm_model`` of something named ``kind`` with a kind's name is refused."""
    from adlm_model.config import MODEL_KINDS

    def names(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value} & set(MODEL_KINDS)
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return set().union(*(names(e) for e in node.elts)) if node.elts else set()
        return set()

    found = []
    for name, path in MODULES.items():
        if name in ("adlm_model.kinds", "adlm_model.config"):  # the table and the names it is keyed by
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(names(s) for s in sides) and any("kind" in ast.unparse(s) for s in sides if not names(s)):
                    found.append(f"{name}:{node.lineno} ({ast.unparse(node)})")
    assert not found, "a kind compared by name: read its row of adlm_model.kinds.KINDS instead: " + ", ".join(found)


PUBLIC_API = (
    "A2R", "ADLM", "AR", "BlockSample", "CheckpointError", "ClipSearchResult", "ConfigError", "EMA", "Generation",
    "GenerationError", "GenerationRequest", "InfillLayout", "KINDS", "LogLinearSchedule", "LossOutput", "MDLM",
    "MODEL_KINDS", "ModelConfig", "NaturalTestbed", "PRESETS", "ReMDMLoop", "SAMPLERS", "SEDD", "SamplerError",
    "SpecialTokens", "TextGenerator", "__version__", "anchor_mask", "antithetic_times", "bd3lm_objective",
    "block_diff_mask", "build_model", "clip_intervals", "compute_loss", "count_parameters", "gamma_at", "infill",
    "load_checkpoint", "load_generator", "load_pretrained", "load_state", "mask_tokens", "model_kind", "nucleus",
    "plan_infill", "preset", "sample", "sample_blocks", "sample_categorical", "save_checkpoint", "save_pretrained",
    "save_state", "search_clipped_schedule", "sedd_from_reference", "sedd_objective", "subs_log_probs", "subs_nll",
    "transition_probs", "unigram_entropy",
)
"""``from adlm_model import ...``: what users and the docs import, the same whichever module holds each name."""


def test_the_public_api_stays_what_users_import() -> None:
    import adlm_model

    assert sorted(adlm_model.__all__) == sorted(PUBLIC_API)
    missing = [n for n in PUBLIC_API if not hasattr(adlm_model, n)]
    assert not missing, f"adlm_model.__all__ names what the package does not have: {missing}"


LAZY = "# lazy:"
"""An import inside a function carries this comment (on its line, or on a comment line of the block just above it)
saying why it is not at the top: what it keeps out of the module's import (``import torch`` out of a command's
``--help``), or an optional dependency whose absence is handled."""


def lazy_imports_without_a_reason(path: Path, source: str) -> list[int]:
    """Lines of imports inside functions with no ``# lazy: <why>`` beside them."""
    lines = source.splitlines()
    bad = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            i = node.lineno - 1
            ok = LAZY in lines[i]
            j = i - 1
            while not ok and j >= 0 and (lines[j].strip().startswith(("#", "import ", "from ")) or
                                         lines[j].strip().endswith((",", "(")) or lines[j].strip() == ")"):
                ok = lines[j].strip().startswith(LAZY) and len(lines[j].strip()) > len(LAZY) + 3
                j -= 1
            if not ok:
                bad.append(node.lineno)
    return sorted(set(bad))


def test_imports_are_at_the_top_unless_lazy_for_a_reason() -> None:
    """``pipelines`` imports at the top of its modules; an import inside a function says why (``# lazy: <why>``)."""
    found = [f"{p.relative_to(ROOT)}:{line}" for name, p in MODULES.items() if name.startswith("pipelines")
             for line in lazy_imports_without_a_reason(p, p.read_text())]
    assert not found, "imports inside functions without a '# lazy: <why>' comment (move them to the top): " + \
        ", ".join(found)


def test_the_lazy_import_check_is_not_blind() -> None:
    src = "import os\n\n\ndef f():\n    import json\n    # lazy: keeps torch out of this module's import\n" \
          "    import torch\n    return json, torch\n"
    assert lazy_imports_without_a_reason(Path("x.py"), src) == [5]


def test_every_top_level_module_of_pipelines_is_a_command() -> None:
    """``ls pipelines/`` lists the commands: each top-level module has ``main`` and a ``__main__`` block; the
    machinery lives in subpackages."""
    not_commands = []
    for path in sorted((ROOT / "pipelines").glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        has_block = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
        if not (has_main and has_block):
            not_commands.append(path.name)
    assert not not_commands, f"top-level modules of pipelines that are not commands: {not_commands}"
