"""The ground-truth testbed (adlm_model/testbed/language.py): its exact quantities against brute-force enumeration of the
generative process on tiny languages, the sampler against those probabilities, the recorded entropy against
fresh rows, determinism, and the oracle denoiser under MDLM's NELBO (docs/design/method.md, section 1)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from adlm_model import ModelConfig
from adlm_model.objectives.losses import mdlm_objective
from adlm_model.testbed.language import BOS_ID, EOS_ID, MASK_ID, OracleDenoiser, Testbed, TestbedConfig, TestbedError

TINY = dict(length=5, content_vocab=3, n_classes=2, n_states=2, anchors_per_class=1, max_anchors=1,
            anchor_rate=0.3, transition_concentration=0.5, emission_concentration=0.5, seed=3)
TWO_ANCHORS = dict(TINY, length=6, max_anchors=2, anchors_per_class=2, anchor_rate=0.25)


def brute_force(tb: Testbed) -> dict[tuple[int, ...], float]:
    """p(row) for every row, by enumerating the generative process itself (class, hidden path, anchor choices)."""
    c = tb.config
    n = c.length - 2
    probs: dict[tuple[int, ...], float] = {}
    for k in range(c.n_classes):
        for path in itertools.product(range(c.n_states), repeat=n):
            p_path = float(tb.prior[k] * tb.pi[k, path[0]])
            for a, b in zip(path[:-1], path[1:], strict=True):
                p_path *= float(tb.P[k, a, b])

            def emit(t: int, count: int, p: float, row: tuple[int, ...], k: int = k, path: tuple = path) -> None:
                if t == n:
                    key = (BOS_ID, *row, EOS_ID)
                    probs[key] = probs.get(key, 0.0) + p
                    return
                rho = c.anchor_rate if count < c.max_anchors else 0.0
                for v in range(c.content_vocab):
                    emit(t + 1, count, p * (1 - rho) * float(tb.E[path[t], v]), (*row, tb.content_lo + v))
                if rho > 0:
                    for j in range(c.anchors_per_class):
                        sym = tb.anchor_lo + k * c.anchors_per_class + j
                        emit(t + 1, count + 1, p * rho / c.anchors_per_class, (*row, sym))

            emit(0, 0, p_path, ())
    return probs


@pytest.fixture(scope="module", params=[TINY, TWO_ANCHORS], ids=["one-anchor", "two-anchors"])
def tiny(request) -> tuple[Testbed, torch.Tensor, torch.Tensor]:
    tb = Testbed(TestbedConfig(**request.param))
    bf = brute_force(tb)
    rows = torch.tensor(list(bf), dtype=torch.long)
    return tb, rows, torch.tensor(list(bf.values()), dtype=torch.float64)


def test_log_prob_matches_brute_force(tiny):
    tb, rows, p = tiny
    assert abs(float(p.sum()) - 1.0) < 1e-12  # the enumeration is a distribution
    torch.testing.assert_close(tb.log_prob(rows), p.log(), rtol=0, atol=1e-10)
    assert torch.isneginf(tb.log_prob(rows[:1].clone().index_fill_(1, torch.tensor([0]), EOS_ID))).all()


def _consistent(rows: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """(n_z, n_rows): row agrees with z on z's visible positions."""
    vis = z != MASK_ID
    return ((rows[None] == z[:, None]) | ~vis[:, None]).all(-1)


def _masked_versions(rows: torch.Tensor, seed: int, n: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows.shape[0], (n,), generator=g)
    z = rows[idx].clone()
    z[torch.rand(z.shape, generator=g) < 0.5] = MASK_ID
    z[0] = MASK_ID  # everything masked: the position marginals
    return z


def test_log_marginal_matches_brute_force(tiny):
    tb, rows, p = tiny
    z = _masked_versions(rows, 1)
    expected = (_consistent(rows, z).double() * p[None]).sum(-1).log()
    torch.testing.assert_close(tb.log_marginal(z, MASK_ID), expected, rtol=0, atol=1e-10)


def test_conditionals_match_brute_force(tiny):
    tb, rows, p = tiny
    z = _masked_versions(rows, 2)
    got = tb.conditionals(z, MASK_ID)
    assert got.shape == (z.shape[0], tb.length, tb.vocab_size)
    w = _consistent(rows, z).double() * p[None]  # (n_z, n_rows)
    for i in range(z.shape[0]):
        for pos in range(tb.length):
            expected = torch.zeros(tb.vocab_size, dtype=torch.float64).index_add_(0, rows[:, pos], w[i]) / w[i].sum()
            torch.testing.assert_close(got[i, pos].exp(), expected, rtol=0, atol=1e-10)
    assert (got[..., MASK_ID] == float("-inf")).all()


def test_sampler_draws_the_distribution_log_prob_scores():
    tb = Testbed(TestbedConfig(**TINY))
    bf = brute_force(tb)
    x = tb.sample(40000, seed=5)
    assert (x[:, 0] == BOS_ID).all() and (x[:, -1] == EOS_ID).all()
    counts: dict[tuple[int, ...], int] = {}
    for r in map(tuple, x.tolist()):
        counts[r] = counts.get(r, 0) + 1
    assert set(counts) <= set(bf)
    tv = 0.5 * sum(abs(counts.get(r, 0) / 40000 - q) for r, q in bf.items())
    assert tv < 0.03, tv  # 125 outcomes, 40k draws: sampling noise gives TV ~ 0.02; a wrong process far more


def test_recorded_entropy_matches_fresh_rows():
    tb = Testbed(TestbedConfig(length=16, entropy_rows=4000, seed=1))
    e = tb.entropy_per_row()
    nll = -tb.log_prob(tb.sample(4000, seed=77))
    se = math.hypot(e.se, float(nll.std()) / math.sqrt(nll.numel()))
    assert abs(float(nll.mean()) - e.mean) < 4 * se
    tok = tb.entropy_per_token()
    assert tok.mean == pytest.approx(e.mean / 16) and tb.entropy_per_token(skip_first=True).mean == pytest.approx(e.mean / 15)
    floors = tb.floors()
    assert tok.mean < floors["unigram_position"] <= floors["unigram"] + 1e-12  # context matters


def test_anchors_by_construction_and_their_value():
    tb = Testbed(TestbedConfig(length=24, seed=2))
    x = tb.sample(500, seed=3)
    anc = tb.is_anchor_token(x)
    counts = torch.zeros(x.shape[0], tb.vocab_size, dtype=torch.long).scatter_add_(1, x, torch.ones_like(x))
    assert (counts.gather(1, x)[anc] <= tb.config.tau).all()  # every anchor meets ADLM's rule
    assert anc.sum(1).max() <= tb.config.max_anchors
    cls = (x - tb.anchor_lo) // tb.config.anchors_per_class
    for r in range(50):  # one class per row: all its anchors name the same class
        assert cls[r][anc[r]].unique().numel() <= 1
    v = tb.anchor_value(n=200)
    assert v["mutual_information_per_token"].mean > 5 * v["mutual_information_per_token"].se > 0
    assert v["gain_at_full_masking"].mean > 5 * v["gain_at_full_masking"].se > 0


def test_deterministic_from_the_seed_and_round_trips():
    cfg = TestbedConfig(length=16, seed=4)
    a, b = Testbed(cfg), Testbed.from_dict(cfg.to_dict())
    assert torch.equal(a.sample(64, 9), b.sample(64, 9))
    assert not torch.equal(a.sample(64, 9), a.sample(64, 10))
    assert torch.equal(a.P, b.P) and not torch.equal(a.P, Testbed(TestbedConfig(length=16, seed=5)).P)
    assert a.to_dict() == cfg.to_dict() and len(a.token_names()) == a.vocab_size


def test_bad_config_and_input_are_refused_clearly():
    with pytest.raises(TestbedError, match="max_anchors 6 must lie in"):
        TestbedConfig(max_anchors=6, tau=5).validate()
    with pytest.raises(TestbedError, match="unknown testbed config key"):
        TestbedConfig.from_dict({"lenght": 10})
    with pytest.raises(TestbedError, match=r"shape \(n, 64\)"):
        Testbed().log_prob(torch.zeros(2, 10, dtype=torch.long))


def test_oracle_denoiser_nelbo_is_the_exact_nll():
    """MDLM's any-order identity: with the exact conditionals as the denoiser, the NELBO's expectation is the exact
    NLL (up to the eps of the schedule)."""
    tb = Testbed(TestbedConfig(length=10, content_vocab=6, n_classes=3, n_states=3, seed=6))
    cfg = ModelConfig(kind="mdlm", vocab_size=tb.vocab_size, mask_id=MASK_ID, seq_len=tb.length, hidden=8, heads=2)
    oracle = OracleDenoiser(tb)
    x = tb.sample(1, seed=1).expand(256, -1).contiguous()
    g = torch.Generator().manual_seed(0)
    means = torch.tensor([float(mdlm_objective(oracle, x, None, cfg, generator=g).nll_sum) / 256 for _ in range(8)])
    exact = -float(tb.log_prob(x[:1]))
    se = float(means.std()) / math.sqrt(len(means))
    assert abs(float(means.mean()) - exact) < 4 * se + 0.01 * exact, (float(means.mean()), exact, se)


def test_impossible_visible_tokens_fall_back_to_the_position_marginals():
    """A parallel sampler can unmask anchors of two classes at once: no conditional exists, the oracle gives the
    position marginals at the masked positions (strict: an error) and keeps the visible tokens."""
    tb = Testbed(TestbedConfig(length=8, seed=1))
    z = torch.full((1, 8), MASK_ID)
    z[0, 2], z[0, 5] = tb.anchor_lo, tb.anchor_lo + tb.config.anchors_per_class  # classes 0 and 1
    assert torch.isneginf(tb.log_marginal(z)).all()
    with pytest.raises(TestbedError, match="probability 0"):
        tb.conditionals(z, strict=True)
    got = tb.conditionals(z)
    masked = torch.tensor([0, 1, 3, 4, 6, 7])
    torch.testing.assert_close(got[0, masked].exp(), tb.position_marginals[masked], rtol=0, atol=1e-12)
    assert got[0, 2, tb.anchor_lo] == 0 and got[0, 5, tb.anchor_lo + tb.config.anchors_per_class] == 0
