"""The training step of every kind (``adlm_model/train/train_step.py``): compiled by inductor with 0 graph breaks, one
trace and no recompiles across steps, equal to the eager step (BD3-LM's FlexAttention pass too); the vocabulary
losses fused over row chunks equal to the losses through the whole logits; BD3-LM's FlexAttention mask equal to its
dense mask; a last partial batch never reaches the compiled objective; the training loop and the GPU check run the
same step; the recipe's ``scaling.compile`` key."""

from __future__ import annotations

import copy

import pytest
import torch

from adlm_model import build_model, preset
from adlm_model.kinds import KINDS, compute_loss
from adlm_model.objectives.losses import materialised_logits
from adlm_model.objectives.vocab_loss import full_linear_loss, linear_loss, logits_loss
from adlm_model.train.train_step import Objective, TrainStep, draw_noise, fused_adamw
from tests.conftest import ROOT, load_script

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAINED = [k for k, v in KINDS.items() if v.train_objective is not None and not v.sample_only]
TOY = dict(hidden=32, heads=2, n_blocks=1, denoiser_blocks=1, cond_dim=16, vocab_size=40, mask_id=40, seq_len=16,
           block_size=4, dropout=0.0)


def _rows(cfg, n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=torch.Generator().manual_seed(seed))
    x[x == cfg.mask_id] = 0
    return x


def _randomised(cfg):
    """A network whose zero-initialised output and adaLN layers are not zero, so every gradient is non-trivial."""
    torch.manual_seed(0)
    model = build_model(cfg).train()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _step(cfg, model, compile: bool, backend) -> TrainStep:
    return TrainStep(Objective(model, cfg), model, fused_adamw(model.parameters(), lr=1e-3), clip=1.0,
                     compile=compile, backend=backend)


# --------------------------------------------------------------------------------------------
# The vocabulary losses


@pytest.mark.parametrize("mode", ["ce", "exp"])
def test_the_fused_linear_loss_equals_the_loss_through_the_logits(mode: str) -> None:
    """Several chunks of rows, a last short one, an excluded column: the sum and the three gradients agree with
    autograd through the whole float32 logits."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 13, 16, generator=g, requires_grad=True)
    w = torch.randn(53, 16, generator=g, requires_grad=True)
    b = torch.randn(53, generator=g, requires_grad=True)
    y = torch.randint(0, 52, (3, 13), generator=g)
    a, c, s = torch.rand(3, 13, generator=g), torch.rand(3, 13, generator=g), torch.randn(3, 13, generator=g)
    kw = dict(exclude=52, mode=mode, c=c if mode == "exp" else None, s=s if mode == "exp" else None)
    fused = linear_loss(h, w, b, y, a, chunk_elements=5 * 53, **kw)
    ref = full_linear_loss(h, w, b, y, a, **kw)
    assert torch.allclose(fused, ref, rtol=1e-5)
    for gf, gr in zip(torch.autograd.grad(fused, (h, w, b)), torch.autograd.grad(ref, (h, w, b)), strict=True):
        assert torch.allclose(gf, gr, rtol=1e-4, atol=1e-5 * gr.abs().max().item())
    with torch.no_grad():  # validation's path: no gradients computed
        assert torch.allclose(linear_loss(h, w, b, y, a, chunk_elements=5 * 53, **kw), ref, rtol=1e-5)
    logits = torch.randn(39, 53, generator=g, requires_grad=True)
    lf = logits.float()
    ref = (a.flatten() * (torch.logsumexp(lf, -1) - lf.gather(-1, y.flatten()[:, None]).squeeze(-1))).sum()
    fused = logits_loss(logits, y.flatten(), a.flatten(), chunk_elements=4 * 53)
    assert torch.allclose(fused, ref, rtol=1e-5)
    assert torch.allclose(torch.autograd.grad(fused, logits)[0], torch.autograd.grad(ref, logits)[0], atol=1e-6)


@pytest.mark.parametrize("kind", TRAINED)
def test_every_objective_is_the_same_with_and_without_the_logits(kind: str) -> None:
    """The objectives read the networks' heads through the fused losses; through the whole logits (the loss as it
    was computed before) they give the same loss, sums and gradients, in training and in evaluation."""
    cfg = preset("tiny", kind=kind, **TOY)
    model = _randomised(cfg)
    x = _rows(cfg, 4)
    for train in (True, False):
        outs, grads = [], []
        for ctx in (materialised_logits, _nothing):
            model.zero_grad()
            with ctx():
                out = compute_loss(model, x, None, cfg, step=7, train=train, generator=torch.Generator().manual_seed(3))
            out.loss.backward()
            outs.append(out)
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        ref, fused = outs
        assert torch.allclose(fused.loss, ref.loss, rtol=1e-5), (kind, train)
        assert torch.allclose(fused.nll_sum, ref.nll_sum, rtol=1e-5) and torch.equal(fused.n_tokens, ref.n_tokens)
        if ref.anchor_sum is not None:
            assert torch.allclose(fused.anchor_sum, ref.anchor_sum, rtol=1e-5)
        assert torch.allclose(grads[1], grads[0], atol=1e-5 * grads[0].abs().max().item()), (kind, train)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


# --------------------------------------------------------------------------------------------
# Compiled against eager


RAMP = dict(gamma=0.5, gamma_beta=1.0, gamma_horizon=10)
"""An anchor-weight ramp over the steps (ADLM): the compiled objective reads the step index."""


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.slow  # inductor compiles a forward and a backward graph: 20-30 CPU-s cold, about 3 s from its cache
@pytest.mark.parametrize("kind", TRAINED)
def test_the_compiled_step_is_one_graph_equal_to_the_eager_step(kind: str) -> None:
    """Two steps compiled by inductor (what ``scaling.compile: on`` runs on a CPU; BD3-LM attends through its dense
    mask there) against the eager step on the same batches and noise: no graph break, one graph traced once for
    both steps (no recompile as the step index and the noise change; ADLM ramps its anchor weight, and a step index
    traced as a Python float made dynamo trace the objective twice), and the loss and the gradients the eager
    step's within float32 rounding (inductor fuses and reorders: about 1e-6 relative here)."""
    # private: torch has no public counter of compiled frames and graphs
    from torch._dynamo.testing import CompileCounterWithBackend

    from adlm_model.compat.torch import dynamo_counters
    from adlm_model.nn import block_attention as ba

    counters = dynamo_counters()
    torch.compiler.reset()
    counters.clear()
    cfg = preset("tiny", kind=kind, **TOY, **(RAMP if KINDS[kind].anchored else {}))
    base = _randomised(cfg)
    cnt = CompileCounterWithBackend("inductor")
    steps = {c: _step(cfg, copy.deepcopy(base), c, cnt) for c in (False, True)}
    for k in range(3 if KINDS[kind].block_diffusion else 2):
        if k == 2:  # another length's mask joins the cache: the compiled pass reads its own, no recompile
            ba.dense_block_mask(2 * cfg.seq_len, cfg.block_size, "cpu")
        x = _rows(cfg, 4, seed=k)
        outs, grads = {}, {}
        for c, st in steps.items():
            outs[c] = st([(x, None)], step=k, generator=torch.Generator().manual_seed(k))
            grads[c] = _grads(st.model)
        assert torch.allclose(outs[True].loss, outs[False].loss, rtol=1e-5, atol=0), (kind, k)
        assert torch.allclose(grads[True], grads[False], rtol=0, atol=1e-5 * grads[False].abs().max().item()), \
            (kind, k, ((grads[True] - grads[False]).abs().max() / grads[False].abs().max()).item())
    assert dict(counters["graph_break"]) == {}, kind
    assert cnt.frame_count == 1, f"{kind}: {cnt.frame_count} graphs (a recompile, a graph break or a second trace)"
    assert counters["aot_autograd"]["total"] == 1, f"{kind}: the objective traced {counters['aot_autograd']['total']}x"
    assert steps[True].compile_s is not None and steps[True].eager_micro_batches == 0


@pytest.mark.slow  # one inductor compile, forward only
def test_bd3lm_compiled_through_flex_attention_equals_the_eager_dense_objective(monkeypatch) -> None:
    """BD3-LM's objective compiled by inductor with FlexAttention (what ``compile: auto`` runs on CUDA) against the
    eager objective with the dense mask, on the same batch and noise: the same loss (forward only: FlexAttention
    has no backward on a CPU; the gradients of the compiled dense pass are the test above's). Fed the rotary
    output's transposed views, the compiled kernel's loss was 4.5e-4 relative off (a block's output by 0.35)."""
    from adlm_model.nn import block_attention as ba

    torch.compiler.reset()
    cfg = preset("tiny", kind="bd3lm", **TOY)
    objective = Objective(_randomised(cfg), cfg)
    x = _rows(cfg, 4)
    noise = draw_noise(cfg, x, torch.Generator().manual_seed(3))
    k = torch.zeros((), dtype=torch.int64)
    with torch.no_grad():
        monkeypatch.setattr(ba, "FLEX_ATTENTION", "off")
        dense = objective(x, None, noise, k, True)
        monkeypatch.setattr(ba, "FLEX_ATTENTION", "on")
        ba.prepare_block_mask(cfg.seq_len, cfg.block_size, x.device)  # FlexAttention's, outside the graph
        flex = torch.compile(objective, backend="inductor", dynamic=False)(x, None, noise, k, True)
    assert torch.allclose(flex.loss, dense.loss, rtol=1e-5, atol=0), (flex.loss / dense.loss - 1).item()
    assert torch.allclose(flex.nll_sum, dense.nll_sum, rtol=1e-5) and torch.equal(flex.n_tokens, dense.n_tokens)


def test_a_last_partial_batch_runs_eager_and_compiles_nothing() -> None:
    # private: torch has no public counter of compiled frames and graphs
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.compiler.reset()
    cfg = preset("tiny", kind="mdlm", **TOY)
    cnt = CompileCounterWithBackend("eager")  # dynamo alone: what recompiles is decided there
    st = _step(cfg, _randomised(cfg), True, cnt)
    st([(_rows(cfg, 4), None), (_rows(cfg, 4, 1), None)], step=0, generator=torch.Generator().manual_seed(0))
    st([(_rows(cfg, 4), None), (_rows(cfg, 3, 1), None)], step=1, generator=torch.Generator().manual_seed(0))
    assert cnt.frame_count == 1 and st.shape == (4, cfg.seq_len) and st.eager_micro_batches == 1


def test_the_noise_is_the_objectives_own_draw() -> None:
    """``draw_noise`` consumes the generator as the objectives did when they drew for themselves, so a run's
    noise (and its exact resume) does not depend on where it is drawn."""
    for kind in TRAINED:
        cfg = preset("tiny", kind=kind, **TOY)
        model = _randomised(cfg)
        x = _rows(cfg, 4)
        own = compute_loss(model, x, None, cfg, step=2, generator=torch.Generator().manual_seed(5))
        t, z = draw_noise(cfg, x, torch.Generator().manual_seed(5))
        given = compute_loss(model, x, None, cfg, step=2, t=t, z_t=z)
        assert torch.equal(own.loss, given.loss), kind


# --------------------------------------------------------------------------------------------
# BD3-LM's attention


def test_bd3lm_flex_attention_equals_the_dense_mask() -> None:
    """The FlexAttention ``BlockMask`` of the training pass over ``[x_t ; x_0]`` gives the dense mask's logits
    (forward only: FlexAttention has no backward on a CPU; on CUDA it runs compiled, ``gpu_check`` times it)."""
    from adlm_model.nn import block_attention as ba

    cfg = preset("tiny", kind="bd3lm", **TOY)
    model = _randomised(cfg).eval()
    idx = torch.arange(2 * cfg.seq_len)
    dense = ba.block_diff_mask(cfg.seq_len, cfg.block_size)
    assert torch.equal(ba.block_diff_mask_mod(cfg.seq_len, cfg.block_size)(0, 0, idx[:, None], idx[None, :]), dense)
    x = _rows(cfg, 2)
    z, sigma = x.clone(), torch.zeros(2)
    z[:, ::3] = cfg.mask_id
    out = {}
    with torch.no_grad():
        for mode in ("off", "on"):
            saved, ba.FLEX_ATTENTION = ba.FLEX_ATTENTION, mode
            try:
                out[mode] = ba.block_diffusion_pass(model.backbone, z, x, sigma, cfg.block_size)
            finally:
                ba.FLEX_ATTENTION = saved
    assert torch.allclose(out["on"], out["off"], atol=1e-5)
    assert ba.uses_flex(torch.device("cpu")) is False  # auto: never on a CPU


# --------------------------------------------------------------------------------------------
# One step for the loop and the check; the recipe key


def test_the_loop_and_the_gpu_check_run_the_same_step(monkeypatch) -> None:
    """Both call ``TrainStep.__call__`` (a spy on the class sees the calls of both), and neither module defines a
    step of its own."""
    import ast

    from tests.pipelines.test_loop_steps import _cfg, _stream, _worker  # the loop's own helpers, as its tests use them

    seen: list[str] = []
    real = TrainStep.__call__

    def spy(self, batches, **kw):
        seen.append(type(self.objective).__name__)
        return real(self, batches, **kw)

    monkeypatch.setattr(TrainStep, "__call__", spy)
    from pipelines.training.loop import optimiser_step

    w = _worker(_cfg("mdlm"))
    optimiser_step(w, _stream(w, 4))
    gpu_check = load_script(ROOT / "benchmarks" / "gpu_check.py", "gpu_check", register=True)
    from gpu_check_parts.context import TINY, Ctx, random_rows  # its items (the script put benchmarks/ on the path)
    from gpu_check_parts.training import Trainer

    args = gpu_check.parse_args(["--device", "cpu", "--tiny"])
    ctx = Ctx(args=args, device=torch.device("cpu"), sizes=TINY, t0=0.0)
    tr = Trainer(ctx, ctx.train_config("mdlm"))
    tr.step(random_rows(tr.cfg, 1, ctx.device))
    assert seen == ["Objective", "Objective"]
    parts = sorted((ROOT / "benchmarks" / "gpu_check_parts").glob("*.py"))
    for path in (ROOT / "benchmarks" / "gpu_check.py", *parts, ROOT / "pipelines" / "training" / "loop.py"):
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}
        assert not {"clip_grad_norm_", "AdamW", "no_sync", "set_requires_gradient_sync"} & calls, path.name


STEP_OF_THEIR_OWN = {"backward", "clip_grad_norm_", "clip_grad_value_"}
"""Calls only a training step makes (besides an optimiser's ``step``)."""
KERNEL_TIMINGS = {("gpu_check_parts/training.py", "flex_item")}
"""(file, function) that call ``backward`` on something that is no training step: gpu_check times FlexAttention's
kernel, forward and backward, against SDPA's (no optimiser, no loss)."""


def test_every_benchmark_that_trains_runs_the_pipelines_step() -> None:
    """No benchmark keeps a training step of its own: no ``.backward(``, gradient clipping or optimiser ``.step(``
    outside ``TrainStep`` anywhere in ``benchmarks/`` (gpu_check's attention-kernel timing aside), and the ones
    that time or run training steps build a ``TrainStep``."""
    import ast

    found, builders = [], set()
    bench = ROOT / "benchmarks"
    for path in sorted([*bench.glob("*.py"), *bench.glob("gpu_check_parts/*.py")]):
        rel = path.relative_to(bench).as_posix()
        tree = ast.parse(path.read_text())
        for top in tree.body:  # each call under the top-level function or class it is in
            name = getattr(top, "name", "<module>")
            for call in (n for n in ast.walk(top) if isinstance(n, ast.Call)):
                f = call.func
                attr = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if attr == "TrainStep":
                    builders.add(rel)
                optimiser_step = attr == "step" and isinstance(f, ast.Attribute) and "opt" in ast.unparse(f.value)
                if (attr in STEP_OF_THEIR_OWN or optimiser_step) and (rel, name) not in KERNEL_TIMINGS:
                    found.append(f"{rel}:{call.lineno} {name}: {ast.unparse(f)}(")
    assert not found, found
    assert {"step_cost.py", "fast_sampling.py", "train_throughput.py", "gpu_check_parts/training.py"} <= builders, \
        builders


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("on", "on"), ("OFF", "off"), (True, "on"), (False, "off")])
def test_the_compile_key(value: object, want: str) -> None:
    from pipelines.training.config import TrainConfig, flatten

    cfg = TrainConfig.from_dict({"scaling": {"compile": value}})
    assert cfg.scaling.compile == want and flatten(cfg.to_dict())["scaling.compile"] == want  # a run's params
    assert cfg.compiles("cuda") is (want in ("auto", "on")) and cfg.compiles("cpu") is (want == "on")


@pytest.mark.parametrize("raw, message", [
    ({"scaling": {"compile": "sometimes"}}, "scaling.compile must be auto, on or off"),
    ({"scaling": {"compile": "on", "strategy": "fsdp"}}, "scaling.compile on"),
])
def test_a_bad_compile_setting_is_one_line(raw: dict, message: str) -> None:
    from adlm_model.config import ConfigError
    from pipelines.training.config import TrainConfig

    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig.from_dict(raw)
    assert "\n" not in str(e.value)
    assert TrainConfig.from_dict({"scaling": {"strategy": "fsdp"}}).compiles("cuda") is False  # auto: not FSDP


def test_the_loop_logs_the_first_compiled_step_once() -> None:
    """A compiled worker (backend ``eager``: dynamo alone, cheap here): its first step's time goes into that
    window's metrics as ``train/compile_s`` and one log line; later windows do not repeat it."""
    import logging

    from pipelines.training import loop
    from pipelines.training.loop import log_window, optimiser_step
    from tests.pipelines.test_loop_steps import _cfg, _stream, _worker

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    torch.compiler.reset()
    w = _worker(_cfg("mdlm", "model.dropout=0.0"))
    w.train_step = TrainStep(w.objective, w.raw, w.opt, sched=w.sched, ema=w.ema, clip=1.0, compile=True,
                             backend="eager")
    logger, lines = logging.getLogger(loop.log.name), Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        optimiser_step(w, _stream(w, 4))
        optimiser_step(w, _stream(w, 4))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    first = log_window(w)
    assert first["train/compile_s"] == w.train_step.compile_s > 0
    assert sum("compilation included" in m for m in lines.lines) == 1
    optimiser_step(w, _stream(w, 4))
    assert "train/compile_s" not in log_window(w) and w.train_step.eager_micro_batches == 0
