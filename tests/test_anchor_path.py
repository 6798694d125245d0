"""The anchor path is alive: on the testbed, where anchors exist by construction, training ADLM with gamma > 0
teaches its anchor network to predict the anchor tokens (docs/design/method.md, section 2), and gamma = 0 does not. A bug that
made the anchor term inert (a detached term, a zero mask, gamma lost on the way) fails here; a study's null result
cannot tell it apart from "anchoring does not help"."""

from __future__ import annotations

import torch

from adlm_model import preset
from adlm_model.kinds import build_model, compute_loss
from adlm_model.losses import anchor_mask
from adlm_model.schedule import mask_tokens
from adlm_model.testbed import MASK_ID, Testbed, TestbedConfig

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
