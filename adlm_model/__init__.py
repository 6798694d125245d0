"""adlm_model: the Anchored Diffusion Language Model and its baselines in pure PyTorch.

No Ray or MLflow here; ``pipelines/`` orchestrates. See docs/design/method.md for the specification.

One concept a file: ``config`` (typed configs, presets), ``schedule`` (noise schedule, times),
``attention`` (flash-attn / SDPA), ``backbone`` (the DiT), ``models`` (MDLM, ADLM, AR networks),
``losses`` (SUBS, NELBO, ANELBO, AR NLL), ``vocab_loss`` (those losses fused with the vocabulary projection,
without the float32 logits), ``train_step`` (the optimiser step training and the GPU check run), ``samplers`` (MDLM, ReMDM-loop, AR), ``bd3lm`` (block
diffusion), ``sedd`` (SEDD: the score network, its score-entropy loss and predictors), ``sedd_layout`` (the SEDD
reference's released layout mapped to ours), ``kinds`` (the table of model kinds and samplers: ``build_model``,
``compute_loss``, ``sample``), ``block_attention`` (BD3-LM's masks and pass), ``ema``, ``checkpoint`` (safetensors +
JSON), ``infill`` (prompt / suffix infilling at the token level), ``textgen`` (text in, text out: what
``pipelines.generate`` and the served model run; uses ``tokenizers``), ``pretrained`` (the Hugging Face-style
export folder). ``configuration_adlm`` and ``modeling_adlm`` are the ``transformers`` wrappers an export ships
beside the network's modules: ``transformers`` imports them from the folder; this package never does.
``testbed`` / ``testbed_natural``: the ground-truth languages (anchored and natural presets).
"""

from .bd3lm import (
    BlockSample,
    ClipSearchResult,
    bd3lm_objective,
    block_diff_mask,
    clip_intervals,
    sample_blocks,
    search_clipped_schedule,
)
from .checkpoint import CheckpointError, load_checkpoint, load_state, save_checkpoint, save_state
from .config import MODEL_KINDS, PRESETS, ConfigError, ModelConfig, preset
from .ema import EMA
from .infill import InfillLayout, infill, plan_infill
from .kinds import KINDS, SAMPLERS, build_model, compute_loss, count_parameters, model_kind, sample
from .losses import LossOutput, anchor_mask, gamma_at, subs_log_probs, subs_nll
from .models import ADLM, AR, MDLM
from .pretrained import load_pretrained, save_pretrained
from .samplers import ReMDMLoop, SamplerError, nucleus, sample_categorical, transition_probs, unigram_entropy
from .schedule import LogLinearSchedule, antithetic_times, mask_tokens
from .sedd import SEDD, sedd_objective
from .sedd_layout import sedd_from_reference
from .testbed_natural import NaturalTestbed  # registers the natural testbed preset with testbed.Testbed
from .textgen import Generation, GenerationError, GenerationRequest, SpecialTokens, TextGenerator, load_generator

__version__ = "0.1.0"

__all__ = [
    "ADLM", "AR", "EMA", "KINDS", "MDLM", "MODEL_KINDS", "NaturalTestbed", "PRESETS", "SAMPLERS", "BlockSample", "CheckpointError",
    "ClipSearchResult", "ConfigError", "Generation", "GenerationError", "GenerationRequest", "InfillLayout",
    "LogLinearSchedule", "LossOutput", "ModelConfig", "ReMDMLoop", "SEDD", "SamplerError", "SpecialTokens", "TextGenerator",
    "__version__", "anchor_mask", "antithetic_times", "bd3lm_objective", "block_diff_mask", "build_model",
    "clip_intervals", "compute_loss", "count_parameters", "gamma_at", "infill", "load_checkpoint", "load_generator",
    "load_pretrained", "load_state", "mask_tokens", "model_kind", "nucleus", "plan_infill", "preset", "sample",
    "sample_blocks", "sample_categorical", "save_checkpoint", "save_pretrained", "save_state",
    "search_clipped_schedule", "sedd_from_reference", "sedd_objective", "subs_log_probs", "subs_nll", "transition_probs", "unigram_entropy",
]
