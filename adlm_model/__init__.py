"""adlm_model: the Anchored Diffusion Language Model and its baselines in pure PyTorch.

No Ray or MLflow here; ``pipelines/`` orchestrates. See METHOD.md for the specification.
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
from .losses import LossOutput, anchor_mask, compute_loss, gamma_at, subs_log_probs, subs_nll
from .models import ADLM, AR, MDLM, build_model, count_parameters
from .samplers import SAMPLERS, ReMDMLoop, SamplerError, nucleus, sample, sample_categorical, transition_probs
from .schedule import LogLinearSchedule, antithetic_times, mask_tokens

__version__ = "0.1.0"

__all__ = [
    "ADLM", "AR", "EMA", "MDLM", "MODEL_KINDS", "PRESETS", "CheckpointError", "ConfigError", "LogLinearSchedule",
    "LossOutput", "ModelConfig", "anchor_mask", "antithetic_times", "build_model", "compute_loss",
    "count_parameters", "gamma_at", "load_checkpoint", "load_state", "mask_tokens", "preset", "save_checkpoint",
    "save_state", "subs_log_probs", "subs_nll", "__version__",
]
__all__ += [
    "SAMPLERS", "BlockSample", "ClipSearchResult", "ReMDMLoop", "SamplerError", "bd3lm_objective", "block_diff_mask",
    "clip_intervals", "nucleus", "sample", "sample_blocks", "sample_categorical", "search_clipped_schedule",
    "transition_probs",
]
