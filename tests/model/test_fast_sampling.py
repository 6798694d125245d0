"""Confidence-threshold parallel decoding and the approximate KV cache (adlm_model/sampling/confidence.py, block_cache.py):
refresh 1 is the exact sampler token for token, the threshold's extremes cost L calls and one call, a partial
pass on an unchanged row equals the full pass, and bad settings fail in one line before any network call."""

from __future__ import annotations

import pytest
import torch

from adlm_model import sample
from adlm_model.sampling.block_cache import cached_logits, new_caches
from adlm_model.sampling.samplers import SamplerError
from tests.support.models import L, gen, micro, randomized


def _run(model, cfg, *, batch: int = 3, seed: int = 1, prefix=None, **opts) -> tuple[torch.Tensor, int]:
    stats: dict = {}
    x = sample(model, cfg, batch_size=batch, length=L, steps=1, sampler="confidence", nucleus_p=0.9,
               generator=gen(seed), stats=stats, prefix=prefix, **opts)
    return x, stats["network_calls"]


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
@pytest.mark.parametrize("kv_cache", ["prefix", "dual"])
def test_refresh_one_equals_the_uncached_sampler_token_for_token(kind: str, kv_cache: str) -> None:
    cfg = micro(kind)
    model = randomized(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, L), generator=gen(5))
    keep = torch.zeros(1, L, dtype=torch.bool)
    keep[0, :4] = keep[0, -2:] = True  # a prompt and a suffix: the span is the 18 positions between
    for threshold in (0.05, 1.0):
        exact, calls = _run(model, cfg, threshold=threshold, block=6, prefix=(tokens, keep))
        cached, cached_calls = _run(model, cfg, threshold=threshold, block=6, refresh=1, kv_cache=kv_cache,
                                    prefix=(tokens, keep))
        assert torch.equal(exact, cached) and calls == cached_calls
        assert torch.equal(exact[:, keep[0]], tokens[:, keep[0]].expand(3, -1))
        assert not (exact == cfg.mask_id).any()


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_a_partial_pass_on_an_unchanged_row_equals_the_full_pass(kind: str) -> None:
    cfg = micro(kind)
    model = randomized(cfg)
    z = torch.randint(0, cfg.width, (2, L), generator=gen(2))
    sigma = torch.zeros(2)
    caches = new_caches(model)
    with torch.no_grad():
        full = cached_logits(model, z, sigma, caches)
        assert torch.equal(full, model.denoiser_logits(z, sigma))  # the full pass is the uncached network
        dual = cached_logits(model, z, sigma, caches, 8, 16)
        prefix = cached_logits(model, z, sigma, caches, 8, L)
        # A changed block: the dual pass sees the new block but stale keys/values elsewhere (the approximation).
        z2 = z.clone()
        z2[:, 8:16] = cfg.mask_id
        stale = cached_logits(model, z2, sigma, caches, 8, 16)
    torch.testing.assert_close(dual, full[:, 8:16], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefix, full[:, 8:], rtol=1e-5, atol=1e-5)
    assert stale.shape == (2, 8, cfg.width) and not torch.allclose(stale, full[:, 8:16])


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_threshold_one_unmasks_one_token_a_step_and_zero_all_in_one_call(kind: str) -> None:
    cfg = micro(kind)
    model = randomized(cfg)
    seen: list[int] = []
    stats: dict = {}
    x = sample(model, cfg, batch_size=2, length=L, steps=1, sampler="confidence", generator=gen(3), stats=stats,
               threshold=1.0, progress=lambda done, total: seen.append(done))
    assert stats["network_calls"] == L and seen == list(range(1, L + 1)) and not (x == cfg.mask_id).any()
    x, calls = _run(model, cfg, threshold=0.0)
    assert calls == 1 and not (x == cfg.mask_id).any()
    x, calls = _run(model, cfg, threshold=0.0, block=8, refresh=2)  # one call a block
    assert calls == L // 8 and not (x == cfg.mask_id).any()


def test_approximate_cache_runs_fewer_positions_per_call() -> None:
    cfg = micro("adlm")
    model = randomized(cfg)
    widths: list[int] = []
    handle = model.anchor.vocab_embed.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
    try:
        _, calls = _run(model, cfg, threshold=1.0, block=8, refresh=4, kv_cache="dual")
    finally:
        handle.remove()
    # A full pass when each block starts and every 4 steps; the anchor network sees the block alone otherwise.
    assert calls == L and widths.count(L) == 3 * 2 and widths.count(8) == L - 6


@pytest.mark.parametrize(("opts", "message"), [
    ({"threshold": 1.5}, "threshold must be a number in [0, 1], got 1.5"),
    ({"threshold": -0.1}, "threshold must be a number in [0, 1]"),
    ({"block": 5}, "block 5 does not divide the length 24: use a divisor of 24"),
    ({"block": 0}, "block must be >= 1"),
    ({"refresh": 0}, "refresh must be >= 1"),
    ({"kv_cache": "both"}, "kv_cache must be one of off, prefix, dual"),
    ({"refresh": 2.5}, "refresh must be an integer"),
])
def test_bad_settings_fail_in_one_line_before_the_network_runs(opts: dict, message: str) -> None:
    cfg = micro("mdlm")
    model = randomized(cfg)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(SamplerError) as e:
            _run(model, cfg, **opts)
    finally:
        handle.remove()
    assert message in str(e.value) and "\n" not in str(e.value) and not calls


def test_confidence_settings_belong_to_the_confidence_sampler() -> None:
    cfg = micro("mdlm")
    with pytest.raises(SamplerError, match="unknown option.*threshold.*for sampler 'mdlm'"):
        sample(randomized(cfg), cfg, batch_size=1, length=L, steps=4, sampler="mdlm", generator=gen(),
               threshold=0.9)


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_a_pass_runs_on_the_rows_still_live_in_the_block(kind: str, one_torch_thread) -> None:
    """Rows done with the active block are left out of the pass: fewer row passes than calls x batch,
    and the cached sampler that refreshes every step, whose partial passes then read and write some rows' keys and
    values only, still gives the uncached sampler's tokens."""
    cfg = micro(kind)
    model = randomized(cfg)
    rows: list[int] = []
    inner = model.denoiser_logits
    model.denoiser_logits = lambda z, sigma, **kw: rows.append(z.shape[0]) or inner(z, sigma, **kw)
    tokens = torch.randint(0, cfg.vocab_size, (8, L), generator=gen(6))
    keep = torch.zeros(8, L, dtype=torch.bool)
    for r in range(8):  # row r is given the first r positions of each block of 8: it finishes each block sooner
        for b in range(0, L, 8):
            keep[r, b:b + r] = True
    opts = dict(batch=8, threshold=0.9, block=8, prefix=(tokens, keep))
    x, calls = _run(model, cfg, **opts)
    assert len(rows) == calls and min(rows) < 8 and sum(rows) < 8 * calls and not (x == cfg.mask_id).any()
    assert torch.equal(x[keep], tokens[keep])
    del model.denoiser_logits
    for kv_cache in ("dual", "prefix"):
        cached, cached_calls = _run(model, cfg, refresh=1, kv_cache=kv_cache, **opts)
        assert torch.equal(x, cached) and cached_calls == calls
        partial, _ = _run(model, cfg, refresh=3, kv_cache=kv_cache, **opts)
        assert not (partial == cfg.mask_id).any() and torch.equal(partial[keep], tokens[keep])


@pytest.mark.parametrize("kind", ["mdlm", "adlm"])
def test_the_ancestral_final_step_draws_or_takes_the_argmax(kind: str, monkeypatch) -> None:
    """``final="draw"`` fills the masks left after the grid with a draw from ``p_x0`` where the default takes its
    argmax, and the two differ at no more positions than it filled (the grid's draws are the same). The grid is
    cut at t = 0.5 here so that half the positions are still masked at its end (at the real 1e-5, about one in
    100,000 is)."""
    from adlm_model.sampling import samplers

    cfg = micro(kind)
    model = randomized(cfg)
    monkeypatch.setattr(samplers, "T_MIN", 0.5)
    tokens, keep = samplers.resolve_prefix(None, 8, L, cfg, torch.device("cpu"))
    out, filled = {}, {}
    for final in ("greedy", "draw"):
        stats: dict = {}
        with torch.no_grad():
            out[final] = samplers.diffusion_sample(model.eval(), cfg, tokens, keep, steps=4, sampler="mdlm",
                                                   nucleus_p=1.0, generator=gen(4), progress=None, cache=True,
                                                   stats=stats, final=final)
        filled[final] = stats["final_filled"]
        assert stats["final_filled"] > L and not (out[final] == cfg.mask_id).any()
    differ = int((out["greedy"] != out["draw"]).sum())
    assert filled["greedy"] == filled["draw"] and 0 < differ <= filled["draw"]
    with torch.no_grad():
        z = samplers.diffusion_sample(model.eval(), cfg, tokens, keep, steps=4, sampler="mdlm", nucleus_p=1.0,
                                      generator=gen(4), progress=None, cache=True, final="greedy")
    assert torch.equal(z, out["greedy"])
    with pytest.raises(SamplerError, match="final must be one of greedy, draw"):
        samplers.diffusion_sample(model, cfg, tokens, keep, steps=4, sampler="mdlm", nucleus_p=1.0,
                                  generator=gen(4), progress=None, cache=True, final="mode")
