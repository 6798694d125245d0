"""The model kinds on the DiT backbone (docs/design/method.md, sections 1-3).

- ``MDLM``: one bidirectional DiT on token ids; its logits go through SUBS.
- ``ADLM``: an anchor DiT (``n_blocks``) on token ids whose raw logits feed, through a dense
  ``Linear(width -> hidden)``, a denoiser DiT (``denoiser_blocks``) whose logits go through SUBS.
  Trained jointly end to end. For inference the anchor output layer and the denoiser input layer
  collapse into one ``hidden x hidden`` affine map (``fused=True``): exact, and it removes two
  vocabulary-sized matmuls per token.
- ``AR``: the same backbone with causal attention and a next-token loss.
- ``A2R``: the anchored autoregressive model, ADLM's composition made causal: an anchor DiT (``n_blocks``,
  causal) whose raw logits feed, through a dense ``Linear(width -> hidden)``, a lightweight AR DiT
  (``denoiser_blocks``, causal) that predicts the next token. Every position's logits are a deterministic function
  of the tokens up to it, so the likelihood is exact. The same fused inference projection as ADLM's; sampling keeps
  both networks' keys and values in one ``KVCache``.

Every diffusion model exposes ``denoiser_logits(z_t, sigma)``, the logits before SUBS, and ``head(z_t, sigma)``,
the final hidden state and the output projection those logits are the affine map of (what the training losses
read: ``vocab_loss`` fuses the projection with the log-softmax).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import ModelConfig
from .backbone import DiT, KVCache


def config_dit(cfg: ModelConfig, n_blocks: int, **kw) -> DiT:
    """A DiT of ``n_blocks`` blocks at ``cfg``'s sizes (width, hidden, heads, conditioning, adaLN)."""
    return DiT(width=cfg.width, hidden=cfg.hidden, heads=cfg.heads, n_blocks=n_blocks, cond_dim=cfg.cond_dim,
               mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout, adaln=cfg.uses_adaln, **kw)



FusedCache = tuple[tuple, torch.Tensor, torch.Tensor] | None
"""``(key, weight, bias)`` of a fused affine map, the key naming the weights (storage, version, dtype, device)."""


def fused_affine(out: nn.Linear, inp: nn.Linear, cache: FusedCache) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """``inp(out(h))`` as one affine map, ``h (W_in W_out)^T + (W_in b_out + b_in)``, computed in float64 and
    cast back; ``cache`` is returned as it is while it was made from the same weights (an optimiser step bumps
    their version), else the map is computed anew."""
    tensors = (out.weight, out.bias, inp.weight, inp.bias)
    key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in tensors)
    if cache is not None and cache[0] == key:
        return cache
    with torch.no_grad():
        w = (inp.weight.double() @ out.weight.double()).to(out.weight.dtype)
        b = (inp.weight.double() @ out.bias.double() + inp.bias.double()).to(out.bias.dtype)
    return key, w, b

class MDLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = config_dit(cfg, cfg.n_blocks)

    def denoiser_logits(self, z_t: torch.Tensor, sigma: torch.Tensor, **kw) -> torch.Tensor:
        return self.backbone(z_t, sigma, **kw)

    forward = denoiser_logits

    def head(self, z_t: torch.Tensor, sigma: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.backbone.head(z_t, sigma, **kw)


class ADLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.anchor = config_dit(cfg, cfg.n_blocks)
        self.denoiser = config_dit(cfg, cfg.denoiser_blocks, input_mode="dense", input_width=cfg.width)
        if cfg.anchor_init_std > 0:  # drawn last: a zero start (the default) leaves every other draw as it was
            nn.init.normal_(self.anchor.output_layer.linear.weight, std=cfg.anchor_init_std)
        self._fused: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    def gradient_groups(self) -> dict[str, list[nn.Parameter]]:
        """The parameters whose gradient norms training logs apart: the anchor network, the denoiser, and the
        anchor's output layer (zero at initialisation by default: it learns through the denoiser's input layer and
        the anchor term only)."""
        return {"anchor": list(self.anchor.parameters()), "denoiser": list(self.denoiser.parameters()),
                "anchor_out": list(self.anchor.output_layer.linear.parameters())}

    def forward(self, z_t: torch.Tensor, sigma: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """Training path: (anchor logits y_phi(z_t), denoiser logits x_psi(y_phi(z_t)))."""
        anchor_logits, (h, w, b) = self.train_heads(z_t, sigma, **kw)
        return anchor_logits, torch.nn.functional.linear(h, w, b)

    def fused_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_f = W_in W_out (hidden x hidden) and b_f = W_in b_out + b_in, computed once per weights.

        (h W_out^T + b_out) W_in^T + b_in = h (W_in W_out)^T + (W_in b_out + b_in).
        """
        self._fused = fused_affine(self.anchor.output_layer.linear, self.denoiser.dense_in, self._fused)
        return self._fused[1], self._fused[2]

    def denoiser_logits(self, z_t: torch.Tensor, sigma: torch.Tensor, fused: bool | None = None, **kw) -> torch.Tensor:
        """Denoiser logits; ``fused`` (default: when not training) skips the anchor logits."""
        h, w, b = self.head(z_t, sigma, fused=fused, **kw)
        return torch.nn.functional.linear(h, w, b)

    def head(self, z_t: torch.Tensor, sigma: torch.Tensor, fused: bool | None = None, **kw
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The denoiser's final hidden state and output projection (``fused`` as ``denoiser_logits``)."""
        if fused is None:
            fused = not (self.training and torch.is_grad_enabled())
        if not fused:
            return self.train_heads(z_t, sigma, **kw)[1]
        w, b = self.fused_projection()
        h = self.anchor.trunk(self.anchor.embed(z_t), sigma, **kw)
        x = torch.nn.functional.linear(h, w, b)  # the denoiser's input layer is folded into (w, b)
        out = self.denoiser.output_layer.linear
        return self.denoiser.trunk(x, sigma, **kw), out.weight, out.bias

    def train_heads(self, z_t: torch.Tensor, sigma: torch.Tensor, **kw
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Training path: the anchor logits y_phi(z_t) (they feed the denoiser, so they exist) and the denoiser's
        final hidden state and output projection."""
        anchor_logits = self.anchor(z_t, sigma, **kw)
        return anchor_logits, self.denoiser.head(anchor_logits, sigma, **kw)


class AR(nn.Module):
    """The AR baseline of the references (MDLM, BD3-LM): the same backbone with causal attention and, by default
    (``ModelConfig.adaln``), pre-LayerNorm blocks without adaLN or a time embedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = config_dit(cfg, cfg.n_blocks, causal=True)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor | None = None, **kw) -> torch.Tensor:
        if sigma is None:
            sigma = torch.zeros(x.shape[0], device=x.device)
        return self.backbone(x, sigma, **kw)

    def head(self, x: torch.Tensor, sigma: torch.Tensor | None = None, **kw
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if sigma is None:
            sigma = torch.zeros(x.shape[0], device=x.device)
        return self.backbone.head(x, sigma, **kw)


class A2R(nn.Module):
    """The anchored autoregressive model (docs/design/method.md, section 3): ``anchor`` reads the tokens causally and
    returns raw logits y_phi (trained towards the anchor tokens ahead); ``lm``, the lightweight AR model, reads
    ``Linear(width -> hidden)(y_phi)`` (``projection``), plus its own token embedding with
    ``ModelConfig.ar_token_embedding``, causally and returns the next-token logits. Both causal, so position l sees
    tokens <= l only, through either network.

    A ``KVCache`` passed to ``forward`` or ``head`` holds the anchor's layers first, then the AR model's, and moves
    once per call: one pass of each network per new token.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.anchor = config_dit(cfg, cfg.n_blocks, causal=True)
        if cfg.ar_token_embedding:
            self.lm = config_dit(cfg, cfg.denoiser_blocks, causal=True)
            self.anchor_in = nn.Linear(cfg.width, cfg.hidden)
        else:  # ADLM's composition: the projected anchor logits are the AR model's whole input
            self.lm = config_dit(cfg, cfg.denoiser_blocks, causal=True, input_mode="dense", input_width=cfg.width)
        if cfg.anchor_init_std > 0:  # drawn last: a zero start (the default) leaves every other draw as it was
            nn.init.normal_(self.anchor.output_layer.linear.weight, std=cfg.anchor_init_std)
        self._fused: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    @property
    def projection(self) -> nn.Linear:
        """The dense ``Linear(width -> hidden)`` from the anchor logits into the AR model's input space."""
        return self.anchor_in if self.cfg.ar_token_embedding else self.lm.dense_in

    def gradient_groups(self) -> dict[str, list[nn.Parameter]]:
        """The parameters whose gradient norms training logs apart: the anchor network, the AR model (with the
        projection), and the anchor's output layer."""
        return {"anchor": list(self.anchor.parameters()),
                "ar": list(self.lm.parameters()) + (list(self.anchor_in.parameters()) if self.cfg.ar_token_embedding
                                                    else []),
                "anchor_out": list(self.anchor.output_layer.linear.parameters())}

    def fused_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The anchor's output layer followed by ``projection`` as one ``hidden x hidden`` affine map (exact, as
        ``ADLM.fused_projection``), computed once per weights."""
        self._fused = fused_affine(self.anchor.output_layer.linear, self.projection, self._fused)
        return self._fused[1], self._fused[2]

    def _lm_input(self, x: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        return self.lm.vocab_embed(x) + projected if self.cfg.ar_token_embedding else projected

    def _heads(self, x: torch.Tensor, fused: bool, *, cache: KVCache | None = None, cache_mode: str = "read",
               cache_append: int | None = None, **kw) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """(the anchor logits, None when ``fused``; the AR model's final hidden state and output projection)."""
        sigma = torch.zeros(x.shape[0], device=x.device)  # no adaLN by default: unused; else the learned constant
        # The anchor writes its keys and values at the cache's free positions without moving it; the AR model's
        # pass, at the same positions, moves it.
        anchor_cache = dict(cache=cache, cache_append=0) if cache is not None else {}
        lm_cache = dict(cache=cache, cache_mode=cache_mode, cache_append=cache_append,
                        cache_layer=len(self.anchor.blocks)) if cache is not None else {}
        h = self.anchor.trunk(self.anchor.embed(x), sigma, **anchor_cache, **kw)
        if fused:
            anchor_logits, projected = None, torch.nn.functional.linear(h, *self.fused_projection())
        else:
            anchor_logits = self.anchor.output_layer.linear(h)
            projected = self.projection(anchor_logits)
        out = self.lm.output_layer.linear
        return anchor_logits, (self.lm.trunk(self._lm_input(x, projected), sigma, **lm_cache, **kw), out.weight,
                               out.bias)

    def train_heads(self, x: torch.Tensor, **kw) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor]]:
        """Training path: the anchor logits y_phi(x) (the anchor loss reads them) and the AR model's head."""
        anchor_logits, head = self._heads(x, False, **kw)
        return anchor_logits, head

    def head(self, x: torch.Tensor, sigma: torch.Tensor | None = None, fused: bool | None = None, **kw
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The AR model's final hidden state and output projection; ``fused`` (default: when not training) skips the
        anchor logits. ``sigma`` is ignored (the blocks are not time-conditioned)."""
        if fused is None:
            fused = not (self.training and torch.is_grad_enabled())
        return self._heads(x, fused, **kw)[1]

    def forward(self, x: torch.Tensor, sigma: torch.Tensor | None = None, **kw) -> torch.Tensor:
        """Next-token logits (B, L, width): position l's are the model's distribution of x^{l+1}."""
        h, w, b = self.head(x, sigma, **kw)
        return torch.nn.functional.linear(h, w, b)

    def anchor_logits(self, x: torch.Tensor, **kw) -> torch.Tensor:
        """The anchor network's raw logits y_phi(x) (B, L, width)."""
        return self.anchor(x, torch.zeros(x.shape[0], device=x.device), **kw)
