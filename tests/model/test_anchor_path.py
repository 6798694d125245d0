"""The anchor path is alive: on the testbed, where anchors exist by construction, training ADLM with gamma > 0
teaches its anchor network to predict the anchor tokens (docs/design/method.md, section 2), and gamma = 0 does not. A bug that
made the anchor term inert (a detached term, a zero mask, gamma lost on the way) fails here; a study's null result
cannot tell it apart from "anchoring does not help"."""

from __future__ import annotations

import torch

from adlm_model import preset
from adlm_model.kinds import build_model, compute_loss
from adlm_model.objectives.losses import anchor_mask
from adlm_model.objectives.schedule import mask_tokens
from adlm_model.testbed.language import MASK_ID, Testbed, TestbedConfig

STEPS = 150


def _anchor_accuracy(gamma: float, tb: Testbed, val: torch.Tensor) -> float:
    cfg = preset("tiny", kind="adlm", vocab_size=tb.vocab_size, mask_id=MASK_ID, seq_len=tb.length, hidden=32,
                 heads=2, n_blocks=1, denoiser_blocks=1, cond_dim=16, dropout=0.0, gamma=gamma, tau=tb.config.tau,
                 gamma_horizon=0)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        out = compute_loss(model, tb.sample(16, seed=step), None, cfg, step=step, train=True, generator=g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        z, _ = mask_tokens(val, torch.full((val.shape[0], 1), 0.3), MASK_ID, torch.Generator().manual_seed(1))
        anchor_logits, _ = model(z, torch.zeros(val.shape[0]))
        a = anchor_mask(val, None, cfg.tau, cfg.width)
        return float((anchor_logits.argmax(-1) == val)[a].float().mean())


def test_gamma_teaches_the_anchor_network_the_anchor_tokens(one_torch_thread):
    tb = Testbed(TestbedConfig(length=16, seed=0))
    val = tb.sample(256, seed=10_000)
    on, off = _anchor_accuracy(1.0, tb, val), _anchor_accuracy(0.0, tb, val)
    assert on > 0.5 and on > off + 0.3, (on, off)


def test_the_anchor_output_layer_starts_at_zero_or_small_random_as_the_recipe_says(one_torch_thread):
    """``model.anchor_init_std``: 0 (the paper's) gives all-zero anchor logits at initialisation, so the denoiser's
    input is one vector at every position; a small random start gives the anchor logits spread, and the anchor
    trunk a gradient through the anchor term from the first step. Every other weight is drawn as before."""
    tb = Testbed(TestbedConfig(length=16, seed=0))
    x = tb.sample(8, seed=0)

    def start(std: float) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, float]:
        cfg = preset("tiny", kind="adlm", vocab_size=tb.vocab_size, mask_id=MASK_ID, seq_len=tb.length, hidden=32,
                     heads=2, n_blocks=1, denoiser_blocks=1, cond_dim=16, dropout=0.0, anchor_init_std=std)
        torch.manual_seed(0)
        model = build_model(cfg)
        with torch.no_grad():
            logits, _ = model(x, torch.zeros(x.shape[0]))
            denoiser_in = model.denoiser.dense_in(logits)
        out = compute_loss(model, x, None, cfg, step=0, train=True, generator=torch.Generator().manual_seed(0))
        out.loss.backward()
        trunk = [p for n, p in model.anchor.named_parameters() if not n.startswith("output_layer.")]
        g = sum(float(p.grad.norm() ** 2) for p in trunk if p.grad is not None) ** 0.5
        return model, logits, denoiser_in, g

    zero, zero_logits, zero_in, zero_grad = start(0.0)
    rand, rand_logits, rand_in, rand_grad = start(0.02)
    assert float(zero_logits.abs().max()) == 0.0 and zero_grad == 0.0
    assert torch.equal(zero_in, zero_in[:1, :1].expand_as(zero_in))  # the same input at every position
    assert float(rand_logits.std()) > 1e-3 and float((rand_in - rand_in[:1, :1]).abs().max()) > 0 and rand_grad > 0
    w = rand.anchor.output_layer.linear.weight
    assert 0.015 < float(w.std()) < 0.025 and float(rand.anchor.output_layer.linear.bias.abs().max()) == 0.0
    params = dict(rand.named_parameters())
    differ = {n for n, p in zero.named_parameters() if not torch.equal(p, params[n])}
    assert differ == {"anchor.output_layer.linear.weight"}
