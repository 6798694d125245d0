"""The anchor: a GPT-2-small-shaped transformer (pre-LN, fused qkv, SDPA, tied embeddings, bidirectional),
the plain network every kind's training throughput is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from adlm_model.config import ModelConfig
from adlm_model.objectives.losses import LossOutput

from .context import (
    Ctx,
)

# --------------------------------------------------------------------------------------------
# The anchor: a plain transformer


@dataclass(frozen=True)
class AnchorConfig:
    vocab_size: int
    seq_len: int
    hidden: int
    heads: int
    n_blocks: int
    mask_id: int = -1
    """No mask token (``random_rows`` replaces none)."""


class AnchorBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class AnchorTransformer(nn.Module):
    """GPT-2-small-shaped (at the kinds' hidden size, heads and blocks), bidirectional, tied embeddings."""

    def __init__(self, cfg: AnchorConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.hidden), nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(AnchorBlock(cfg.hidden, cfg.heads) for _ in range(cfg.n_blocks))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks:
            h = blk(h)
        return F.linear(self.ln_f(h), self.wte.weight)


class AnchorObjective(nn.Module):
    """The anchor's loss as ``TrainStep`` runs it: full-vocabulary cross-entropy of the next token, float32."""

    def __init__(self, cfg: AnchorConfig) -> None:
        super().__init__()
        self.cfg, self.seq_len = cfg, cfg.seq_len
        self.model = AnchorTransformer(cfg)

    def draw(self, x: torch.Tensor, attention_mask: torch.Tensor | None, generator: torch.Generator | None,
             train: bool) -> None:
        return None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None, noise: None, step: torch.Tensor,
                train: bool) -> LossOutput:
        logits = self.model(x).float()
        nll = F.cross_entropy(logits.view(-1, logits.shape[-1]), x.roll(-1, 1).reshape(-1), reduction="sum")
        n = torch.tensor(x.numel(), device=x.device)
        return LossOutput(loss=nll / n, nll_sum=nll.detach().double(), n_tokens=n)


def anchor_config(ctx: Ctx, cfg: ModelConfig) -> AnchorConfig:
    """The anchor at a kind's length, width, heads and depth (the paper's ``small``: 12 x 768), GPT-2's vocabulary."""
    return AnchorConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, hidden=cfg.hidden, heads=cfg.heads,
                        n_blocks=cfg.n_blocks)
