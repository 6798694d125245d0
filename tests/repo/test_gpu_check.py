"""benchmarks/gpu_check.py, the GPU path's one command, kept from rotting between GPU runs: its tiny CPU run passes
every item (the compiled kinds and the anchor included), prints every RESULT name the GPU run prints and writes its
record; the runner's guard, budget and batch search behave; and ``adlm_model`` imports nothing the GPU machine
lacks (it has torch, numpy, safetensors and tokenizers).

The CUDA-only tests of the same ground are tests/model/test_gpu.py (marker ``gpu``, skipped without a GPU);
gpu_check.py is what runs on a lent GPU machine, where pytest and the rest of the project are not installed.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PARTS = sorted((ROOT / "benchmarks" / "gpu_check_parts").glob("*.py"))
"""The script's items by family: they travel with it."""
ALLOWED = {"torch", "numpy", "safetensors", "tokenizers", "flash_attn", "yaml"}
"""What the GPU machine's image has (flash_attn: optional, imported in a try by adlm_model.nn.attention; yaml: PyYAML,
which its transformers requires, read only when a SEDD training run is imported)."""
BENCHMARK_MODULES = {"_record", "gpu_check_parts"}
"""The benchmarks' own modules the script imports: the record helper and its items (they travel with the repository)."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the in-process runs (the subprocess: --threads 1)

NAN_ON_CPU = ("datasheet", "peak_mem")
"""RESULT names a CPU run cannot measure: no datasheet peak for a CPU, no CUDA memory statistics."""


gpu_check = load_script(SCRIPT, "gpu_check", register=True)  # its dataclasses look their module up there
# its items by family (benchmarks/gpu_check_parts/), importable once the script has put benchmarks/ on the path
correctness, hardware, training = (importlib.import_module(f"gpu_check_parts.{m}")
                                   for m in ("correctness", "hardware", "training"))


def _results(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            name, _, value = line[len("RESULT "):].partition("=")
            assert name not in out, f"RESULT {name} printed twice"
            out[name] = value
    return out


def test_the_tiny_cpu_run_passes_and_prints_every_result_name(tmp_path: Path) -> None:
    """The CPU command, ``python benchmarks/gpu_check.py --device cpu --tiny``, in a fresh interpreter whose
    import hook (HOOK, below) refuses every package the GPU machine lacks for the imports adlm_model and the
    script make, after importing every adlm_model module under it: every item ok (the bf16 steps within tolerance
    of float32, every cached sampler equal to its exact one), every RESULT name of RESULT_NAMES printed once, the
    figures a CPU can measure finite, and the JSON holding every item."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", HOOK, ",".join(sorted(ALLOWED | BENCHMARK_MODULES)), str(SCRIPT),
                           "--device", "cpu", "--tiny", "--out", str(tmp_path), "--strict", "--threads", "1",
                           "--record", str(tmp_path / "record"), "--profile", "always"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Under the import hook (below): every adlm_model module imported, nothing refused, in the run either.
    # (pkgutil walks the subpackages too: each counts as a module, its __init__)
    n_modules = len([p for p in (ROOT / "adlm_model").rglob("*.py")
                     if p != ROOT / "adlm_model" / "__init__.py" and p.stem not in EXPORT_WRAPPERS])
    assert f"imported {n_modules} modules" in proc.stderr and "refused []" in proc.stderr
    results = _results(proc.stdout)
    assert list(results) == list(gpu_check.RESULT_NAMES)
    for name, value in results.items():
        if any(s in name for s in NAN_ON_CPU):
            assert value == "nan", (name, value)
        else:
            assert value != "nan", name
    for name in results:
        if name.startswith(("correct_bf16_ok_", "correct_compiled_ok_", "sampler_equal_")):
            assert results[name] == "1", name
        if name.startswith("train_graph_breaks_") or name == "anchor_graph_breaks":  # one graph a compiled step
            assert results[name] == "0", name
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["finished"] and list(report["items"]) == [i.name for i in gpu_check.ITEMS]
    assert all(r["status"] == "ok" for r in report["items"].values())
    assert report["env"]["torch"] and report["env"]["device"] == "cpu"
    for kind in gpu_check.TRAINED:  # a kind added to the table is covered without touching the script
        assert f"correct_bf16_{kind}" in report["items"] and f"train_{kind}" in report["items"]
        assert report["items"][f"train_{kind}"]["detail"]["flops_per_row"] > 0
        compiled = report["items"][f"train_compiled_{kind}"]
        assert compiled["detail"]["anchor"]["batch"] == compiled["results"][f"train_batch_compiled_{kind}"]
        assert float(results[f"train_over_anchor_{kind}"]) > 0 and results[f"train_goal_met_{kind}"] in ("0", "1")
        kernels = compiled["detail"]["top_kernels"]  # --profile always: the table a missed goal keeps
        assert kernels and all(k["ms_per_step"] > 0 and 0 < k["share"] <= 1 for k in kernels)
    assert float(results["flex_max_abs_diff_bd3lm"]) < 1e-4  # FlexAttention's output is the dense mask's
    # --record: a dated record with every RESULT line and a link to the JSON
    (record,) = (tmp_path / "record").glob("*_gpu_check.md")
    text = record.read_text()
    assert all(f"RESULT {n}=" in text for n in results) and "gpu_check.json" in text


def test_a_spent_budget_skips_the_rest_and_still_prints_every_name(tmp_path: Path, capsys) -> None:
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    results = _results(capsys.readouterr().out)
    assert list(results) == list(gpu_check.RESULT_NAMES)
    assert all(v == "nan" for k, v in results.items() if not k.startswith("env_"))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["finished"] and report["items"]["env"]["status"] == "ok"
    skipped = [r for n, r in report["items"].items() if n != "env"]
    assert skipped and all(r["status"] == "skipped" and "budget" in r["reason"] for r in skipped)


def test_a_failing_item_is_recorded_and_the_run_goes_on(tmp_path: Path, capsys) -> None:
    args = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--only", "correct_bf16_mdlm,matmul_peak",
            "--inject-failure", "correct_bf16_mdlm"]
    assert gpu_check.main(args) == 0
    results = _results(capsys.readouterr().out)
    assert results["correct_bf16_ok_mdlm"] == "nan" and float(results["matmul_peak_tflops"]) > 0
    items = json.loads((tmp_path / "gpu_check.json").read_text())["items"]
    assert items["correct_bf16_mdlm"]["status"] == "failed" and "injected" in items["correct_bf16_mdlm"]["error"]
    assert items["matmul_peak"]["status"] == "ok" and "correct_bf16_adlm" not in items  # not selected
    assert gpu_check.main([*args, "--strict"]) == 1


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu"], "--device cpu needs --tiny"),
    (["--device", "cpu", "--tiny", "--only", "no_such_item"], "no item matches no_such_item"),
    (["--device", "cpu", "--tiny", "--budget-s", "-1"], "--budget-s must be >= 0"),
])
def test_bad_arguments_fail_in_one_line(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    assert gpu_check.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.parametrize("limit, cap, want, tried", [
    (100, 512, 96, [8, 16, 32, 64, 128, 96]),   # the midpoint below the first failure fits
    (64, 512, 64, [8, 16, 32, 64, 128, 96]),    # it does not
    (10_000, 64, 64, [8, 16, 32, 64]),          # the cap ends the search
    (4, 512, 0, [8]),                           # not even the first
])
def test_the_batch_search(limit: int, cap: int, want: int, tried: list[int]) -> None:
    assert training.largest_batch(lambda b: b <= limit, 8, cap) == (want, tried)


def test_the_compiled_step_check_fails_on_a_miscompiled_step() -> None:
    """``correct_compiled``'s pass rule: rounding passes; the loss off as far as a miscompiled FlexAttention put it
    (5.7e-5 and 4.5e-4 on a CPU), a gradient entry off by 1% of the largest, or gradients pointing elsewhere fail,
    and so does a non-finite loss."""
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rounding = g * (1 + 1e-7)
    assert correctness.compiled_figures(3.0 * (1 + 1e-6), 3.0, rounding, g, "bd3lm")[0]
    one_entry = g.clone()
    one_entry[7] += 0.01 * g.abs().max()
    turned = g + 0.02 * torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for loss, grads in ((3.0 * (1 + 5.7e-5), g), (3.0 * (1 - 4.5e-4), g), (3.0, one_entry), (3.0, turned),
                        (math.nan, g)):
        ok, res = correctness.compiled_figures(loss, 3.0, grads, g, "bd3lm")
        assert not ok and res["correct_compiled_ok_bd3lm"] == 0, res
    assert set(res) == {n for n in gpu_check.RESULT_NAMES if n.startswith("correct_compiled_")}


def test_the_datasheet_peaks_by_gpu_name() -> None:
    assert hardware.datasheet_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert hardware.datasheet_tflops("NVIDIA H100 PCIe") == 756.0
    assert hardware.datasheet_tflops("NVIDIA H200") == 989.0
    assert hardware.datasheet_tflops("Tesla T4") is None
    assert math.isnan(float(gpu_check.fmt(math.nan)))


# --------------------------------------------------------------------------------------------
# The import surface: what a GPU machine with only torch (and numpy, safetensors, tokenizers) can run


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_adlm_model_and_gpu_check_import_only_what_the_gpu_machine_has() -> None:
    """Every import statement, at module level or inside a function (a lazy import would fail only when the
    GPU run reaches it): the standard library, the allowed packages, and (gpu_check.py) adlm_model."""
    bad = {}
    files = [*sorted((ROOT / "adlm_model").rglob("*.py")), SCRIPT, *PARTS]
    for path in files:
        extra = _top_level_imports(path) - ALLOWED - set(sys.stdlib_module_names) - {"adlm_model", "__future__"}
        if path == SCRIPT or path in PARTS:
            extra -= BENCHMARK_MODULES
        if path.stem in EXPORT_WRAPPERS:  # transformers imports them from an export folder (the GPU machine has it)
            extra -= {"transformers"}
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"imports the GPU machine lacks: {bad}"


EXPORT_WRAPPERS = ("configuration_adlm", "modeling_adlm")
"""adlm_model's transformers wrappers: shipped into an export folder and imported there by transformers, never by
the package (the GPU machine has transformers; tests/model/test_hf_export.py checks their imports)."""

HOOK = r"""
import importlib, pkgutil, runpy, sys
ALLOWED = set(sys.argv[1].split(","))
refused = []

class Refuse:
    # Refuses a top-level package outside the standard library and ALLOWED when the import statement is in
    # adlm_model or the script (what torch or numpy import for themselves is theirs: the GPU machine has it).
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in ALLOWED or top in sys.stdlib_module_names or top == "adlm_model":
            return None
        f = sys._getframe(1)
        while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            f = f.f_back
        who = f.f_globals.get("__name__", "") if f is not None else ""
        if who.startswith("adlm_model") or who == "__main__":
            refused.append(f"{who} imports {name}")
            raise ImportError(f"refused: {name}")
        return None

sys.meta_path.insert(0, Refuse())
import adlm_model
# The transformers wrappers an export ships are imported by transformers from the export folder, never by the
# package (tests/model/test_hf_export.py checks what they import).
names = sorted(m.name for m in pkgutil.walk_packages(adlm_model.__path__, "adlm_model.")
               if m.name.rpartition(".")[2] not in ("configuration_adlm", "modeling_adlm"))
for n in names:
    try:
        importlib.import_module(n)
    except ImportError as e:
        if "refused" not in str(e):
            raise
print("imported", len(names), "modules", file=sys.stderr)
code = 0
if len(sys.argv) > 2:  # then run the script as `python SCRIPT ARGS...` would, under the same hook
    sys.argv = sys.argv[2:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
print("refused", refused, file=sys.stderr)
sys.exit(1 if refused else code)
"""


def test_the_hook_refuses_a_package_adlm_model_would_import(tmp_path: Path) -> None:
    """The hook can fail: a module of adlm_model importing a package outside the list is refused."""
    pkg = tmp_path / "adlm_model"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text("import requests\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", HOOK, ",".join(sorted(ALLOWED))], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "adlm_model.bad imports requests" in proc.stderr


def test_a_second_try_resumes_the_items_the_first_finished(tmp_path: Path, capsys) -> None:
    """--resume: the earlier run's ok items are kept with their RESULT lines and what they hand on (step times,
    batches, FLOPs to the ADLM/MDLM ratio); the items --only names run, even one the earlier run finished."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(first), "--only", "matmul_peak,train_?dlm"]) == 0
    before = _results(capsys.readouterr().out)
    assert before["adlm_over_mdlm_time_ratio"] == "nan"  # not selected
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(second), "--only", "matmul_peak,adlm_over_mdlm",
                           "--resume", str(first / "gpu_check.json")]) == 0
    after = _results(capsys.readouterr().out)
    assert after["train_tokens_per_s_mdlm"] == before["train_tokens_per_s_mdlm"]
    items = json.loads((second / "gpu_check.json").read_text())["items"]
    assert items["train_adlm"]["resumed_from"] and items["train_mdlm"]["resumed_from"]
    assert "resumed_from" not in items["adlm_over_mdlm"] and "resumed_from" not in items["matmul_peak"]
    assert items["adlm_over_mdlm"]["status"] == "ok" and float(after["adlm_over_mdlm_flop_ratio"]) > 1
    assert after["train_batch_ar"] == "nan"  # in neither run


def test_the_gpu_page_names_what_exists() -> None:
    """docs/operations/gpu.md's commands: every gpu_check.py command line parses with options and items that exist
    (a renamed option would leave the page wrong on the day it is used), and the one-line command of a GPU slot
    fits its 8 minutes (an outer timeout of at most 480 s, a budget under it) and records into $OUT."""
    import re
    import shlex

    page = (ROOT / "docs" / "operations" / "gpu.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    imported = set().union(*(_top_level_imports(p) for p in (SCRIPT, *PARTS)))
    assert imported - set(sys.stdlib_module_names) - ALLOWED == {"adlm_model"} | BENCHMARK_MODULES
    commands = [line.split("#")[0] for b in blocks for line in b.replace("\\\n", " ").splitlines()
                if "gpu_check.py " in line and "python" in line]
    assert len(commands) >= 3 and any("--only" in c for c in commands) and any("--resume" in c for c in commands)
    archive = next(line for b in blocks for line in b.replace("\\\n", " ").splitlines() if line.startswith("git archive"))
    assert {"adlm_model", "benchmarks/gpu_check.py", "benchmarks/gpu_check_parts", "benchmarks/_record.py"} <= \
        set(shlex.split(archive))
    for line in commands:
        argv = shlex.split(line.replace("$OUT", "out"))
        args = gpu_check.parse_args(argv[argv.index("benchmarks/gpu_check.py") + 1:])
        assert args.out and all(any(fnmatch.fnmatch(i.name, p) for i in gpu_check.ITEMS) for p in args.only)
    slot = next(c for c in commands if "--record" in c and "$OUT" in c and "timeout" in c)
    argv = shlex.split(slot)
    limit = int(argv[argv.index("timeout") + 1])
    budget = gpu_check.parse_args(argv[argv.index("benchmarks/gpu_check.py") + 1:]).budget_s
    assert limit <= 480 and budget + 45 <= limit


def test_a_timed_run_out_of_memory_steps_down_to_a_batch_that_fitted(tmp_path: Path, capsys, monkeypatch) -> None:
    """The search's two steps fitted at the largest batch, the longer timed run did not: the item times the next
    batch the search found to fit instead. A CPU cannot run out of device memory on cue, so the step raises CUDA's
    error itself past the search's two steps."""
    import torch

    real_step, calls = training.Trainer.step, {"n": 0}

    def step(self, x):
        if x.shape[0] == 2:
            calls["n"] += 1
            if calls["n"] > 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.27 GiB.")
        return real_step(self, x)

    monkeypatch.setattr(training.Trainer, "step", step)
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--only", "train_mdlm"]) == 0
    results = _results(capsys.readouterr().out)
    item = json.loads((tmp_path / "gpu_check.json").read_text())["items"]["train_mdlm"]
    assert item["status"] == "ok" and item["detail"]["batches_tried"] == [1, 2]
    assert item["detail"]["timed_oom_at"] == [2] and results["train_batch_mdlm"] == "1"
    assert float(results["train_tokens_per_s_mdlm"]) > 0
