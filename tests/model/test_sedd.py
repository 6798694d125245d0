"""SEDD (adlm_model/baselines/sedd.py): equal to the reference's scores, loss and predictor steps on a committed fixture; its bound
with the exact score on the testbed is the exact NLL (and above it when the score is off); its samplers with the exact
score draw the language."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adlm_model import ModelConfig, build_model, compute_loss, sample
from adlm_model.baselines.sedd import expm1_sigma, jump_weights, rate_sigma, sedd_objective, sedd_step
from adlm_model.config import ConfigError
from adlm_model.interop.sedd_layout import sedd_from_reference
from adlm_model.objectives.losses import mdlm_objective
from adlm_model.objectives.schedule import LogLinearSchedule
from adlm_model.testbed.language import MASK_ID, OracleDenoiser, Testbed, TestbedConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "reference" / "sedd"


@pytest.fixture(scope="module")
def reference() -> tuple[torch.nn.Module, ModelConfig, dict[str, torch.Tensor]]:
    prov = json.loads((FIXTURE / "provenance.json").read_text())
    cfg, state = sedd_from_reference(load_file(FIXTURE / "weights.safetensors"), prov["config"])
    model = build_model(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg, load_file(FIXTURE / "outputs.safetensors")


def test_scores_and_loss_equal_the_reference(reference):
    model, cfg, ref = reference
    sigma = LogLinearSchedule(cfg.noise_eps).sigma(ref["t"])
    with torch.no_grad():
        log_score = model.log_score(ref["z_t"], sigma)
        out = sedd_objective(model, ref["x"], None, cfg, t=ref["t"], z_t=ref["z_t"])
    torch.testing.assert_close(log_score, ref["log_score"], rtol=1e-5, atol=1e-5)
    # The reference returns each row's sum over positions; ours pools the rows (nats over all tokens).
    assert out.n_tokens == ref["x"].numel()
    torch.testing.assert_close(out.nll_sum.float(), ref["loss"].sum(), rtol=1e-5, atol=1e-4)
    assert (ref["z_t"] == cfg.mask_id).any() and (ref["z_t"] != cfg.mask_id).any()  # both kinds of position


def test_predictor_steps_equal_the_reference(reference):
    """Our jump weights (Euler, analytic) and the denoiser's are the reference's transition weights, at the masked
    positions (unmasked ones never move in either)."""
    model, cfg, ref = reference
    s = LogLinearSchedule(cfg.noise_eps)
    t, dt, z = ref["t"].double(), float(ref["dt"]), ref["z_t"]
    with torch.no_grad():
        score = model.log_score(z, s.sigma(t).float()).exp()
    masked = z == cfg.mask_id
    euler = jump_weights(score, z, cfg.mask_id, dt * rate_sigma(s, t), 1.0)
    analytic = jump_weights(score, z, cfg.mask_id, torch.expm1(s.sigma(t) - s.sigma(t - dt)), 1.0)
    # Our stay weight is clamped at 0: the reference's Gumbel argmax never picks a negative weight either, so the
    # draws agree (the fixture has one such position, at t = 0.95 where dt dsigma is large).
    assert (ref["euler"] < 0).any()
    torch.testing.assert_close(euler[masked].float(), ref["euler"][masked].clamp_min(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(analytic[masked].float(), ref["analytic"][masked].clamp_min(0), rtol=1e-4, atol=1e-6)
    den = score.index_fill(-1, torch.tensor([cfg.mask_id]), 0.0)[..., :-1] * expm1_sigma(s.sigma(t).float())[:, None, None]
    torch.testing.assert_close(den[masked], ref["denoise"][masked], rtol=1e-4, atol=1e-6)


def test_reference_layout_is_checked():
    prov = json.loads((FIXTURE / "provenance.json").read_text())
    state = load_file(FIXTURE / "weights.safetensors")
    with pytest.raises(ConfigError, match="uniform"):
        sedd_from_reference(state, {**prov["config"], "graph": {"type": "uniform"}})
    with pytest.raises(ConfigError, match="missing 'tokens'"):
        sedd_from_reference(state, {k: v for k, v in prov["config"].items() if k != "tokens"})
    with pytest.raises(ConfigError, match="shapes differ"):
        sedd_from_reference(state, {**prov["config"], "tokens": 60})
    # DDP's prefix (a local run's checkpoint) maps the same
    cfg, mapped = sedd_from_reference({"module." + k: v for k, v in state.items()}, prov["config"])
    assert cfg.kind == "sedd" and cfg.conditions_on_time and cfg.width == 51 and len(mapped) == len(state) - 1
    assert sedd_from_reference(state, {"config": prov["config"]})[0] == cfg  # config.json nesting its init argument


class ExactScore(torch.nn.Module):
    """The exact concrete score of the testbed: ``log s_y = log p(x^l = y | z_t) - log(e^sigma - 1)``, times ``scale``
    (1: exact; otherwise a score whose implied denoiser is right but whose total rate is off). ``logp``: the
    conditionals already computed for the ``z`` it will be called with (the oracle is the slow part)."""

    def __init__(self, tb: Testbed, scale: float = 1.0, logp: torch.Tensor | None = None) -> None:
        super().__init__()
        self.oracle, self.scale, self.logp = OracleDenoiser(tb), scale, logp
        self.p = torch.nn.Parameter(torch.zeros(1))  # so that ``sample`` finds the device

    def denoiser_logits(self, z: torch.Tensor, sigma: torch.Tensor | None = None) -> torch.Tensor:
        return self.oracle(z) if self.logp is None else self.logp

    def log_score(self, z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        s = self.denoiser_logits(z) - expm1_sigma(sigma.float()).log()[:, None, None] + math.log(self.scale)
        return s.scatter(-1, z[..., None], 0.0)


def test_exact_score_bound_is_the_exact_nll_and_a_wrong_rate_is_above():
    """With the exact score SEDD's bound is MDLM's NELBO with the exact denoiser draw for draw, whose expectation is
    the exact NLL; a score off by a factor pays ``(1/t) (Z - 1 - log Z)`` per masked token on top."""
    tb = Testbed(TestbedConfig(length=10, content_vocab=6, n_classes=3, n_states=3, seed=6))
    cfg = ModelConfig(kind="sedd", vocab_size=tb.vocab_size, mask_id=MASK_ID, seq_len=tb.length, hidden=8, heads=2)
    x = tb.sample(1, seed=1).expand(256, -1).contiguous()
    exact = -float(tb.log_prob(x[:1]))
    g = torch.Generator().manual_seed(0)
    means, off = [], []
    for _ in range(6):
        t = torch.rand(256, generator=g) * (1 - 1e-3) + 1e-3
        z = torch.where(torch.rand(x.shape, generator=g) < t[:, None] * (1 - 1e-3), MASK_ID, x)
        exact_score = ExactScore(tb, logp=OracleDenoiser(tb)(z))
        bound = float(sedd_objective(exact_score, x, None, cfg, t=t, z_t=z).nll_sum)
        nelbo = float(mdlm_objective(exact_score, x, None, cfg.replace(kind="mdlm"), t=t, z_t=z).nll_sum)
        assert abs(bound - nelbo) < 1e-3 * abs(nelbo) + 1e-3, (bound, nelbo)
        means.append(bound / 256)
        off.append(float(sedd_objective(ExactScore(tb, 2.0, exact_score.logp), x, None, cfg, t=t, z_t=z).nll_sum) / 256)
    m = torch.tensor(means)
    se = float(m.std()) / math.sqrt(len(m))
    assert abs(float(m.mean()) - exact) < 4 * se + 0.01 * exact, (float(m.mean()), exact, se)
    # Z = 2: 1 - log 2 > 0 nats per masked token, weighted by 1/t: E = (L - 0) (1 - log 2) (1 - eps) per row
    gap = float(torch.tensor(off).mean() - m.mean())
    assert abs(gap - tb.length * (1 - math.log(2)) * (1 - 1e-3)) < 0.05 * gap, gap


@pytest.mark.parametrize("sampler", ["sedd-euler", "sedd-analytic"])
def test_exact_score_samples_draw_the_language(sampler):
    """Both predictors with the exact score: the samples' true NLL is near the language's entropy per row (a wrong
    step rule, e.g. a missing dsigma or e^d - 1, unmasks at the wrong rate and inflates it, or leaves masks)."""
    tb = Testbed(TestbedConfig(length=10, content_vocab=6, n_classes=3, n_states=3, seed=6, entropy_rows=2000))
    cfg = ModelConfig(kind="sedd", vocab_size=tb.vocab_size, mask_id=MASK_ID, seq_len=tb.length, hidden=8, heads=2)
    stats: dict = {}
    rows = sample(ExactScore(tb), cfg, batch_size=96, length=tb.length, steps=8, sampler=sampler,
                  generator=torch.Generator().manual_seed(1), stats=stats)
    assert not (rows == MASK_ID).any()
    nll = -tb.log_prob(rows)
    assert torch.isfinite(nll).all()
    ent = tb.entropy_per_row()
    se = float(nll.std()) / math.sqrt(len(nll))
    assert abs(float(nll.mean()) - ent.mean) < 4 * se + 0.05 * ent.mean, (float(nll.mean()), ent.mean, se)
    assert 1 <= stats["network_calls"] <= 9


def test_the_kind_trains_and_samples_with_prefix():
    cfg = ModelConfig(kind="sedd", vocab_size=40, mask_id=40, seq_len=12, hidden=16, heads=2, n_blocks=1, cond_dim=8)
    assert cfg.conditions_on_time and not cfg.replace(time_conditioning=False).conditions_on_time
    assert not ModelConfig(kind="mdlm").conditions_on_time
    model = build_model(cfg)
    x = torch.randint(0, 40, (4, 12))
    out = compute_loss(model, x, None, cfg, generator=torch.Generator().manual_seed(0))
    # o = 0 at init: the score spreads evenly, so the bound is log(V) per token in expectation
    assert 0.5 * math.log(40) < float(out.nll_sum / out.n_tokens) < 2 * math.log(40)
    out.loss.backward()
    assert model.backbone.vocab_embed.weight.grad is not None
    prefix = torch.tensor([5, 6, 7])
    for sampler in ("sedd-euler", "sedd-analytic"):
        y = sample(model, cfg, batch_size=2, length=12, steps=4, sampler=sampler, nucleus_p=0.9,
                   generator=torch.Generator().manual_seed(0), prefix=prefix)
        assert (y[:, :3] == prefix).all() and not (y == 40).any()
    mdlm = build_model(cfg.replace(kind="mdlm"))
    with pytest.raises(ValueError, match="sedd-\\* samplers run SEDD models only"):
        sample(mdlm, cfg, batch_size=1, length=12, steps=2, sampler="sedd-euler", generator=torch.Generator())


def test_analytic_step_with_the_exact_score_is_the_reverse_process():
    """Tweedie tau-leaping is exact for the absorbing graph: with ``s = p / (e^sigma - 1)`` a masked position stays
    masked with MDLM's ``s / t`` and otherwise takes ``y`` with ``p_y``; Euler is its first order in ``dt``."""
    sch = LogLinearSchedule(1e-3)
    p = torch.softmax(torch.randn(3, 5, 9, generator=torch.Generator().manual_seed(0)), -1).index_fill(-1, torch.tensor([8]), 0.0)
    p = p / p.sum(-1, keepdim=True)
    z = torch.full((3, 5), 8)
    t, dt = torch.tensor([0.9, 0.5, 0.1], dtype=torch.float64), 1e-3
    score = p / expm1_sigma(sch.sigma(t))[:, None, None]
    w = jump_weights(score, z, 8, torch.expm1(sch.sigma(t) - sch.sigma(t - dt)), 1.0)
    stay = (t - dt) / t
    torch.testing.assert_close(w[..., 8], stay[:, None].expand(3, 5), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w[..., :8], p[..., :8].double() * (1 - stay)[:, None, None], rtol=1e-9, atol=1e-12)
    e = jump_weights(score, z, 8, dt * rate_sigma(sch, t), 1.0)
    torch.testing.assert_close(e[..., 8], w[..., 8], rtol=0, atol=5 * dt ** 2 / 0.1 ** 2)


def test_continuation_likelihood_reads_the_score_entropy():
    """The lm-eval adapter's per-token term for SEDD (likelihood.model_nll_fn): with the exact score it is the exact
    -log p(x^l | z) at every masked position, whatever sigma the masked fraction gives; a score whose total rate is
    off pays Z - 1 - log Z on top. Its greedy log-probabilities are the normalised score."""
    from adlm_model.inference.likelihood import model_logp_fn, model_nll_fn

    tb = Testbed(TestbedConfig(length=10, content_vocab=6, n_classes=3, n_states=3, seed=6))
    cfg = ModelConfig(kind="sedd", vocab_size=tb.vocab_size, mask_id=MASK_ID, seq_len=tb.length, hidden=8, heads=2)
    x = tb.sample(4, seed=2)
    z = x.clone()
    z[0, 3:] = MASK_ID
    z[1, 5] = MASK_ID
    z[2, 1:] = MASK_ID
    z[3] = MASK_ID
    logp = OracleDenoiser(tb)(z)
    exact = -logp.gather(-1, x[..., None]).squeeze(-1)
    m = z == MASK_ID
    got = model_nll_fn(ExactScore(tb, logp=logp), cfg)(z, x)
    torch.testing.assert_close(got[m], exact[m], rtol=1e-4, atol=1e-4)
    off = model_nll_fn(ExactScore(tb, 2.0, logp), cfg)(z, x)
    torch.testing.assert_close(off[m] - got[m], torch.full_like(got[m], 1 - math.log(2)), rtol=1e-4, atol=1e-4)
    greedy = model_logp_fn(ExactScore(tb, 2.0, logp), cfg)(z, x)
    torch.testing.assert_close(greedy[m], logp.float()[m].index_fill(-1, torch.tensor([MASK_ID]), float("-inf")))


def test_the_two_stage_draw_has_the_law_of_the_written_out_weights():
    """``sedd_step`` (jump or not, then which token) draws ``jump_weights``' distribution, the clamp at 0 included
    (position 1 below: its total jump weight exceeds 1), and never moves an unmasked position."""
    n = 20000
    score = torch.tensor([[[0.5, 1.0, 0.0, 2.0, 0.5], [3.0, 1.0, 7.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]]])
    x = torch.tensor([[4, 4, 1]])
    move = torch.tensor([0.1])
    w = jump_weights(score, x, 4, move, 1.0)[0]
    p = w / w.sum(-1, keepdim=True)
    got = sedd_step(score.expand(n, -1, -1), x.expand(n, -1), 4, move.expand(n), 1.0,
                    torch.Generator().manual_seed(0))
    assert (got[:, 2] == 1).all()
    for pos in (0, 1):
        freq = torch.bincount(got[:, pos], minlength=5).double() / n
        se = (p[pos] * (1 - p[pos]) / n).sqrt()
        assert ((freq - p[pos]).abs() <= 4 * se + 1e-12).all(), (pos, freq, p[pos])
    assert p[1, 4] == 0 and p[0, 4] > 0.5  # the clamp is exercised; position 0 mostly stays masked
    final = sedd_step(score, x, 4, torch.tensor([math.inf]), 1.0, torch.Generator().manual_seed(0))
    assert not (final == 4).any()
