"""BD3-LM (docs/design/method.md, section 3): masks, b = L equals MDLM, KV cache equals recomputation, any length."""

from __future__ import annotations

import pytest
import torch

from adlm_model import compute_loss, sample
from adlm_model.baselines.bd3lm import (
    BlockContext,
    bd3lm_objective,
    block_diff_mask,
    block_diffusion_logits,
    block_nelbo,
    clip_intervals,
    sample_blocks,
    search_clipped_schedule,
)
from adlm_model.objectives.losses import mdlm_objective
from tests.support.models import M, V, gen, micro, randomized

L = 24


def test_block_diff_mask_structure() -> None:
    # L = 4, b = 2: x_t = 0..3, x_0 = 4..7
    got = block_diff_mask(4, 2).int()
    want = torch.tensor([
        [1, 1, 0, 0, 0, 0, 0, 0],  # x_t block 0: own block only
        [1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 0, 0],  # x_t block 1: own block + clean block 0
        [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],  # x_0 block 0: block-causal
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ])
    assert torch.equal(got, want)


def test_block_logits_depend_only_on_allowed_tokens() -> None:
    cfg = micro("bd3lm")
    model = randomized(cfg)
    x0 = torch.randint(0, V, (1, L), generator=gen(1))
    zt = torch.where(torch.rand(1, L, generator=gen(2)) < 0.5, torch.full_like(x0, M), x0)
    sigma = torch.zeros(1)
    with torch.no_grad():
        base = block_diffusion_logits(model, zt, x0, sigma, 4)
        # change clean x_0 from block 2 on, and the noisy x_t of block 4
        x0b = x0.clone()
        x0b[:, 8:] = (x0b[:, 8:] + 1) % V
        ztb = zt.clone()
        ztb[:, 16:20] = (x0[:, 16:20] + 3) % V
        other = block_diffusion_logits(model, ztb, x0b, sigma, 4)
    # x_t blocks 0-2 see their own block and clean blocks < their own: all unchanged
    assert torch.allclose(base[:, :12], other[:, :12], atol=1e-5)
    # block 3 sees clean block 2, block 4 its own changed x_t: both change
    assert not torch.allclose(base[:, 12:16], other[:, 12:16], atol=1e-3)
    assert not torch.allclose(base[:, 16:20], other[:, 16:20], atol=1e-3)


def test_b_equals_L_gives_mdlm_loss() -> None:
    cfg = micro("bd3lm").replace(block_size=L)
    model = randomized(cfg)
    x = torch.randint(0, V, (3, L), generator=gen(5))
    am = torch.ones_like(x)
    am[2, -5:] = 0
    t = torch.tensor([0.2, 0.55, 0.9])
    with torch.no_grad():
        bd3 = bd3lm_objective(model, x, am, cfg, t=t, generator=gen(9))
        mdlm = mdlm_objective(model, x, am, cfg, t=t, generator=gen(9))
    assert bd3.n_tokens == mdlm.n_tokens
    assert torch.allclose(bd3.loss, mdlm.loss, rtol=1e-5)
    assert float(mdlm.loss) > 0.1


def test_objective_per_block_times_and_eval_bounds() -> None:
    cfg = micro("bd3lm", clip_low=0.3, clip_high=0.8)
    model = randomized(cfg).train()
    x = torch.randint(0, V, (2, L), generator=gen(5))
    out = compute_loss(model, x, None, cfg, generator=gen(1))
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.n_tokens == 2 * (L - 1)  # BOS left out (the reference)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    # per-block times of shape (B, n_blocks) are accepted
    t = torch.linspace(0.1, 0.9, 2 * (L // 4)).view(2, L // 4)
    assert torch.isfinite(bd3lm_objective(model, x, None, cfg, t=t, generator=gen()).loss)


def _block_setup(n_clean: int):
    """A randomised micro BD3-LM, ``n_clean`` clean tokens, a half-masked block of 4 and sigma = 0."""
    cfg = micro("bd3lm")
    clean = torch.randint(0, V, (2, n_clean), generator=gen(3))
    noisy = torch.where(torch.rand(2, 4, generator=gen(4)) < 0.5, torch.full((2, 4), M), clean[:, :4])
    return cfg, randomized(cfg), clean, noisy, torch.zeros(2)


@pytest.mark.parametrize("fold", [False, True])
def test_kv_cached_block_logits_equal_recomputation(fold: bool) -> None:
    """KV cache (commits in calls of their own, or folded into the next block's first call) == recomputing
    the clean prefix."""
    cfg, model, clean, noisy, sigma = _block_setup(12)
    with torch.no_grad():
        ctx = {kv: BlockContext(model, 4, L, kv_cache=kv, fold=fold) for kv in (True, False)}
        for c in ctx.values():
            c.commit(clean[:, :4], 0, sigma)
            c.logits(noisy, 4, sigma)  # a block's first call (folds the pending commit)
            c.commit(clean[:, 4:8], 4, sigma)
            c.commit(clean[:, 8:12], 8, sigma)  # a block that needed no call: flushed by the next commit
        assert ctx[True].fold == fold
        got = ctx[True].logits(noisy, 12, sigma)
        want = ctx[False].logits(noisy, 12, sigma)
        again = ctx[True].logits(noisy, 12, sigma)  # the block's later calls read the same cache
        rows = torch.tensor([1])
        got_row = ctx[True].logits(noisy[rows], 12, sigma[rows], rows)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(again, want, atol=1e-5)
    assert torch.allclose(got_row, want[rows], atol=1e-5)
    # the tokens of whole runs agree too
    out = [sample(model, cfg, batch_size=2, length=L, steps=8, sampler="bd3lm", nucleus_p=0.9, generator=gen(7),
                  kv_cache=kv) for kv in (True, False)]
    assert torch.equal(out[0], out[1])


def test_folded_commits_equal_separate_commits_with_a_sliding_window() -> None:
    """Beyond the context the KV cache slides (cached states keep what they saw, so it is not windowed
    recomputation); folding the commits must not change it: same logits, same tokens."""
    _, model, clean, noisy, sigma = _block_setup(16)
    with torch.no_grad():
        ctx = {fold: BlockContext(model, 4, 8, kv_cache=True, fold=fold) for fold in (True, False)}
        logits = {}
        for fold, c in ctx.items():
            seen = []
            for k in range(4):
                c.commit(clean[:, 4 * k:4 * k + 4], 4 * k, sigma)
                seen.append(c.logits(noisy, 4 * k + 4, sigma))
                seen.append(c.logits(noisy, 4 * k + 4, sigma))
            logits[fold] = torch.stack(seen)
    assert ctx[True].fold and not ctx[False].fold
    assert torch.allclose(logits[True], logits[False], atol=1e-5)


def test_generates_twice_the_training_length() -> None:
    cfg = micro("bd3lm")
    model = randomized(cfg)
    x = sample(model, cfg, batch_size=2, length=2 * L + 2, steps=4, sampler="bd3lm", generator=gen(),
               prefix=torch.tensor([3, 4, 5]))
    assert x.shape == (2, 2 * L + 2) and not (x == M).any()
    assert (x[:, :3] == torch.tensor([3, 4, 5])).all()


def test_stops_at_eos_and_low_entropy() -> None:
    cfg = micro("bd3lm")
    model = randomized(cfg)
    eos = 7
    res = sample_blocks(model, cfg, *_empty(3, 2 * L), steps=4, nucleus_p=1.0, generator=gen(2), eos_id=eos)
    for row, n in zip(res.tokens, res.lengths.tolist(), strict=True):
        if n < 2 * L:
            assert row[n - 1] == eos and (row[:n - 1] != eos).all() and (row[n:] == eos).all()
        else:
            assert (row != eos).all()
    # a threshold above any possible entropy stops every row at its first check, without its window
    res = sample_blocks(model, cfg, *_empty(2, 2 * L), steps=4, nucleus_p=1.0, generator=gen(2),
                        entropy_threshold=100.0, entropy_window=8, pad_id=0)
    assert res.lengths.tolist() == [12 - 8, 12 - 8] and (res.tokens[:, 4:] == 0).all()


def _empty(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((b, n), M), torch.zeros(b, n, dtype=torch.bool)


def test_clip_grid_and_variance_search() -> None:
    grid = clip_intervals(widths=(0.9,), delta=0.05, eps=1e-3)
    assert grid == [(1e-3, 1.0), (1e-3, 0.9), (0.05, 0.95), (0.1, 1.0)]
    cfg = micro("bd3lm")
    model = randomized(cfg)
    batches = [(torch.randint(0, V, (4, L), generator=gen(i)), None) for i in range(2)]
    res = search_clipped_schedule(model, batches, cfg, intervals=[(1e-3, 1.0), (0.3, 0.8), (0.5, 0.6)])
    assert set(res.variances) == {(1e-3, 1.0), (0.3, 0.8), (0.5, 0.6)}
    assert res.variances[(res.beta, res.omega)] == min(res.variances.values())
    # a narrow band away from t -> 0 (where w(t) = 1/t explodes) has less variance than [eps, 1]
    assert res.variances[(0.5, 0.6)] < res.variances[(1e-3, 1.0)]
    # The statistic is the variance of the per-block mean loss over every (sequence, block) cell of all
    # batches (the reference's), not over sequences: recomputed here by hand with the same random numbers.
    g = gen(0)
    cells = []
    with torch.no_grad():
        for x, am in batches:
            per_token, valid = block_nelbo(model, x, am, cfg, generator=g, clip=(0.3, 0.8))
            tok, cnt = per_token.double().view(4, -1, 4).sum(-1), valid.view(4, -1, 4).sum(-1)
            cells += (tok[cnt > 0] / cnt[cnt > 0]).tolist()
    assert len(cells) == 2 * 4 * (L // 4)
    assert res.variances[(0.3, 0.8)] == pytest.approx(torch.tensor(cells, dtype=torch.float64).var().item(), rel=1e-9)


def test_training_draws_block_times_from_the_searched_interval_and_evaluation_from_all() -> None:
    """The loop's search result becomes the training objective's interval; the bound stays on [eps, 1]."""
    from adlm_model.baselines.bd3lm import clip_bounds

    cfg = micro("bd3lm")
    trained = cfg.replace(clip_low=0.45, clip_high=0.95)
    assert clip_bounds(trained, train=True) == (0.45, 0.95)
    assert clip_bounds(trained, train=False) == (cfg.sampling_eps, 1.0)
    model = randomized(cfg)
    x = torch.randint(0, V, (3, L), generator=gen(2))
    seen: list[torch.Tensor] = []
    import adlm_model.baselines.bd3lm as bd3

    original = bd3.block_times

    def spy(*a, **k):
        t = original(*a, **k)
        seen.append(t)
        return t

    bd3.block_times = spy
    try:
        compute_loss(model, x, None, trained, train=True, generator=gen(3))
        compute_loss(model, x, None, trained, train=False, generator=gen(3))
    finally:
        bd3.block_times = original
    assert float(seen[0].min()) >= 0.45 and float(seen[0].max()) <= 0.95
    assert float(seen[1].min()) < 0.45 or float(seen[1].max()) > 0.95  # the full schedule
