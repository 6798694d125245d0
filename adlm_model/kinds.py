"""The model kinds and the samplers, each in one table: what ``build_model``, ``compute_loss`` and
``sample`` read (docs/design/method.md, sections 1-4).

Adding a model kind is one ``ModelKind`` entry here (its network, its training objective, its
evaluation bound and its default sampler) plus its name in ``config.MODEL_KINDS``; adding a sampler is
one ``SAMPLERS`` entry. This module sits on top of the others (``losses``, ``samplers``, ``bd3lm``,
``models``) and nothing below imports it, so the kinds never form an import circle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .baselines.bd3lm import bd3lm_objective, sample_blocks
from .baselines.sedd import SEDD, sedd_objective, sedd_sample
from .baselines.ssdlm import OPTIONS as SSDLM_OPTIONS
from .baselines.ssdlm import SSDLM, network_calls, ssd_sample
from .config import KIND_TABLE, MODEL_KINDS, ModelConfig
from .nn.models import A2R, ADLM, AR, MDLM
from .objectives.losses import LossOutput, a2r_objective, adlm_objective, ar_objective, mdlm_objective
from .sampling.ar_sampling import ar_sample, ar_window_sample
from .sampling.confidence import OPTIONS as CONFIDENCE_OPTIONS
from .sampling.confidence import check_options as check_confidence_options
from .sampling.confidence import confidence_sample
from .sampling.samplers import (
    Progress,
    ReMDMLoop,
    SamplerError,
    check_sample_args,
    diffusion_sample,
    reject_unknown,
    resolve_prefix,
)

Objective = Callable[..., LossOutput]
"""``(model, x, attention_mask, cfg, *, step, t, generator, z_t) -> LossOutput``; ``t`` with ``z_t``: the noise drawn
by the caller (``train_step``), none drawn here."""


@dataclass(frozen=True)
class ModelKind:
    """One model kind of ``ModelConfig.kind``."""

    name: str
    network: Callable[[ModelConfig], nn.Module]
    """Builds the network from its config."""
    train_objective: Objective
    """The loss training backpropagates (ADLM: the ANELBO with its anchor term)."""
    eval_objective: Objective
    """The bound evaluation reports (ADLM: the pure denoiser NELBO, docs/design/method.md, section 2)."""
    default_sampler: str
    """The sampler evaluation and generation use unless told otherwise."""
    anchored: bool = False
    """Has the anchor loss (gamma, tau are meaningful: tags, sweeps)."""
    diffusion: bool = True
    """A masked-diffusion model: its perplexity is an upper bound, it can infill."""
    clipped_schedule: bool = False
    """Trains on a data-driven clipped masking schedule, searched at each validation (BD3-LM, docs/design/method.md
    section 3); evaluation stays on the full schedule."""
    adaln: bool = True
    """The reference's blocks are adaLN-conditioned (``ModelConfig.adaln`` None reads it); the AR baseline's are
    plain pre-LayerNorm blocks."""
    skips_bos: bool = False
    """The reference leaves the BOS position out of the loss and the bound (``ModelConfig.ignore_bos`` None)."""
    time_conditioned: bool = False
    """The reference's network sees sigma(t) (``ModelConfig.time_conditioning`` None): SEDD's DiT does."""
    block_diffusion: bool = False
    """Runs block by block (``ModelConfig.block_size`` applies: block-diffusion attention in the bound and the
    continuation likelihood, the block sampler generates any length): BD3-LM."""
    distillable: bool = False
    """SDTT can distil its ancestral sampler (``adlm_model.train.distill``: masked diffusion over the whole row)."""
    sample_only: str = ""
    """Non-empty: the kind is imported and sampled, never trained, and has no likelihood here; the line says so
    (training, tuning, studies and distillation refuse the kind with it, and so do the likelihood suites)."""
    samplers: tuple[str, ...] = ()
    """The only samplers that run on it (empty: every sampler of its ``diffusion`` flag that names no kinds)."""
    bos_before_prompt: bool = True
    """Generation puts BOS before a prompt, as every training row starts with it. False: the reference conditions
    on the prompt alone and starts from BOS only when given no prompt (SSD-LM's decoders)."""
    prompt_space: bool = False
    """A prompt that does not start with a space is encoded after one, as the reference does (SSD-LM's decoders:
    a byte-level BPE reads the first word of a text as another token than the same word after a space)."""


Mask = torch.Tensor | None
Gen = torch.Generator | None


class SampleOnlyError(ValueError):
    """A likelihood or a training step asked of a sample-only kind (``ModelKind.sample_only`` says why)."""


def _mdlm(model: nn.Module, x: torch.Tensor, am: Mask, cfg: ModelConfig, *, step: int = 0,
          t: torch.Tensor | None = None, generator: Gen = None, z_t: torch.Tensor | None = None) -> LossOutput:
    return mdlm_objective(model, x, am, cfg, t=t, z_t=z_t, generator=generator)


def _adlm_train(model: nn.Module, x: torch.Tensor, am: Mask, cfg: ModelConfig, *, step: int = 0,
                t: torch.Tensor | None = None, generator: Gen = None, z_t: torch.Tensor | None = None) -> LossOutput:
    return adlm_objective(model, x, am, cfg, step=step, t=t, z_t=z_t, generator=generator)


def _ar(model: nn.Module, x: torch.Tensor, am: Mask, cfg: ModelConfig, *, step: int = 0,
        t: torch.Tensor | None = None, generator: Gen = None, z_t: torch.Tensor | None = None) -> LossOutput:
    return ar_objective(model, x, am, cfg)


def _a2r_train(model: nn.Module, x: torch.Tensor, am: Mask, cfg: ModelConfig, *, step: int = 0,
               t: torch.Tensor | None = None, generator: Gen = None, z_t: torch.Tensor | None = None) -> LossOutput:
    return a2r_objective(model, x, am, cfg, step=step)


def _sedd(model: nn.Module, x: torch.Tensor, am: Mask, cfg: ModelConfig, *, step: int = 0,
          t: torch.Tensor | None = None, generator: Gen = None, z_t: torch.Tensor | None = None) -> LossOutput:
    return sedd_objective(model, x, am, cfg, t=t, z_t=z_t, generator=generator)


def _bd3lm_train(model: nn.Module, x: torch.Tensor, am: Mask, cfg: ModelConfig, *, step: int = 0,
                 t: torch.Tensor | None = None, generator: Gen = None, z_t: torch.Tensor | None = None) -> LossOutput:
    return bd3lm_objective(model, x, am, cfg, t=t, z_t=z_t, generator=generator, train=True)


def _bd3lm_eval(model: nn.Module, x: torch.Tensor, am: Mask, cfg: ModelConfig, *, step: int = 0,
                t: torch.Tensor | None = None, generator: Gen = None, z_t: torch.Tensor | None = None) -> LossOutput:
    return bd3lm_objective(model, x, am, cfg, t=t, z_t=z_t, generator=generator, train=False)


def _sample_only(model: nn.Module, x: torch.Tensor, am: Mask, cfg: ModelConfig, *, step: int = 0,
                 t: torch.Tensor | None = None, generator: Gen = None) -> LossOutput:
    raise SampleOnlyError(f"model kind {cfg.kind}: {KINDS[cfg.kind].sample_only}")


KINDS: dict[str, ModelKind] = {k.name: k for k in (
    ModelKind("mdlm", MDLM, _mdlm, _mdlm, "remdm-loop", distillable=True),
    # Evaluation of ADLM runs the denoiser NELBO through the same network (MDLM's objective reads
    # model.denoiser_logits, which ADLM composes as psi(phi(z_t))).
    ModelKind("adlm", ADLM, _adlm_train, _mdlm, "remdm-loop", anchored=True, distillable=True),
    ModelKind("ar", AR, _ar, _ar, "ar", diffusion=False, adaln=False),
    # BD3-LM shares MDLM's network; it differs in attention masks, objective and sampler.
    ModelKind("bd3lm", MDLM, _bd3lm_train, _bd3lm_eval, "bd3lm", clipped_schedule=True, skips_bos=True,
              block_diffusion=True),
    # SEDD: the same DiT, time-conditioned, read as a score; its loss (the score entropy) is its bound too.
    ModelKind("sedd", SEDD, _sedd, _sedd, "sedd-analytic", time_conditioned=True),
    # SSD-LM: the released RoBERTa simplex-diffusion network (baselines/ssdlm.py), sampled block by block; no
    # training, no likelihood (Gaussian diffusion on the logit simplex has no bound here), its own sampler only.
    ModelKind("ssdlm", SSDLM, _sample_only, _sample_only, "ssdlm", adaln=False, samplers=("ssdlm",),
              bos_before_prompt=False, prompt_space=True,
              sample_only="training SSD-LM is out of scope (sample-only: import the released model with python -m "
                          "pipelines.import_model xhan77/ssdlm, then generate or evaluate its samples)"),
    # A2R: a causal anchor network feeding a lightweight AR model (nn/models.py); trained with the next-token NLL
    # plus the anchor term, evaluated with the exact NLL of the composed network (AR's objective on its head), sampled
    # by the AR samplers with one KV cache through both networks.
    ModelKind("a2r", A2R, _a2r_train, _ar, "ar", anchored=True, diffusion=False, adaln=False),
)}
assert tuple(KINDS) == MODEL_KINDS, "config.MODEL_KINDS and the KINDS table must list the same kinds"
KIND_TABLE.update(KINDS)  # ModelConfig's per-kind defaults read the table through config (no import circle)


def model_kind(name: str) -> ModelKind:
    if name not in KINDS:
        raise SamplerError(f"unknown model kind {name!r}: use one of {', '.join(KINDS)}")
    return KINDS[name]


def build_model(cfg: ModelConfig) -> nn.Module:
    """The network for ``cfg.kind``."""
    cfg.validate()
    return KINDS[cfg.kind].network(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of ``cfg``'s network, counted without allocating it (built on the meta device)."""
    with torch.device("meta"):
        return count_parameters(build_model(cfg))


def compute_loss(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig, *,
                 step: int | torch.Tensor = 0, train: bool = True, generator: torch.Generator | None = None,
                 t: torch.Tensor | None = None, z_t: torch.Tensor | None = None) -> LossOutput:
    """The training loss (``train=True``) or the evaluation bound (``train=False``) for ``cfg.kind``; ``t`` and
    ``z_t`` given: that noise (``train_step.draw_noise``), nothing drawn."""
    kind = KINDS[cfg.kind]
    fn = kind.train_objective if train else kind.eval_objective
    if z_t is None:  # the objectives of kinds that draw no noise (AR) take no z_t either
        return fn(model, x, attention_mask, cfg, step=step, t=t, generator=generator)
    return fn(model, x, attention_mask, cfg, step=step, t=t, generator=generator, z_t=z_t)


# --------------------------------------------------------------------------------------------
# Samplers


@dataclass(frozen=True)
class Sampler:
    """One sampler of ``sample``: a runner and the options it takes (``sampler_kwargs``)."""

    name: str
    run: Callable[..., torch.Tensor]
    """``(model, cfg, tokens, keep, *, steps, nucleus_p, generator, progress, cache, stats, **options)``."""
    options: tuple[str, ...] = ()
    diffusion: bool = True
    """Works on a diffusion network (False: AR)."""
    any_length: bool = False
    """Generates beyond the model's training length (block by block with a sliding window)."""
    steps: bool = True
    """Runs the ``steps`` of a diffusion grid (False: its iterations are its own, one per token for ``ar``, until
    every position is decided for ``confidence``; what it reports as steps is the network calls it made)."""
    kinds: tuple[str, ...] = ()
    """The model kinds it runs on (empty: every kind of its ``diffusion`` flag that names no samplers of its own);
    ``samplers_for`` lists a kind's."""
    calls: Callable[[int, int, dict], int] | None = None
    """``(new tokens, steps, options) ->`` the forward passes it makes at most, each over at most the model's context
    (what a served request is bounded by); None: ``textgen``'s default bound."""


def _remdm(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *,
           stats: dict | None = None, **kw: Any) -> torch.Tensor:
    opts = {k: kw.pop(k) for k in ("eta", "t_on", "t_off", "alpha_on") if k in kw}
    return diffusion_sample(model, cfg, tokens, keep, sampler="remdm-loop", remdm=ReMDMLoop(**opts).validate(),
                            stats=stats, **kw)


def _mdlm_sampler(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *,
                  stats: dict | None = None, **kw: Any) -> torch.Tensor:
    return diffusion_sample(model, cfg, tokens, keep, sampler="mdlm", stats=stats, **kw)


def _confidence_sampler(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor,
                        **kw: Any) -> torch.Tensor:
    return confidence_sample(model, cfg, tokens, keep, **kw)


def _ar_sampler(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *,
                stats: dict | None = None, steps: int = 0, bos_id: int | None = None, **kw: Any) -> torch.Tensor:
    return ar_sample(model, cfg, tokens, keep, bos_id=bos_id, stats=stats, **kw)


def _ar_window_sampler(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *,
                       stats: dict | None = None, steps: int = 0, bos_id: int | None = None,
                       **kw: Any) -> torch.Tensor:
    return ar_window_sample(model, cfg, tokens, keep, bos_id=bos_id, stats=stats, **kw)


def _bd3lm_sampler(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor,
                   **kw: Any) -> torch.Tensor:
    return sample_blocks(model, cfg, tokens, keep, **kw).tokens


def _sedd_euler(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor,
                **kw: Any) -> torch.Tensor:
    return sedd_sample(model, cfg, tokens, keep, predictor="euler", **kw)


def _sedd_analytic(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor,
                   **kw: Any) -> torch.Tensor:
    return sedd_sample(model, cfg, tokens, keep, predictor="analytic", **kw)


BLOCK_KINDS = ("mdlm", "bd3lm", "sedd")
"""Kinds whose network (MDLM's DiT; SEDD's read through its implied denoiser) runs under the block sampler's
block-causal attention and KV cache (ADLM's two networks do not)."""

SAMPLERS: dict[str, Sampler] = {s.name: s for s in (
    Sampler("mdlm", _mdlm_sampler),
    Sampler("remdm-loop", _remdm, ("eta", "t_on", "t_off", "alpha_on")),
    # Confidence-threshold parallel decoding with the approximate KV cache (sampling/confidence.py,
    # sampling/block_cache.py).
    Sampler("confidence", _confidence_sampler, CONFIDENCE_OPTIONS, steps=False),
    Sampler("ar", _ar_sampler, ("bos_id",), diffusion=False, steps=False),
    # AR past the model's context in a sliding window (the BD3-LM paper's arbitrary-length AR samples).
    Sampler("ar-window", _ar_window_sampler, ("bos_id", "context"), diffusion=False, steps=False, any_length=True,
            calls=lambda length, steps, options: length),
    Sampler("bd3lm", _bd3lm_sampler, ("block_size", "kv_cache", "context", "eos_id", "entropy_threshold",
                                      "entropy_window", "pad_id", "bos_id"), any_length=True, kinds=BLOCK_KINDS),
    # SEDD's predictors with the final denoising step (baselines/sedd.py); they read the score, so SEDD models only.
    Sampler("sedd-euler", _sedd_euler, kinds=("sedd",)),
    Sampler("sedd-analytic", _sedd_analytic, kinds=("sedd",)),
    # SSD-LM's decoding (baselines/ssdlm.py): blocks left to right, T steps of simplex diffusion each, so it takes a
    # prompt and no suffix as AR does (diffusion=False) and runs on SSD-LM's network only.
    Sampler("ssdlm", ssd_sample, SSDLM_OPTIONS, diffusion=False, any_length=True, kinds=("ssdlm",),
            calls=network_calls),
)}


def get_sampler(name: str) -> Sampler:
    if name not in SAMPLERS:
        raise SamplerError(f"unknown sampler {name!r}: use one of {', '.join(SAMPLERS)}")
    return SAMPLERS[name]


def sampler_fits(sampler: Sampler, kind: ModelKind) -> bool:
    """Whether ``sampler`` runs on a model of ``kind``: a kind that names its samplers takes those only; else a
    sampler that names its kinds runs on those only; else the two ``diffusion`` flags agree."""
    if kind.samplers:
        return sampler.name in kind.samplers
    if sampler.kinds:
        return kind.name in sampler.kinds
    return sampler.diffusion == kind.diffusion


def samplers_for(kind: str) -> list[str]:
    """The samplers that run on a ``kind`` model, its default first."""
    k = model_kind(kind)
    fits = [s.name for s in SAMPLERS.values() if sampler_fits(s, k)]
    return sorted(fits, key=lambda n: n != k.default_sampler)


def check_sampler_kind(name: str, kind: str) -> Sampler:
    """The sampler, or SamplerError (one line listing the samplers a ``kind`` model takes) when it does not run
    on that kind."""
    s = get_sampler(name)
    if not sampler_fits(s, model_kind(kind)):
        raise SamplerError(f"sampler {name!r} does not run on a {kind} model; it takes {', '.join(samplers_for(kind))} "
                           f"(default {model_kind(kind).default_sampler!r})")
    return s


def check_sampler_options(name: str, options: dict, length: int | None = None) -> Sampler:
    """The sampler, or SamplerError (one line) for an unknown sampler or option, or invalid ReMDM-loop or
    confidence settings (``length``: the generated tokens, which a confidence ``block`` must divide)."""
    s = get_sampler(name)
    reject_unknown(options, set(s.options), name)
    if name == "remdm-loop":
        ReMDMLoop(**options).validate()
    if name == "confidence":
        check_confidence_options(**options, span=length)
    return s


def sample(model: nn.Module, cfg: ModelConfig, *, batch_size: int, length: int, steps: int, sampler: str = "mdlm",
           nucleus_p: float = 1.0, generator: torch.Generator,
           prefix: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
           progress: Progress | None = None, cache: bool = True, **sampler_kwargs) -> torch.Tensor:
    """Generate token ids ``(batch_size, length)`` (docs/design/method.md, section 4).

    - ``sampler``: ``mdlm`` (ancestral), ``remdm-loop``, ``confidence`` (threshold parallel decoding, blocks
      and the approximate KV cache: ``sampling/confidence.py``), ``ar``, ``ar-window`` (AR past its context),
      ``bd3lm`` (block by block), ``sedd-euler`` and ``sedd-analytic`` (SEDD's predictors, ``baselines/sedd.py``),
      ``ssdlm`` (SSD-LM's simplex diffusion block by block, on its own network only: ``baselines/ssdlm.py``). An
      ADLM model runs the diffusion samplers on its composed network (fused projection).
    - ``steps``: ``T`` of the diffusion grid (per block for ``bd3lm``; ignored by ``ar``, which
      takes one step per token).
    - ``nucleus_p``: top-p on ``p_x0`` (1 = off). ``generator``: the only source of randomness.
    - ``prefix``: given tokens, kept fixed (``samplers`` module docstring): infilling for the
      diffusion samplers. ``progress(step, total)``: called after each step (diffusion: ``T + 1``
      steps with the greedy one; AR: one per token; BD3-LM: one per block).
    - ``cache``: MDLM/ReMDM/ADLM/BD3-LM reuse ``p_x0`` when a row did not change (exact; only with
      time conditioning off); AR uses a KV cache.
    - ``sampler_kwargs``: the sampler's options (``SAMPLERS[name].options``); ``stats`` (a dict)
      receives counters such as ``network_calls``.

    The model is put in eval mode for the call (and restored) and run under ``torch.no_grad``.
    """
    s = get_sampler(sampler)
    kind = KINDS[cfg.kind]
    if (s.kinds or kind.samplers) and not sampler_fits(s, kind):  # a sampler and a kind made for each other only
        check_sampler_kind(sampler, cfg.kind)
    check_sample_args(cfg, batch_size, length, steps, nucleus_p, generator)
    kw = dict(sampler_kwargs)
    stats = kw.pop("stats", None)
    reject_unknown(kw, set(s.options), sampler)
    device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
    tokens, keep = resolve_prefix(prefix, batch_size, length, cfg, device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return s.run(model, cfg, tokens, keep, steps=steps, nucleus_p=nucleus_p, generator=generator,
                         progress=progress, cache=cache, stats=stats, **kw)
    finally:
        model.train(was_training)


__all__ = ["KINDS", "SAMPLERS", "ModelKind", "SampleOnlyError", "Sampler", "build_model", "check_sampler_kind",
           "check_sampler_options", "compute_loss", "count_parameters", "get_sampler", "model_kind", "sample",
           "sampler_fits", "samplers_for"]
