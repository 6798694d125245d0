"""The ``transformers`` model of an exported ADLM-pipeline model (``AutoModelForMaskedLM`` of the export folder).

Shipped into the export folder (``adlm_model.interop.pretrained``) with ``configuration_adlm.py`` and copies of the
network's own modules (``config``, ``attention``, ``backbone``, ``models``, ``block_attention``): the network
``transformers`` runs is this package's, line for line, not a second implementation. ``transformers`` follows
the relative imports and copies them into its module cache; they import only ``torch``.

``AdlmForMaskedLM`` registers the network's children as its own, so its parameter names are the network's:
``model.safetensors`` is the file ``adlm_model.load_pretrained`` reads, loaded with no key missing or unexpected.

``forward(input_ids, timesteps=None)`` returns ``MaskedLMOutput(logits=...)``, the logits before SUBS
(docs/design/method.md, section 1; the reference Hub models return the same):

- MDLM, ADLM: ``(B, L, width)`` denoiser logits of ``z_t = input_ids`` (ADLM: the composed network
  ``psi(phi(z_t))``, fused in eval mode as ``adlm_model.nn.models.ADLM.denoiser_logits``);
- AR: ``(B, L, width)`` next-token logits under causal attention (``timesteps`` unused);
- BD3-LM: as its reference Hub model, ``input_ids`` is ``x_t ++ x_0`` (``(B, 2L)``, the training pass under the
  block-diffusion mask) and the logits are the ``x_t`` half's ``(B, L, width)``; with ``sample_mode=True`` it is
  one sequence ``(B, n)`` under the block-causal mask (the recomputed-prefix sampling pass).

``attention_mask`` may be passed (a tokenizer's) but must keep every position: the networks attend to all of
them, as the references' do. ``timesteps``: sigma(t) per row ``(B,)`` (or a scalar). With time conditioning off (the default,
``config.model["time_conditioning"]``) the network is conditioned on sigma = 0, a learned constant, whatever is
passed; on, ``timesteps`` is required.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from ..config import KIND_TABLE
from ..nn.backbone import Rotary
from ..nn.block_attention import block_causal_mask, block_diffusion_pass
from ..nn.models import A2R, ADLM, AR, MDLM
from .configuration_adlm import AdlmConfig

NETWORKS: dict[str, type[nn.Module]] = {"mdlm": MDLM, "adlm": ADLM, "ar": AR, "bd3lm": MDLM, "sedd": MDLM,
                                       "a2r": A2R}
"""The network of each kind, with the parameters of ``adlm_model.kinds.KINDS``'s (a test checks the names and
shapes agree); ``kinds`` itself pulls in the samplers and objectives, which the network does not need. SEDD's
score network is MDLM's DiT: its logits here are the raw output ``o`` (log-score = ``o - log(e^sigma - 1) -
log(V - 1)``, 0 at the input token: ``adlm_model/baselines/sedd.py``)."""


class AdlmForMaskedLM(PreTrainedModel):
    """An ADLM-pipeline network (MDLM, ADLM, AR or BD3-LM) as a ``transformers`` model (module docstring)."""

    config_class = AdlmConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _tied_weights_keys: dict[str, str] = {}
    _no_split_modules = ["DiTBlock"]

    def __init__(self, config: AdlmConfig) -> None:
        super().__init__(config)
        # transformers may import configuration_adlm and this module from two copies of the folder, each with its
        # own shipped ``config``: the kind's fields go into this copy's table too.
        if config.adlm_kind not in KIND_TABLE and config.kind_fields:
            KIND_TABLE[config.adlm_kind] = SimpleNamespace(**config.kind_fields)
        cfg = config.model_config()
        network = NETWORKS[cfg.kind](cfg)
        # The network's children become this model's: the parameter names are the network's own (the keys of
        # model.safetensors); the network object is kept unregistered, for its methods.
        for name, child in network.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "network", network)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # The network initialises itself; transformers builds the model on the meta device, so the one
        # non-persistent buffer (rotary inverse frequencies, never in the weights file) is computed again here.
        if isinstance(module, Rotary):
            module.inv_freq = Rotary(2 * module.inv_freq.shape[0]).inv_freq.to(module.inv_freq.device)
            module._cache.clear()

    def train(self, mode: bool = True) -> AdlmForMaskedLM:
        super().train(mode)
        self.network.training = mode  # ADLM's fused path follows the network's own flag
        return self

    def forward(self, input_ids: torch.LongTensor, timesteps: torch.Tensor | float | None = None,
                sample_mode: bool = False, attention_mask: torch.Tensor | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> MaskedLMOutput:
        cfg = self.network.cfg
        if attention_mask is not None and not bool(attention_mask.all()):
            # The networks attend to every position (as the references'): a padding mask cannot be honoured.
            raise ValueError("attention_mask hides positions, which these networks cannot do: pass rows without "
                             "padding (or pad with the tokenizer's pad id and ignore those logits)")
        sigma = self._sigma(input_ids, timesteps)
        kind = KIND_TABLE[cfg.kind]  # the kinds table, or the export's kind_fields (configuration_adlm)
        if kind.block_diffusion:
            net = self.network.backbone
            if sample_mode:
                mask = block_causal_mask(input_ids.shape[1], cfg.block_size, input_ids.device)
                logits = net(input_ids, sigma, mask=mask)
            else:
                if input_ids.shape[1] % 2:
                    raise ValueError(f"BD3-LM takes x_t ++ x_0 (an even length), got length {input_ids.shape[1]}; "
                                     "pass sample_mode=True for one sequence under the block-causal mask")
                z_t, x0 = input_ids.chunk(2, dim=1)
                logits = block_diffusion_pass(net, z_t, x0, sigma, cfg.block_size)
        elif not kind.diffusion:
            logits = self.network(input_ids)
        else:
            logits = self.network.denoiser_logits(input_ids, sigma)
        if return_dict is False:
            return (logits,)
        return MaskedLMOutput(logits=logits)

    def _sigma(self, input_ids: torch.Tensor, timesteps: torch.Tensor | float | None) -> torch.Tensor:
        batch, device = input_ids.shape[0], input_ids.device
        if not self.network.cfg.conditions_on_time:
            return torch.zeros(batch, device=device)
        if timesteps is None:
            raise ValueError("this model is time-conditioned: pass timesteps= (sigma(t) per row)")
        return torch.as_tensor(timesteps, dtype=torch.float32, device=device).expand(batch)


__all__ = ["NETWORKS", "AdlmForMaskedLM"]
