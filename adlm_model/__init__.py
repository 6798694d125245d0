"""adlm_model: the Anchored Diffusion Language Model and its baselines in pure PyTorch.

No Ray or MLflow here; ``pipelines/`` orchestrates. See docs/design/method.md for the specification.

A subpackage a concept, each importing only those listed before it (a test keeps it so):

- ``compat`` (the one place that reaches torch's and the standard library's private names);
- ``config`` (typed configs, presets) and ``nn`` (the networks: attention, the DiT, BD3-LM's block attention,
  MDLM / ADLM / AR / A2R), torch only: an export ships them;
- ``objectives`` (noise schedule, SUBS / NELBO / ANELBO / AR NLL / A2R's anchored NLL, the fused vocabulary loss);
- ``sampling`` (the token-level samplers: MDLM, ReMDM-loop, AR, confidence decoding, their caches);
- ``baselines`` (BD3-LM, SEDD, SSD-LM: network, objective and sampler in one module each);
- ``kinds`` (the table of model kinds and samplers: ``build_model``, ``compute_loss``, ``sample``);
- ``interop`` (checkpoints, the Hugging Face-style export and its ``transformers`` wrappers, the released
  references' layouts and the safe unpickler), ``train`` (the training step, the plain loop, EMA, FLOPs,
  self-distillation), ``inference`` (text generation, infilling, request limits, likelihoods);
- ``testbed`` (the ground-truth synthetic languages).

The names below are the public API; the modules are reached by their paths (``adlm_model.sampling.samplers``).
"""

from .baselines.bd3lm import (
    BlockSample,
    ClipSearchResult,
    bd3lm_objective,
    block_diff_mask,
    clip_intervals,
    sample_blocks,
    search_clipped_schedule,
)
from .baselines.sedd import SEDD, sedd_objective
from .config import MODEL_KINDS, PRESETS, ConfigError, ModelConfig, preset
from .inference.infill import InfillLayout, infill, plan_infill
from .inference.textgen import (
    Generation,
    GenerationError,
    GenerationRequest,
    SpecialTokens,
    TextGenerator,
    load_generator,
)
from .interop.checkpoint import CheckpointError, load_checkpoint, load_state, save_checkpoint, save_state
from .interop.pretrained import load_pretrained, save_pretrained
from .interop.sedd_layout import sedd_from_reference
from .kinds import KINDS, SAMPLERS, build_model, compute_loss, count_parameters, model_kind, sample
from .nn.models import A2R, ADLM, AR, MDLM
from .objectives.losses import LossOutput, anchor_mask, gamma_at, subs_log_probs, subs_nll
from .objectives.schedule import LogLinearSchedule, antithetic_times, mask_tokens
from .sampling.samplers import ReMDMLoop, SamplerError, nucleus, sample_categorical, transition_probs, unigram_entropy
from .testbed.natural import NaturalTestbed  # registers the natural preset with testbed.language.Testbed
from .train.ema import EMA

__version__ = "0.1.0"

__all__ = [
    "A2R", "ADLM", "AR", "EMA", "KINDS", "MDLM", "MODEL_KINDS", "NaturalTestbed", "PRESETS", "SAMPLERS", "BlockSample", "CheckpointError",
    "ClipSearchResult", "ConfigError", "Generation", "GenerationError", "GenerationRequest", "InfillLayout",
    "LogLinearSchedule", "LossOutput", "ModelConfig", "ReMDMLoop", "SEDD", "SamplerError", "SpecialTokens", "TextGenerator",
    "__version__", "anchor_mask", "antithetic_times", "bd3lm_objective", "block_diff_mask", "build_model",
    "clip_intervals", "compute_loss", "count_parameters", "gamma_at", "infill", "load_checkpoint", "load_generator",
    "load_pretrained", "load_state", "mask_tokens", "model_kind", "nucleus", "plan_infill", "preset", "sample",
    "sample_blocks", "sample_categorical", "save_checkpoint", "save_pretrained", "save_state",
    "search_clipped_schedule", "sedd_from_reference", "sedd_objective", "subs_log_probs", "subs_nll", "transition_probs", "unigram_entropy",
]
