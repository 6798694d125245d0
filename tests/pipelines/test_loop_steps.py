"""The training loop's named steps on their own, without Ray (``pipelines/training/worker.py``, ``loop.py``):
gradient accumulation equals one large batch, a log window pools and resets, a validation step reads the EMA
weights' bound and keeps only a better one as the best checkpoint, and a checkpoint written by
``write_checkpoint`` and read back by ``resume`` continues the run bit for bit (weights, EMA and its update
count, optimiser, schedule, data position, RNG streams)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

VOCAB, LENGTH, ROWS = 64, 16, 32


def _cfg(kind: str, *sets: str):
    from pipelines.training.config import load_config

    return load_config(ROOT / "configs" / "demo.yaml", [
        f"model.kind={kind}", f"model.vocab_size={VOCAB}", f"model.seq_len={LENGTH}", "model.mask_id=2",
        "model.hidden=32", "model.heads=2", "model.n_blocks=1", "model.denoiser_blocks=1", "model.cond_dim=16",
        "model.dropout=0.1", "batch.global_batch=8", "batch.micro_batch=4", "optim.warmup_steps=2",
        "run.max_steps=20", "scaling.num_workers=0", *sets])


def _worker(cfg, run_dir: str = "unused"):
    from pipelines.training.worker import LoopConfig, build

    lc = LoopConfig(cfg=cfg, run_id=None, tracking_uri="sqlite:///unused.db", val_split="unused", val_rows=0,
                    manifest_hash="m", tokenizer_spec="t", tokenizer_path=None, tokenizer_hash="h", threads=1,
                    local_mode=True, run_dir=run_dir, resume_dir=None)
    return build(lc, rank=0, world=1, device=torch.device("cpu"))


ROWS_DATA = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))


def _stream(w, micro: int) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """What ``batch_stream`` yields, over fixed rows, from the worker's data position on."""
    epoch, i = w.epoch, w.position
    per_epoch = ROWS // micro
    while True:
        if i >= per_epoch:
            epoch, i = epoch + 1, 0
        yield epoch, i, {"input_ids": ROWS_DATA[i * micro:(i + 1) * micro]}
        i += 1


def _params(w) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in w.raw.state_dict().items()}


@pytest.mark.usefixtures("one_torch_thread")
def test_accumulated_micro_batches_step_like_one_batch() -> None:
    """AR without dropout is deterministic: two micro-batches of 4 rows (accumulation 2) must give the gradient
    of one micro-batch of 8 (a missing 1/accumulation, or a gradient left over, would not), step after step.
    Gradients are compared, not weights: Adam's first steps turn float-rounding differences of near-zero
    gradients into differences of a whole learning rate."""
    from pipelines.training.loop import optimiser_step

    a = _worker(_cfg("ar", "model.dropout=0.0", "batch.micro_batch=4"))
    b = _worker(_cfg("ar", "model.dropout=0.0", "batch.micro_batch=8"))
    assert (a.accumulation, b.accumulation) == (2, 1)
    for _ in range(3):
        optimiser_step(a, _stream(a, 4))
        optimiser_step(b, _stream(b, 8))
        for (name, p), q in zip(a.raw.named_parameters(), b.raw.parameters(), strict=True):
            scale = q.grad.abs().max().item()
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale), (a.step, name)
    assert all(p.grad.abs().max() > 0 for p in a.raw.parameters())  # every layer learns by the third step
    assert (a.step, a.position, b.position) == (3, 6, 3)
    assert a.ema.num_updates == 3


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kind", ["adlm", "mdlm"])
def test_a_log_window_pools_the_steps_and_starts_afresh(kind: str) -> None:
    from adlm_model import gamma_at
    from pipelines.training.loop import log_window, optimiser_step

    w = _worker(_cfg(kind))
    for _ in range(3):
        optimiser_step(w, _stream(w, 4))
    assert w.window.steps == 3
    m = log_window(w)
    assert w.window.steps == 0 and float(w.window.ntok) == 0.0
    assert 0 < m["train/nll"] < 2 * torch.log(torch.tensor(float(VOCAB))).item() * 10
    assert m["train/tokens_per_s"] > 0 and m["train/grad_norm"] > 0
    anchored = {"train/anchor_loss", "train/anchor_frac", "train/gamma_k", "train/grad_norm_anchor",
                "train/grad_norm_denoiser", "train/grad_norm_anchor_out"}
    if kind == "adlm":
        assert anchored <= set(m)
        c = w.cfg.model
        assert m["train/gamma_k"] == gamma_at(2, c.gamma, c.gamma_beta, c.gamma_horizon)
        assert 0 < m["train/anchor_frac"] <= 1
        # The two networks' norms make up the whole (both before clipping): |g|^2 = |g_anchor|^2 + |g_denoiser|^2
        # holds step by step, so their window means are within the whole's and sum in squares to at least it.
        ga, gd = m["train/grad_norm_anchor"], m["train/grad_norm_denoiser"]
        assert 0 < ga <= m["train/grad_norm"] + 1e-9 and 0 < gd <= m["train/grad_norm"] + 1e-9
        assert 0 <= m["train/grad_norm_anchor_out"] <= ga + 1e-9
    else:
        assert not anchored & set(m)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_checkpoint_resumes_the_run_bit_for_bit(tmp_path: Path) -> None:
    """ADLM with dropout (the torch RNG) and masking noise (the worker's generator): 2 steps, a checkpoint,
    2 more; a fresh worker resumed from the checkpoint takes the same 2 steps to identical weights."""
    from pipelines.training.loop import optimiser_step, write_checkpoint
    from pipelines.training.worker import resume

    a = _worker(_cfg("adlm", "run.max_steps=4"))
    for _ in range(2):
        optimiser_step(a, _stream(a, 4))
    write_checkpoint(a, tmp_path, {"val_ppl": 1.0})
    for _ in range(2):
        optimiser_step(a, _stream(a, 4))

    torch.manual_seed(123)  # whatever the fresh process's RNG holds, the checkpoint's streams take over
    b = _worker(_cfg("adlm", "run.max_steps=4"))
    assert resume(b, str(tmp_path), 2) == 2
    assert (b.step, b.position, b.ema.num_updates) == (2, 4, 2)
    for _ in range(2):
        optimiser_step(b, _stream(b, 4))
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert all(torch.equal(x, y) for x, y in zip(a.ema.shadow.values(), b.ema.shadow.values(), strict=True))
    assert (b.step, b.ema.num_updates, b.sched.get_last_lr()) == (4, 4, a.sched.get_last_lr())


@pytest.mark.usefixtures("one_torch_thread")
def test_bd3lm_trains_on_the_interval_its_search_chose() -> None:
    """``search_clip`` (the loop's step at each validation) picks an interval of the reference grid and the
    next optimiser steps draw every block's time from it; before any search, from the full schedule."""
    import adlm_model.baselines.bd3lm as bd3
    from pipelines.training.loop import optimiser_step, search_clip
    from pipelines.training.worker import set_training_clip

    w = _worker(_cfg("bd3lm", "model.block_size=4", "run.clip_search_batches=2"))
    seen: list[torch.Tensor] = []
    original = bd3.block_times

    def spy(*a, **k):
        t = original(*a, **k)
        seen.append(t.detach().clone())
        return t

    bd3.block_times = spy
    try:
        optimiser_step(w, _stream(w, 4))
        before = torch.cat([t.flatten() for t in seen])
        lo, hi = search_clip(w, {"input_ids": ROWS_DATA[:8]})
        assert (lo, hi) in bd3.clip_intervals(eps=w.cfg.model.sampling_eps) and w.clip == (lo, hi)
        for interval in [(lo, hi), (0.45, 0.95)]:  # the search's choice, then one no search would make by chance
            set_training_clip(w, interval)
            seen.clear()
            optimiser_step(w, _stream(w, 4))
            times = torch.cat([t.flatten() for t in seen])
            assert times.numel() > 0 and float(times.min()) >= interval[0] and float(times.max()) <= interval[1]
    finally:
        bd3.block_times = original
    assert float(before.min()) < 0.45 or float(before.max()) > 0.95  # the unclipped schedule at first


@pytest.mark.usefixtures("one_torch_thread")
def test_bd3lm_resumes_on_the_interval_it_was_training_on(tmp_path: Path) -> None:
    """The searched interval is part of the checkpoint: a resumed worker trains on it until the next search, not
    on the full schedule."""
    from pipelines.training.loop import write_checkpoint
    from pipelines.training.worker import resume, set_training_clip

    a = _worker(_cfg("bd3lm", "model.block_size=4"))
    set_training_clip(a, (0.3, 0.8))
    write_checkpoint(a, tmp_path, {"val_ppl": 1.0})
    b = _worker(_cfg("bd3lm", "model.block_size=4"))
    assert b.clip is None and (b.net.cfg.clip_low, b.net.cfg.clip_high) != (0.3, 0.8)
    resume(b, str(tmp_path), 0)
    assert b.clip == (0.3, 0.8) and (b.net.cfg.clip_low, b.net.cfg.clip_high) == (0.3, 0.8)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_validation_step_reads_the_ema_bound_and_keeps_only_a_better_best(tmp_path: Path) -> None:
    """``validation_step``: the bound is the EMA weights' (not the live weights'), the same on a second call (one
    fixed noise draw), and becomes ``<run_dir>/best`` only when it beats the run's best so far."""
    import math

    from adlm_model.interop.checkpoint import read_config
    from pipelines.training.checkpoints import best_checkpoint
    from pipelines.training.loop import optimiser_step, validate, validation_step

    w = _worker(_cfg("mdlm", "ema=0.9999"), run_dir=str(tmp_path / "run"))
    for _ in range(3):
        optimiser_step(w, _stream(w, 4))
    rows = {"input_ids": ROWS_DATA[:8]}
    first = validation_step(w, rows, tracker=None)
    ppl = first["val_ppl"]
    assert math.isfinite(ppl) and ppl > 1 and first["best_val_ppl"] == ppl == w.best_val and first["step"] == 3
    assert validate(w, rows) == ppl  # common random numbers: the same draw every time
    _, meta = read_config(Path(best_checkpoint(tmp_path / "run")))
    assert (meta["val_ppl"], meta["step"], meta["checkpoint"]) == (ppl, 3, "best")

    # The live weights give another bound: with a warm-up EMA after 3 updates the two differ.
    live = _worker(_cfg("mdlm", "ema=0.0"))
    live.raw.load_state_dict(w.raw.state_dict())
    live.ema.update(live.raw)  # decay 0: the EMA weights are the live weights
    assert validate(live, rows) != ppl

    # A bound no better than the best so far leaves the best checkpoint as it is.
    w.best_val = ppl / 2
    optimiser_step(w, _stream(w, 4))
    again = validation_step(w, rows, tracker=None)
    assert again["best_val_ppl"] == ppl / 2 and again["val_ppl"] != ppl
    assert read_config(Path(best_checkpoint(tmp_path / "run")))[1]["step"] == 3
