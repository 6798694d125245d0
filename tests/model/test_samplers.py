"""Samplers (docs/design/method.md, section 4): caching is exact, transitions equal the formulas, prefixes hold."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from adlm_model import sample
from adlm_model.sampling.samplers import (
    ReMDMLoop,
    SamplerError,
    diffusion_step,
    mask_probabilities,
    nucleus,
    transition_probs,
)
from tests.support.models import L, M, V, gen, micro, randomized


@pytest.mark.parametrize("kind,sampler", [("mdlm", "mdlm"), ("mdlm", "remdm-loop"), ("adlm", "mdlm"),
                                          ("adlm", "remdm-loop")])
def test_cached_equals_uncached(kind: str, sampler: str) -> None:
    cfg = micro(kind)
    model = randomized(cfg)
    runs = {}
    for cache in (True, False):
        stats: dict = {}
        runs[cache] = sample(model, cfg, batch_size=2, length=16, steps=64, sampler=sampler, nucleus_p=0.9,
                             generator=gen(3), cache=cache, stats=stats), stats["network_calls"]
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1] < runs[False][1]  # and caching skipped some


def test_time_conditioning_disables_caching() -> None:
    cfg = micro("mdlm", time_conditioning=True)
    model = randomized(cfg)
    calls = []
    for cache in (True, False):
        stats: dict = {}
        sample(model, cfg, batch_size=1, length=16, steps=32, generator=gen(), stats=stats, cache=cache)
        calls.append(stats["network_calls"])
    assert calls[0] == calls[1] >= 16  # no step reuses p_x0 (sigma changes every step)


def _prefix_cases() -> list:
    lead = torch.tensor([5, 7, 9, 11])
    tokens = torch.randint(0, V, (2, L), generator=gen(7))
    keep = torch.rand(2, L, generator=gen(8)) < 0.3
    keep[:, 0] = True  # AR needs its first token
    return [("lead", lead, lead.expand(2, 4), torch.arange(L) < 4), ("keep", (tokens, keep), tokens, keep)]


@pytest.mark.parametrize("kind,sampler", [("mdlm", "mdlm"), ("mdlm", "remdm-loop"), ("adlm", "remdm-loop"),
                                          ("ar", "ar"), ("bd3lm", "bd3lm")])
def test_no_mask_left_and_prefix_unchanged(kind: str, sampler: str) -> None:
    cfg = micro(kind)
    model = randomized(cfg)
    for _, prefix, tokens, keep in _prefix_cases():
        # few steps: many masks are left for the final greedy step to fill
        x = sample(model, cfg, batch_size=2, length=L, steps=3, sampler=sampler, nucleus_p=0.8, generator=gen(),
                   prefix=prefix)
        assert x.shape == (2, L) and x.dtype == torch.long
        assert not (x == M).any()
        keep2 = keep.expand(2, L) if keep.dim() == 1 else keep
        if tokens.shape[1] < L:
            assert torch.equal(x[:, :tokens.shape[1]], tokens)
        else:
            assert torch.equal(x[keep2], tokens[keep2])


def test_remdm_transitions_equal_the_formulas() -> None:
    r = ReMDMLoop()
    a, eta = r.alpha_on, r.eta
    dt = 0.01
    p_x0 = torch.softmax(torch.randn(1, 6, 9, generator=gen(2)), -1)
    m = 8
    p_x0[..., m] = 0
    p_x0 = p_x0 / p_x0.sum(-1, keepdim=True)
    x = torch.tensor([[m, 3, m, 1, m, 0]])
    is_m = (x == m)[..., None]
    e_m = torch.zeros(9, dtype=torch.float64)
    e_m[m] = 1
    e_x = torch.nn.functional.one_hot(x, 9).double()
    p = p_x0.double()
    for t, phase in ((0.8, "on"), (0.3, "loop"), (0.04, "off")):  # t > t_on, t_off < t <= t_on, t <= t_off
        s = t - dt
        if phase == "on":
            mt, ms = 1 - (1 - t) * a / (1 - r.t_on), 1 - (1 - s) * a / (1 - r.t_on)
        elif phase == "off":
            mt, ms = t * (1 - a) / r.t_off, s * (1 - a) / r.t_off
        if phase == "loop":
            want = torch.where(is_m, p * eta * a / (1 - a) + e_m * (1 - a - a * eta) / (1 - a),
                               p * 0 + e_x * (1 - eta) + e_m * eta)
        else:  # MDLM step with these move chances, q = p_x0 (mt - ms) + ms e_m, normalised by mt
            want = torch.where(is_m, (p * (mt - ms) + e_m * ms) / mt, e_x)
        got = transition_probs(p_x0, x, m, *mask_probabilities("remdm-loop", t, s, r))
        assert torch.allclose(got, want, atol=1e-12), phase
        assert torch.allclose(got.sum(-1), torch.ones(1, 6, dtype=torch.float64))
        # the two-stage draw samples exactly this law: frequencies over 20,000 draws
        n = 20000
        xs = diffusion_step(x.expand(n, 6), p_x0.expand(n, 6, 9), torch.zeros(n, 6, dtype=torch.bool), m,
                            *mask_probabilities("remdm-loop", t, s, r), gen(11))
        freq = torch.nn.functional.one_hot(xs, 9).double().mean(0)
        assert (freq - got[0]).abs().max() < 0.02, phase
    # MDLM ancestral: masked positions stay masked with s / t, never remask
    assert mask_probabilities("mdlm", 0.5, 0.4) == pytest.approx((0.8, 0.0))


def test_given_tokens_are_never_remasked() -> None:
    x = torch.tensor([[1, 2, 3]])
    keep = torch.tensor([[True, False, False]])
    xs = diffusion_step(x.expand(500, 3), None, keep.expand(500, 3), 9, 0.5, 0.5, gen())
    assert (xs[:, 0] == 1).all() and (xs[:, 1:] == 9).any()


def test_nucleus_reference_rule() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.allclose(nucleus(probs, 0.8), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(nucleus(probs, 0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def _nucleus_by_full_sort(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The reference rule written the direct way: sort the whole vocabulary."""
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    keep = torch.cumsum(sorted_p, dim=-1) <= p
    keep[..., 0] = True
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p / sorted_p.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
def test_nucleus_by_topk_equals_the_full_sort(p: float) -> None:
    # Rows from peaked (the top 16 hold p) to flat (the dropped tail is within the bottom 1,000), and
    # between the two (the full sort): tier 1 is bit-exact, tier 2 equal up to float rounding.
    g = torch.Generator().manual_seed(0)
    temps = torch.tensor([0.05, 0.3, 1.0, 3.0, 30.0, 1e3]).repeat_interleave(7)[:, None, None]
    probs = torch.softmax(torch.randn(42, 3, 5000, generator=g) / temps, dim=-1)
    want = _nucleus_by_full_sort(probs, p)
    got = nucleus(probs, p, first_k=16, last_k=1000)
    assert got.shape == probs.shape
    assert torch.equal(got > 0, want > 0)  # the same tokens kept
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-9)
    assert torch.allclose(got.sum(-1), torch.ones(()))
    peaked = (torch.sort(probs, -1, descending=True)[0][..., :16].sum(-1) > p)
    assert peaked.any() and not peaked.all()
    tail = (want == 0).sum(-1)
    assert p < 0.9 or ((tail < 1000) & ~peaked).any()  # tier 2 is exercised at p = 0.9 and 0.99
    assert torch.equal(got[peaked], want[peaked])  # tier 1: bit for bit
    assert torch.equal(nucleus(probs, p, first_k=16, last_k=1), want)  # tiers 1 and 3 only: bit for bit


class Oracle(nn.Module):
    """Diffusion oracle: all mass on target[position] (positions honour position_offset)."""

    def __init__(self, target: torch.Tensor, width: int) -> None:
        super().__init__()
        self.target, self.width = target, width
        self.dummy = nn.Parameter(torch.zeros(1))

    def denoiser_logits(self, z, sigma, position_offset=None, **_):
        off = position_offset or 0
        tgt = self.target[:, off:off + z.shape[1]].expand(z.shape[0], -1)
        return torch.nn.functional.one_hot(tgt, self.width).float() * 1e4


class AROracle(nn.Module):
    """AR oracle: all mass on the successor of the current token along ``target``."""

    def __init__(self, target: torch.Tensor, width: int) -> None:
        super().__init__()
        self.succ = torch.zeros(width, dtype=torch.long)
        self.succ[target[0, :-1]] = target[0, 1:]
        self.width = width
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x, sigma=None, **_):
        return torch.nn.functional.one_hot(self.succ[x], self.width).float() * 1e4


@pytest.mark.parametrize("sampler", ["mdlm", "remdm-loop", "ar", "bd3lm"])
def test_certain_model_is_reproduced_exactly(sampler: str) -> None:
    cfg = micro("bd3lm" if sampler == "bd3lm" else "mdlm")
    target = torch.randperm(V, generator=gen(4))[:L][None]
    model = AROracle(target, cfg.width) if sampler == "ar" else Oracle(target, cfg.width)
    kw = {"bos_id": int(target[0, 0])} if sampler == "ar" else ({"kv_cache": False} if sampler == "bd3lm" else {})
    for cache in (True, False):
        x = sample(model, cfg, batch_size=3, length=L, steps=10, sampler=sampler, nucleus_p=0.9, generator=gen(),
                   cache=cache, **kw)
        assert torch.equal(x, target.expand(3, L)), (sampler, cache)


def test_ar_kv_cache_equals_uncached() -> None:
    cfg = micro("ar")
    model = randomized(cfg)
    out = [sample(model, cfg, batch_size=3, length=L, steps=1, sampler="ar", nucleus_p=0.9, generator=gen(5),
                  cache=c, prefix=torch.tensor([1, 2, 3])) for c in (True, False)]
    assert torch.equal(out[0], out[1])
    # and the logits agree: one cached step against the full recomputation
    from adlm_model.nn.backbone import KVCache

    x = out[0]
    kv = KVCache()
    with torch.no_grad():
        model(x[:, :10], cache=kv, cache_mode="append")
        step = model(x[:, 10:11], cache=kv, cache_mode="append")[:, -1]
        full = model(x[:, :11])[:, -1]
    assert torch.allclose(step, full, atol=1e-5)


def test_bad_arguments_fail_with_one_clear_line() -> None:
    cfg = micro("mdlm")
    model = randomized(cfg)
    with pytest.raises(SamplerError, match="unknown sampler"):
        sample(model, cfg, batch_size=1, length=8, steps=2, sampler="ddim", generator=gen())
    with pytest.raises(SamplerError, match="generator"):
        sample(model, cfg, batch_size=1, length=8, steps=2, generator=None)
    with pytest.raises(SamplerError, match="prefix"):
        sample(model, cfg, batch_size=1, length=8, steps=2, generator=gen(), prefix=torch.tensor([M]))
    with pytest.raises(SamplerError, match="unknown option"):
        sample(model, cfg, batch_size=1, length=8, steps=2, sampler="remdm-loop", generator=gen(), etta=0.1)
    with pytest.raises(SamplerError, match="bos_id"):
        sample(randomized(micro("ar")), micro("ar"), batch_size=1, length=8, steps=2, sampler="ar", generator=gen())
    with pytest.raises(SamplerError, match="t_off"):
        sample(model, cfg, batch_size=1, length=8, steps=2, sampler="remdm-loop", generator=gen(), t_off=0.7)


def test_progress_and_mode_restored() -> None:
    cfg = micro("mdlm")
    model = randomized(cfg).train()
    seen: list[tuple[int, int]] = []
    sample(model, cfg, batch_size=1, length=8, steps=5, generator=gen(), progress=lambda i, n: seen.append((i, n)))
    assert seen[-1] == (6, 6) and len(seen) == 6
    assert model.training


def test_ar_window_is_ar_within_the_context_and_slides_past_it() -> None:
    """The arbitrary-length AR sampler (BD3-LM's AR samples past 1024): the same tokens as ``ar`` within the model's
    context, then every token drawn after the last ``context`` tokens only."""
    cfg = micro("ar")
    model = randomized(cfg)
    kw = dict(batch_size=2, steps=1, nucleus_p=0.9, prefix=torch.tensor([1, 2, 3]))
    assert torch.equal(sample(model, cfg, length=L, sampler="ar", generator=gen(3), **kw),
                       sample(model, cfg, length=L, sampler="ar-window", generator=gen(3), **kw))
    seen: list[int] = []
    real = model.forward
    model.forward = lambda x, *a, **k: seen.append(x.shape[1]) or real(x, *a, **k)
    stats: dict = {}
    out = sample(model, cfg, length=2 * L + 5, sampler="ar-window", generator=gen(3), context=10, stats=stats, **kw)
    assert out.shape == (2, 2 * L + 5) and torch.equal(out[:, :3], torch.tensor([[1, 2, 3]] * 2))
    assert max(seen) == 10 and stats["network_calls"] == 2 * L + 5 - 3
    with pytest.raises(SamplerError, match=r"context must lie in \[1, 24\]"):
        sample(model, cfg, length=30, sampler="ar-window", generator=gen(3), context=25, **kw)
