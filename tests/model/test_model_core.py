"""The model core against docs/design/method.md, sections 1-3: exact likelihoods, SUBS, the anchor mask and
ramp, gradient flow, parameter counts, causality, learning, and checkpoints."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn

from adlm_model import (
    EMA,
    CheckpointError,
    ConfigError,
    ModelConfig,
    anchor_mask,
    build_model,
    compute_loss,
    count_parameters,
    gamma_at,
    load_checkpoint,
    preset,
    save_checkpoint,
    subs_log_probs,
    subs_nll,
)
from adlm_model.objectives.losses import adlm_objective, mdlm_objective, suppress_mask
from tests.support.models import L, M, V, gen, micro, randomized

# Tiny models: one intra-op thread is nearly as fast as two here and leaves the other core to the rest of the suite.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---------------------------------------------------------------- a toy distribution, enumerable


class ToyExactDenoiser(nn.Module):
    """p(x^l | visible tokens of z) of a known distribution over all V^L sequences.

    It does not depend on t, like the exact conditional of an absorbing diffusion (docs/design/method.md, section 1).
    """

    def __init__(self, probs: torch.Tensor, vocab: int, length: int, mask_id: int, mix_uniform: float = 0.0):
        super().__init__()
        self.seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # (S, L)
        self.probs = probs.double()
        self.onehot = nn.functional.one_hot(self.seqs, vocab + 1).double()  # (S, L, width)
        self.mask_id, self.vocab, self.mix = mask_id, vocab, mix_uniform

    def denoiser_logits(self, z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        masked = z == self.mask_id
        consistent = (masked[:, None, :] | (z[:, None, :] == self.seqs[None])).all(-1)  # (B, S)
        w = consistent.double() * self.probs[None]
        p = torch.einsum("bs,slv->blv", w, self.onehot) / w.sum(1)[:, None, None]
        if self.mix:
            uniform = torch.zeros_like(p)
            uniform[..., : self.vocab] = 1.0 / self.vocab
            p = (1 - self.mix) * p + self.mix * uniform
        return p.clamp_min(1e-300).log().float()

    def forward(self, z, sigma):  # the ADLM interface: (anchor logits, denoiser logits)
        logits = self.denoiser_logits(z, sigma)
        return torch.randn_like(logits), logits


def _toy(seed: int = 0, vocab: int = 3, length: int = 4):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(vocab**length, generator=g) ** 3
    probs = probs / probs.sum()
    cfg = ModelConfig(kind="mdlm", vocab_size=vocab, mask_id=vocab, seq_len=length, hidden=8, heads=2,
                      n_blocks=1, cond_dim=8)
    return probs, cfg


@pytest.mark.parametrize("seq_index", [0, 17, 80])
def test_nelbo_of_exact_denoiser_converges_to_exact_nll(seq_index: int) -> None:
    probs, cfg = _toy()
    exact = ToyExactDenoiser(probs, 3, 4, cfg.mask_id)
    x = exact.seqs[seq_index].repeat(200_000, 1)
    nll = -math.log(probs[seq_index].item())
    out = mdlm_objective(exact, x, None, cfg, generator=torch.Generator().manual_seed(1))
    per_seq = out.nll_sum.item() / x.shape[0]
    assert out.n_tokens.item() == x.numel()
    assert abs(per_seq - nll) / nll < 0.01, (per_seq, nll)


def test_imperfect_denoiser_gives_a_larger_bound() -> None:
    """Over x ~ p (a single sequence may be favoured by a flatter model), with the same t and masks."""
    probs, cfg = _toy(seed=4)
    exact = ToyExactDenoiser(probs, 3, 4, cfg.mask_id)
    idx = torch.multinomial(probs, 40_000, replacement=True, generator=torch.Generator().manual_seed(5))
    x = exact.seqs[idx]
    entropy = -(probs * probs.log()).sum().item()
    best = mdlm_objective(exact, x, None, cfg, generator=torch.Generator().manual_seed(1)).nll_sum.item() / len(x)
    assert abs(best - entropy) / entropy < 0.01
    for mix in (0.05, 0.3):
        worse = ToyExactDenoiser(probs, 3, 4, cfg.mask_id, mix_uniform=mix)
        value = mdlm_objective(worse, x, None, cfg, generator=torch.Generator().manual_seed(1)).nll_sum.item() / len(x)
        assert value > best + 0.005, (mix, value, best)


def test_anelbo_denoiser_term_is_the_nelbo() -> None:
    probs, cfg = _toy()
    cfg = cfg.replace(kind="adlm", gamma=0.5, gamma_horizon=0)
    exact = ToyExactDenoiser(probs, 3, 4, cfg.mask_id)
    idx = torch.multinomial(probs, 40_000, replacement=True, generator=torch.Generator().manual_seed(3))
    x = exact.seqs[idx]
    out = adlm_objective(exact, x, None, cfg, step=10, generator=torch.Generator().manual_seed(2))
    ref = mdlm_objective(exact, x, None, cfg, generator=torch.Generator().manual_seed(2))
    assert torch.equal(out.nll_sum, ref.nll_sum)  # the denoiser term is exactly the MDLM NELBO
    entropy = -(probs * probs.log()).sum().item()
    assert abs(out.nll_sum.item() / x.shape[0] - entropy) / entropy < 0.01
    # The anchor term is added to the training loss only, scaled by gamma_k.
    assert out.gamma_k == 0.5
    expected = (out.nll_sum + 0.5 * out.anchor_sum) / out.n_tokens
    assert torch.allclose(out.loss.double(), expected, rtol=1e-5)


# ---------------------------------------------------------------- SUBS


def test_subs_carry_over_and_zero_mask_probability() -> None:
    torch.manual_seed(0)
    mask_id, width = 7, 8
    logits = torch.randn(3, 5, width)
    z = torch.tensor([[1, 7, 3, 7, 0], [7, 7, 7, 7, 7], [2, 2, 2, 2, 2]])
    logp = subs_log_probs(logits, z, mask_id)
    assert torch.isneginf(logp[..., mask_id]).all()
    unmasked = z != mask_id
    assert torch.equal(logp[unmasked].exp(), nn.functional.one_hot(z[unmasked], width).float())
    assert torch.allclose(logp[~unmasked].exp().sum(-1), torch.ones(int((~unmasked).sum())))
    x = torch.tensor([[1, 4, 3, 2, 0], [0, 1, 2, 3, 4], [2, 2, 2, 2, 2]])
    nll = subs_nll(logits, x, z, mask_id)
    assert torch.equal(nll[unmasked], torch.zeros(int(unmasked.sum())))
    assert torch.allclose(nll[~unmasked], -logp[~unmasked].gather(-1, x[~unmasked][:, None]).squeeze(-1))


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, V, (3, L), generator=gen(5))
    am = torch.ones_like(x)
    am[0, 15:] = 0
    am[2, 9:] = 0
    return x, am


def test_pads_never_count_in_the_nelbo() -> None:
    """Per-token contributions, exactly: the NELBO sum is the sum over non-pad positions of w(t) times the SUBS
    NLL of the masked ones, and the pads' terms (clearly non-zero when counted) are not in it."""
    cfg = micro("mdlm")
    model = randomized(cfg, std=0.1)
    x, am = _padded_batch()
    t = torch.tensor([0.3, 0.6, 0.9])
    z = torch.where(torch.rand(x.shape, generator=gen(6)) < 0.8, torch.full_like(x, M), x)
    out = mdlm_objective(model, x, am, cfg, t=t, z_t=z)
    with torch.no_grad():
        per_token = subs_nll(model.denoiser_logits(z, torch.zeros(3)), x, z, M) / t[:, None]
    assert out.n_tokens.item() == int(am.sum())
    assert out.nll_sum.item() == pytest.approx(float((per_token * am).sum()), rel=1e-6)
    assert float((per_token * (1 - am)).sum()) > 1.0  # what counting the pads would have added


def test_pads_never_count_in_the_anchor_term_or_the_ar_nll() -> None:
    cfg = micro("adlm", tau=2)
    model = randomized(cfg, std=0.1)
    x, am = _padded_batch()
    t = torch.tensor([0.3, 0.6, 0.9])
    z = torch.where(torch.rand(x.shape, generator=gen(7)) < 0.5, torch.full_like(x, M), x)
    out = adlm_objective(model, x, am, cfg, step=10**6, t=t, z_t=z)
    with torch.no_grad():
        anchor_logits, _ = model(z, torch.zeros(3))
        anchor_nll = -torch.log_softmax(anchor_logits.float(), -1).gather(-1, x[..., None]).squeeze(-1) / t[:, None]
    a = anchor_mask(x, am, cfg.tau, cfg.width)
    assert not a[am == 0].any()
    assert out.anchor_sum.item() == pytest.approx(float((anchor_nll * a).sum()), rel=1e-5)
    assert out.n_anchor.item() == int(a.sum())

    ar_cfg = micro("ar")
    ar = randomized(ar_cfg, std=0.1)
    out = compute_loss(ar, x, am, ar_cfg)
    with torch.no_grad():
        logp = torch.log_softmax(suppress_mask(ar(x)[:, :-1], M), -1)  # the mask id is never a target
    per_target = -logp.gather(-1, x[:, 1:, None]).squeeze(-1)
    assert out.n_tokens.item() == int(am[:, 1:].sum())
    assert out.nll_sum.item() == pytest.approx(float((per_target * am[:, 1:]).sum()), rel=1e-5)
    assert float((per_target * (1 - am[:, 1:])).sum()) > 1.0


# ---------------------------------------------------------------- anchor mask and gamma ramp


def test_anchor_mask_equals_plain_count() -> None:
    g = torch.Generator().manual_seed(0)
    bos = eos = 20
    for tau in (0, 1, 2, 5):
        x = torch.randint(0, 8, (6, 30), generator=g)  # small vocabulary: many repeats
        x[:, 0] = bos
        x[:, 25] = eos
        am = torch.ones_like(x)
        am[2, 26:] = 0
        am[4, 20:] = 0
        x[2, 26:] = 0  # pad id 0 also occurs as a real token
        a = anchor_mask(x, am, tau, width=21)
        for b in range(x.shape[0]):
            row = [int(v) for v, m in zip(x[b], am[b], strict=True) if m]
            for pos in range(x.shape[1]):
                want = bool(am[b, pos]) and row.count(int(x[b, pos])) <= tau
                assert bool(a[b, pos]) == want, (tau, b, pos)


def test_gamma_ramp_reference_values() -> None:
    gamma, beta, k_max = 3e-3, 1.0, 1_000_000
    for k in (0, 1, 1500, 2999, 3000, 3001, 500_000, 1_000_000):
        assert gamma_at(k, gamma, beta, k_max) == pytest.approx(min(gamma, beta * k / k_max), rel=1e-9, abs=1e-15)
    assert gamma_at(5, gamma, beta, 0) == gamma


def _ramp_length(gamma: float, beta: float, horizon: int) -> int:
    """The first step at which the anchor weight reaches gamma."""
    return next(k for k in range(horizon + 1) if gamma_at(k, gamma, beta, horizon) >= gamma)


def test_the_ramp_length_scales_with_gamma() -> None:
    """beta fixed: the ramp is gamma / beta * K steps, so a sweep over gamma does not keep one ramp length
    (the reference: 3,000 steps at 3e-3, 6,000 at 6e-3, over 1M steps)."""
    assert _ramp_length(3e-3, 1.0, 1_000_000) == 3000
    assert _ramp_length(6e-3, 1.0, 1_000_000) == 6000
    # A training recipe's K is its run's length unless set.
    from pipelines.training.config import load_config

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "demo.yaml", ["run.max_steps=123"])
    assert cfg.model.gamma_horizon == 123 and cfg.model.gamma_beta == 1.0
    assert load_config(root / "configs" / "demo.yaml", ["model.gamma_horizon=7"]).model.gamma_horizon == 7


# ---------------------------------------------------------------- architecture


def test_parameter_counts_small() -> None:
    adlm = build_model(preset("small", kind="adlm"))
    mdlm = build_model(preset("small", kind="mdlm"))
    assert count_parameters(adlm.anchor) == pytest.approx(169.6e6, rel=0.005)
    assert count_parameters(adlm.denoiser) == pytest.approx(123.6e6, rel=0.005)
    assert count_parameters(adlm) == pytest.approx(293.2e6, rel=0.005)
    assert count_parameters(mdlm) == pytest.approx(169.6e6, rel=0.005)
    assert adlm.denoiser.dense_in.in_features == 50258 and adlm.denoiser.dense_in.bias is not None


def _randomised(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    return randomized(cfg, seed, std=0.05).train()


def test_gradients_reach_anchor_through_denoiser_term() -> None:
    cfg = preset("tiny", kind="adlm", gamma=0.0, hidden=32, heads=2, cond_dim=16, n_blocks=2, denoiser_blocks=1,
                 vocab_size=40, mask_id=40, seq_len=12, dropout=0.0)
    model = _randomised(cfg)
    x = torch.randint(0, 40, (4, 12))
    out = compute_loss(model, x, None, cfg, step=100, generator=torch.Generator().manual_seed(0))
    assert out.gamma_k == 0.0
    out.loss.backward()
    for name, p in model.anchor.named_parameters():
        if name.startswith("sigma_map"):
            continue  # time conditioning is off: sigma = 0 zeroes the first layer's sin half only
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_fused_adlm_inference_equals_unfused() -> None:
    """The inference path folds the anchor's output layer into the denoiser's input layer: same logits."""
    cfg = micro("adlm")
    model = randomized(cfg)
    z = torch.randint(0, V + 1, (2, L), generator=gen(1))
    sigma = torch.zeros(2)
    with torch.no_grad():
        fused = model.denoiser_logits(z, sigma, fused=True)
        unfused = model.denoiser_logits(z, sigma, fused=False)
    assert torch.allclose(fused, unfused, rtol=1e-4, atol=1e-4)
    assert unfused.abs().max() > 1e-2  # a real comparison, not two zero tensors


def test_ar_is_causal() -> None:
    cfg = preset("tiny", kind="ar", hidden=32, heads=2, cond_dim=16, n_blocks=2, vocab_size=50, mask_id=50,
                 seq_len=16, dropout=0.0)
    model = _randomised(cfg).eval()
    x = torch.randint(0, 50, (2, 16))
    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 7) % 50
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:], atol=1e-3)


def test_bidirectional_models_see_the_future() -> None:
    cfg = preset("tiny", kind="mdlm", hidden=32, heads=2, cond_dim=16, n_blocks=2, vocab_size=50, mask_id=50,
                 seq_len=16, dropout=0.0)
    model = _randomised(cfg).eval()
    x = torch.randint(0, 50, (2, 16))
    y = x.clone()
    y[:, 12] = (y[:, 12] + 3) % 50
    with torch.no_grad():
        diff = (model(x, torch.zeros(2))[:, 0] - model(y, torch.zeros(2))[:, 0]).abs().max()
    assert diff > 1e-5


# ---------------------------------------------------------------- the models learn


def _progressions(n: int, vocab: int, length: int, g: torch.Generator) -> torch.Tensor:
    """x^l = (s + l) mod V with a uniform start s: entropy log V per sequence."""
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return (start + torch.arange(length)[None]) % vocab


@pytest.mark.parametrize("kind", ["mdlm", "adlm", "ar"])
def test_plain_loop_learns_toy_pattern(kind: str) -> None:
    vocab, length = 16, 16
    cfg = ModelConfig(kind=kind, vocab_size=vocab, mask_id=vocab, seq_len=length, hidden=64, heads=4,
                      n_blocks=2, denoiser_blocks=1, cond_dim=32, dropout=0.0, gamma=3e-3, gamma_beta=0.06, gamma_horizon=1000)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(250):
        x = _progressions(64, vocab, length, g)
        out = compute_loss(model, x, None, cfg, step=step, generator=g)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.nll_sum.item() / out.n_tokens.item())
    # Per-token entropy: log V per sequence spread over L tokens (diffusion); 0 for AR after token 1.
    entropy = 0.0 if kind == "ar" else math.log(vocab) / length
    final = sum(losses[-25:]) / 25
    assert losses[0] > 1.0
    assert final < entropy + 0.12, (kind, final, entropy)


# ---------------------------------------------------------------- EMA and checkpoints


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros((), dtype=torch.float64))


def _reference_ema(values: list[float], decay: float) -> list[float]:
    """The references' EMA, written out: at update n (from 1), d = min(decay, (1 + n) / (10 + n))."""
    e, out = 0.0, []
    for n, v in enumerate(values, start=1):
        d = min(decay, (1 + n) / (10 + n))
        e = d * e + (1 - d) * v
        out.append(e)
    return out


def test_ema_warm_up_equals_the_reference_formula_and_survives_a_resume() -> None:
    values = [float(k % 7) - 2.5 + 0.01 * k for k in range(1, 1001)]
    want = _reference_ema(values, 0.9999)
    model, ema = _Scalar(), None
    ema = EMA(model, decay=0.9999)
    got = []
    for v in values:
        model.w.data.fill_(v)
        ema.update(model)
        got.append(float(ema.shadow["w"]))
    for n in (1, 10, 1000):
        assert got[n - 1] == pytest.approx(want[n - 1], rel=1e-12, abs=1e-12), n
    assert ema.current_decay() == pytest.approx(min(0.9999, 1002 / 1011))
    # Without the warm-up a 0.9999 average is still mostly the initial value after 1,000 updates.
    plain = EMA(_Scalar(), decay=0.9999, warmup=False)
    assert plain.current_decay() == 0.9999

    # Resume after 600 updates: the shadow and the update count restored give the same sequence.
    model2, first = _Scalar(), None
    first = EMA(model2, decay=0.9999)
    for v in values[:600]:
        model2.w.data.fill_(v)
        first.update(model2)
    resumed = EMA(_Scalar(), decay=0.9999)
    resumed.load_state_dict(first.state_dict(), num_updates=first.num_updates)
    model3 = _Scalar()
    for v in values[600:]:
        model3.w.data.fill_(v)
        resumed.update(model3)
    assert resumed.num_updates == 1000 and float(resumed.shadow["w"]) == pytest.approx(want[-1], rel=1e-12)


def test_checkpoint_round_trip_is_bit_exact(tmp_path) -> None:
    cfg = preset("tiny", kind="adlm", hidden=32, heads=2, cond_dim=16, n_blocks=2, denoiser_blocks=1,
                 vocab_size=60, mask_id=60, seq_len=16)
    model = _randomised(cfg)
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    ema.update(model)
    save_checkpoint(tmp_path / "ck", model, cfg, ema_state=ema.state_dict(), meta={"step": 3})
    loaded, cfg2, meta = load_checkpoint(tmp_path / "ck", use_ema=False)
    assert cfg2 == cfg and meta == {"step": 3}
    for (n1, a), (n2, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b)
    loaded_ema, _, _ = load_checkpoint(tmp_path / "ck", use_ema=True)
    for name, p in loaded_ema.named_parameters():
        assert torch.equal(p, ema.shadow[name])
    with pytest.raises(CheckpointError, match=r"vocab_size=60 but 8192 was expected"):
        load_checkpoint(tmp_path / "ck", expect={"vocab_size": 8192})
    with pytest.raises(CheckpointError, match=r"kind='adlm' but 'mdlm' was expected"):
        load_checkpoint(tmp_path / "ck", expect={"kind": "mdlm"})
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "missing")


def test_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"model: unknown key\(s\) hiden \(did you mean 'hidden'\?\); known: kind, vocab_size"):
        ModelConfig.from_dict({"hiden": 3})
    with pytest.raises(ConfigError, match="unknown model kind 'gpt'"):
        preset("tiny", kind="gpt")
    with pytest.raises(ConfigError, match="gamma must be >= 0"):
        preset("tiny", gamma=-1.0)
    with pytest.raises(ConfigError, match="tau must be >= 0"):
        preset("tiny", tau=-1)
    with pytest.raises(ConfigError, match="block_size 5 must divide seq_len 128"):
        preset("tiny", kind="bd3lm", block_size=5)


# ---------------------------------------------------------------- conventions of the references


def test_the_bos_position_counts_for_mdlm_and_adlm_but_not_for_bd3lm() -> None:
    """MDLM/ADLM score every non-pad position (the BOS too); BD3-LM's reference leaves position 0 out of
    training and evaluation; AR never has position 0 as a target. ``ignore_bos`` overrides the kind's rule."""
    x = torch.randint(0, V, (3, L), generator=gen(11))
    am = torch.ones_like(x)
    am[1, 20:] = 0
    real = int(am.sum())
    counts = {}
    for kind in ("mdlm", "adlm", "bd3lm", "ar"):
        cfg = micro(kind)
        model = randomized(cfg, std=0.1)
        counts[kind] = int(compute_loss(model, x, am, cfg, train=False, generator=gen(1)).n_tokens)
    assert counts == {"mdlm": real, "adlm": real, "bd3lm": real - 3, "ar": real - 3}
    cfg = micro("mdlm", ignore_bos=True)
    assert int(compute_loss(randomized(cfg), x, am, cfg, train=False, generator=gen(1)).n_tokens) == real - 3
    cfg = micro("bd3lm", ignore_bos=False)
    assert int(compute_loss(randomized(cfg), x, am, cfg, train=False, generator=gen(1)).n_tokens) == real


def test_the_ar_baseline_is_pre_layernorm_without_adaln() -> None:
    ar, mdlm = build_model(micro("ar")), build_model(micro("mdlm"))
    assert not any("adaLN" in n or "sigma_map" in n for n, _ in ar.named_parameters())
    assert any("adaLN" in n for n, _ in mdlm.named_parameters())
    # The same backbone otherwise: the parameter difference is exactly adaLN and the time embedder.
    extra = sum(p.numel() for n, p in mdlm.named_parameters() if "adaLN" in n or "sigma_map" in n)
    assert count_parameters(mdlm) - count_parameters(ar) == extra
    assert micro("ar", adaln=True).uses_adaln and not micro("ar").uses_adaln
