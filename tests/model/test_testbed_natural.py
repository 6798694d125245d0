"""The natural testbed preset (adlm_model/testbed/natural.py): its exact quantities against brute-force enumeration
of its generative process (word chain, spellings, cut at the row's end, typos) on a tiny language, the sampler
against those probabilities, and the confidence profile it is built for (later pieces of a word nearly certain)."""

from __future__ import annotations

import itertools

import pytest
import torch

from adlm_model.testbed.language import BOS_ID, EOS_ID, MASK_ID, Testbed, TestbedConfig, TestbedError
from adlm_model.testbed.natural import NaturalTestbed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(length=6, content_vocab=3, n_words=3, max_word_len=3, word_length_decay=1.0, word_concentration=0.5,
            smoothing=0.05, seed=9)


def brute_force(tb: NaturalTestbed) -> dict[tuple[int, ...], float]:
    """p(row) for every row, by enumerating the process: word sequences until the spelling covers the row, the
    first n symbols of it, and each symbol kept or replaced by a uniform typo."""
    c = tb.config
    n, V, s = c.length - 2, c.content_vocab, c.smoothing
    spelled: dict[tuple[int, ...], float] = {}

    def words(seq_p: float, symbols: tuple[int, ...], last: int | None) -> None:
        if len(symbols) >= n:
            key = symbols[:n]
            spelled[key] = spelled.get(key, 0.0) + seq_p
            return
        for w in range(c.n_words):
            p = float(tb.word_start[w]) if last is None else float(tb.successor[last, w])
            words(seq_p * p, symbols + tb.spellings[w], w)

    words(1.0, (), None)
    probs: dict[tuple[int, ...], float] = {}
    for sym, p in spelled.items():
        for row in itertools.product(range(V), repeat=n):
            q = p
            for a, b in zip(sym, row, strict=True):
                q *= (1 - s) * (a == b) + s / V
            key = (BOS_ID, *(tb.content_lo + v for v in row), EOS_ID)
            probs[key] = probs.get(key, 0.0) + q
    return probs


@pytest.fixture(scope="module")
def tiny() -> tuple[NaturalTestbed, torch.Tensor, torch.Tensor]:
    tb = Testbed(TestbedConfig.natural(**TINY))
    assert isinstance(tb, NaturalTestbed)
    assert [len(sp) for sp in tb.spellings] == [1, 3, 3]  # one word the prefix of another: the segmentation is hidden
    bf = brute_force(tb)
    return tb, torch.tensor(list(bf), dtype=torch.long), torch.tensor(list(bf.values()), dtype=torch.float64)


def _consistent(rows: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return ((rows[None] == z[:, None]) | (z == MASK_ID)[:, None]).all(-1)


def _masked_versions(rows: torch.Tensor, seed: int, n: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = rows[torch.randint(0, rows.shape[0], (n,), generator=g)].clone()
    z[torch.rand(z.shape, generator=g) < 0.5] = MASK_ID
    z[0] = MASK_ID
    return z


def test_log_prob_and_marginals_match_brute_force(tiny):
    tb, rows, p = tiny
    assert abs(float(p.sum()) - 1.0) < 1e-12
    torch.testing.assert_close(tb.log_prob(rows), p.log(), rtol=0, atol=1e-10)
    z = _masked_versions(rows, 1)
    expected = (_consistent(rows, z).double() * p[None]).sum(-1).log()
    torch.testing.assert_close(tb.log_marginal(z), expected, rtol=0, atol=1e-10)
    bad = rows[:2].clone()
    bad[0, 0], bad[1, 2] = EOS_ID, BOS_ID  # wrong framing; a special id among the content
    assert torch.isneginf(tb.log_prob(bad)).all()


def test_conditionals_match_brute_force(tiny):
    tb, rows, p = tiny
    z = _masked_versions(rows, 2)
    got = tb.conditionals(z)
    w = _consistent(rows, z).double() * p[None]
    for i in range(z.shape[0]):
        for pos in range(tb.length):
            expected = torch.zeros(tb.vocab_size, dtype=torch.float64).index_add_(0, rows[:, pos], w[i]) / w[i].sum()
            torch.testing.assert_close(got[i, pos].exp(), expected, rtol=0, atol=1e-10)
    # The causal view p(x^l | x^{<l}) (the prefix's conditional, future masked) and the leave-one-out one.
    nt, loo = tb.next_token_conditionals(rows[:25]), tb.leave_one_out_conditionals(rows[:25])
    for i in range(25):
        for pos in range(1, tb.length - 1):
            prefix, alone = rows[i:i + 1].clone(), rows[i:i + 1].clone()
            prefix[0, pos:-1] = alone[0, pos] = MASK_ID
            torch.testing.assert_close(nt[i, pos], tb.conditionals(prefix)[0, pos], rtol=0, atol=1e-10)
            torch.testing.assert_close(loo[i, pos], tb.conditionals(alone)[0, pos], rtol=0, atol=1e-10)


def test_sampler_draws_the_distribution_log_prob_scores(tiny):
    tb, rows, p = tiny
    x = tb.sample(40000, seed=5)
    assert (x[:, 0] == BOS_ID).all() and (x[:, -1] == EOS_ID).all()
    index = {tuple(r): i for i, r in enumerate(rows.tolist())}
    counts = torch.bincount(torch.tensor([index[tuple(r)] for r in x.tolist()]), minlength=rows.shape[0])
    tv = 0.5 * float((counts.double() / 40000 - p).abs().sum())
    assert tv < 0.04, tv  # 81 outcomes, 40k draws: sampling noise gives TV ~ 0.02; a wrong process far more


def test_confidence_profile_and_the_presets():
    """What the preset is for: given every other token, most positions are nearly certain (unlike the anchored
    preset, where none is); config round trip; the anchored preset stays the default."""
    tb = Testbed(TestbedConfig.natural(length=16, n_words=128, content_vocab=64, seed=1))
    x = tb.sample(32, seed=3)
    share = float((tb.leave_one_out_conditionals(x)[:, 1:-1].exp().max(-1).values >= 0.9).double().mean())
    share_next = float((tb.next_token_conditionals(x)[:, 1:-1].exp().max(-1).values >= 0.9).double().mean())
    anchored = Testbed(TestbedConfig(length=16, seed=1))
    xa = anchored.sample(32, seed=3)
    xa[:, 5] = MASK_ID
    share_anchored = float((anchored.conditionals(xa)[:, 5].exp().max(-1).values >= 0.9).double().mean())
    assert share > max(0.25, share_next) and share_anchored < 0.1, (share, share_next, share_anchored)
    assert type(Testbed(TestbedConfig())) is Testbed and TestbedConfig().preset == "anchored"
    again = Testbed.from_dict(tb.to_dict())
    assert isinstance(again, NaturalTestbed) and torch.equal(again.sample(8, 1), tb.sample(8, 1))
    assert tb.vocab_size == 4 + tb.config.content_vocab == len(tb.token_names())
    assert TestbedConfig.from_dict({"preset": "natural"}) == TestbedConfig.natural()
    with pytest.raises(TestbedError, match="preset must be one of anchored, natural"):
        TestbedConfig.from_dict({"preset": "english"})


def test_the_entropy_is_kept_per_language_and_is_the_mean_exact_nll_of_its_rows():
    """A language built again with the same config reuses its entropy (the benchmark builds each preset's language
    once per run of its sweeps); the value is the mean exact NLL of its seeded rows, and another config has its own."""
    cfg = TestbedConfig.natural(**TINY, entropy_rows=300)
    first = Testbed(cfg).entropy_per_row()
    assert Testbed(cfg).entropy_per_row() is first
    tb = Testbed(cfg)
    assert first.mean == pytest.approx(-float(tb.log_prob(tb.sample(300, seed=10_000_000)).mean()), rel=1e-12)
    other = Testbed(TestbedConfig.natural(**{**TINY, "seed": 10}, entropy_rows=300)).entropy_per_row()
    assert other is not first and other.mean != first.mean
