"""Evaluation settings: ``EvalConfig`` (every field a ``--set`` key), the profiles, and the default sampler.

The suites themselves are one table, ``evaluation/suites.py``.

Every metric has exactly one definition (docs/design/method.md, section 6; ``evaluation/metrics.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from adlm_model.config import ConfigError
from adlm_model.kinds import get_sampler, model_kind
from pipelines.core.configlib import apply_to

EVAL_EXPERIMENT = "adlm-eval"
PPL_METRIC_NAMES = {"validation": "val", "test": "test"}



class EvalError(ConfigError):
    """A bad evaluation request; one line naming the problem and the fix."""


# ----------------------------------------------------------------------------------------------------------
# Configuration.


@dataclass
class EvalConfig:
    """Settings of one evaluation; every field can be set with ``--set key=value``."""

    data: str = ""
    """Prepared data directory (holds ``<split>/manifest.json``). Empty: the checkpoint's training data
    (``meta.train_config.data.validation``'s parent); relative paths lie under the work directory."""
    splits: tuple[str, ...] = ("auto",)
    """Splits scored by ``ppl``; ``auto``: ``validation`` and ``test`` where prepared."""
    zero_shot: tuple[str, ...] = ()
    """Zero-shot sets: ``NAME=DIR`` or ``DIR`` entries; DIR is a split folder, a prepared data folder (its
    ``test`` or ``validation`` split) or a folder of prepared data folders (every one is a set)."""
    batch_size: int = 16
    """Rows per NELBO batch (also the stratification group of ``t``; part of the result's identity)."""
    t_draws: int = 1
    """Draws of ``t`` per sequence (>1 lowers the variance of the bound; tokens are pooled over draws)."""
    seed: int = 0
    """Seed of every random draw (diffusion times, masks, samples); derived per batch."""
    max_rows: int = 0
    """Score N rows of each split, spread evenly over it (0: all). Staged evaluation uses it for the fast stage."""
    use_ema: bool = True
    """Evaluate and sample with the EMA weights (docs/design/method.md, section 7) when the checkpoint has them."""
    num_samples: int = 64
    """Samples drawn by ``generate`` (the paper: 5,000 for MAUVE)."""
    sample_batch_size: int = 8
    """Samples per sampling task."""
    sampler: str = "auto"
    """``mdlm``, ``remdm-loop``, ``ar``, ``bd3lm``; ``auto``: ``ar`` for AR, ``bd3lm`` for BD3-LM, else
    ``remdm-loop`` (the ADLM reference). Options: ``--set sampler.eta=0.02`` etc."""
    steps: int = 0
    """Sampling steps T (the ADLM reference uses 4096; baselines 1024); 0: the version's own default (a distilled
    student's ``sampler_steps``: ``pipelines/training/distill.py``), else ``DEFAULT_EVAL_STEPS`` (128)."""
    steps_by_kind: dict[str, int] = field(default_factory=dict)
    """Sampling steps per model kind, over ``steps`` (``--set steps.adlm=4096``; the paper profile's)."""
    profile: str = ""
    """The profile these settings came from (``EVAL_PROFILES``: ``paper``, ``demo``), recorded with the
    figures: only ``paper`` figures compare with the published ones."""
    nucleus_p: float = 0.9
    """Nucleus (top-p) of the sampler (reference 0.9; 1 = off)."""
    sample_length: int = 0
    """Tokens per sample (0: the model's seq_len)."""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Sampler options (``--set sampler.NAME=VALUE``): ReMDM ``eta``, ``t_on``, ``t_off``, ``alpha_on``; ..."""
    eval_lm: str = "gpt2-large"
    """Evaluation causal LM for gen-PPL: hub name, ``smollm2`` (offline), local model dir, AR checkpoint."""
    eval_lm_batch_size: int = 8
    """Samples per scoring batch."""
    gen_ppl_max_length: int = 1024
    """Truncation of re-tokenised samples (docs/design/method.md, section 6: 1024, or the LM's maximum)."""
    gen_ppl_first_token: str = "keep"
    """``keep`` (the reference: each sample is scored after the evaluation LM's EOS, its first token a target)
    or ``drop`` (the first token is context only). Named next to every gen-PPL figure."""
    mauve_featurizer: str = "gpt2-large"
    """MAUVE features: hub/local causal LM (last-token hidden state), ``minilm`` (offline), local encoder."""
    mauve_min_samples: int = 50
    """Refuse MAUVE below this many samples (its histogram has n/10 buckets)."""
    mauve_reference_split: str = "validation"
    """Split whose ``num_samples`` rows spread over it, decoded, are MAUVE's reference texts."""
    mauve_scaling: float = 5.0
    """MAUVE's scaling constant c (package default 5)."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:1``."""
    cpus_per_task: float = 1.0
    """Ray CPUs per task (fractional values let several tasks share a core)."""
    gpus_per_task: float = -1.0
    """Ray GPUs per task; -1 (auto): 1 for the tasks of a large network (``gpu_min_params``: a model to score or
    sample, or a hub evaluation LM such as gpt2-large), asked for even when no GPU node is up yet so that an
    autoscaling cluster launches one; otherwise 1 when the cluster has GPUs now, else 0."""
    gpu_min_params: int = 50_000_000
    """Auto GPUs: networks of at least this many parameters ask for a GPU (the paper's models: 170-293M)."""
    rows_per_task: int = 0
    """Split each dataset into Ray tasks of this many rows (rounded up to whole batches); 0: one task each."""
    job_timeout_s: float = 10800.0
    """Deadline of each Ray task, seconds (from its submission or the last task to finish): a task past it is
    cancelled and the command fails naming it. Default 3 h; raise it for the paper profile on CPUs."""
    experiment: str = EVAL_EXPERIMENT
    """MLflow experiment of the evaluation runs."""
    lm_eval_tasks: tuple[str, ...] = ()
    """Suite lm-eval: harness task or group names (``--tasks``; e.g. lambada_openai,piqa: network needed); empty:
    the offline tasks (group adlm_offline: adlm_lastword, adlm_choice, adlm_generate)."""
    lm_eval_limit: int = 0
    """Suite lm-eval: documents per task (0: all)."""
    lm_eval_num_fewshot: int = -1
    """Suite lm-eval: few-shot examples (-1: each task's default)."""
    lm_eval_mc_samples: int = 32
    """Suite lm-eval, diffusion kinds: Monte Carlo draws of the continuation's ELBO per request."""
    lm_eval_mask_draws: str = "stratified"
    """Suite lm-eval: how the draws' numbers of masked tokens are spread: plain, antithetic or stratified."""
    lm_eval_batch_size: int = 32
    """Suite lm-eval: rows per forward pass."""
    lm_eval_dtype: str = "float32"
    """Suite lm-eval: float32, or bfloat16/float16 autocast on CUDA."""
    lm_eval_greedy_max_tokens: int = 8
    """Suite lm-eval, diffusion kinds: is_greedy by greedy decoding for continuations up to this long (else False)."""
    lm_eval_bootstrap_iters: int = 1000
    """Suite lm-eval: bootstrap resamples of the harness's stderr for non-mean metrics (perplexity)."""
    lm_eval_include_path: str = ""
    """Suite lm-eval: more task folders (``:``-separated) besides the offline tasks' folder."""
    long_length: int = 2048
    """Suite arbitrary_length: tokens per sample, beyond the model's context (BD3-LM's table: 2048 after a training
    context of 1024, and 1024)."""
    long_num_samples: int = 300
    """Suite arbitrary_length: samples drawn (BD3-LM's table: 300)."""
    long_window: int = 256
    """Suite arbitrary_length: a sample reaches its length when every window of this many tokens keeps a unigram
    entropy of at least ``long_min_entropy`` (BD3-LM's stop rule: 256 tokens)."""
    long_min_entropy: float = 4.0
    """Suite arbitrary_length: the entropy floor of that rule, in nats (BD3-LM: 4)."""
    accuracy_split: str = "validation"
    """Suite accuracy: the reasoning split whose rows are answered: a split name under ``data`` or a split folder
    (every row is scored)."""

    def validate(self) -> EvalConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise EvalError(msg)

        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.t_draws >= 1, f"t_draws must be >= 1, got {self.t_draws}")
        need(self.max_rows >= 0, f"max_rows must be >= 0, got {self.max_rows}")
        need(self.num_samples >= 1, f"num_samples must be >= 1, got {self.num_samples}")
        need(self.sample_batch_size >= 1, f"sample_batch_size must be >= 1, got {self.sample_batch_size}")
        need(self.steps >= 0, f"steps must be >= 1 (0: the version's default), got {self.steps}")
        need(0.0 < self.nucleus_p <= 1.0, f"nucleus_p must be in (0, 1], got {self.nucleus_p}")
        need(self.sample_length >= 0, f"sample_length must be >= 0, got {self.sample_length}")
        need(self.eval_lm_batch_size >= 1, f"eval_lm_batch_size must be >= 1, got {self.eval_lm_batch_size}")
        need(self.gen_ppl_max_length >= 2, f"gen_ppl_max_length must be >= 2, got {self.gen_ppl_max_length}")
        need(self.gen_ppl_first_token in ("keep", "drop"),
             f"gen_ppl_first_token must be keep (the reference) or drop, got {self.gen_ppl_first_token!r}")
        need(self.mauve_min_samples >= 2, f"mauve_min_samples must be >= 2, got {self.mauve_min_samples}")
        need(self.cpus_per_task > 0, f"cpus_per_task must be > 0, got {self.cpus_per_task}")
        need(self.rows_per_task >= 0, f"rows_per_task must be >= 0, got {self.rows_per_task}")
        need(self.long_length >= 1 and self.long_num_samples >= 1 and self.long_window >= 1,
             "long_length, long_num_samples and long_window must be >= 1")
        need(self.job_timeout_s > 0, f"job_timeout_s must be > 0 (every Ray task has a deadline), got "
                                     f"{self.job_timeout_s}")
        need(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def apply_overrides(configs: Sequence[Any], assignments: Sequence[str]) -> None:
    """``--set KEY=VALUE`` on the evaluation (and promotion) settings; ``sampler.NAME=VALUE`` goes into
    ``EvalConfig.sampler_kwargs``, ``steps.KIND=T`` into ``steps_by_kind``, ``gate.NAME=BOUND`` into
    ``PromotionConfig.bounds`` (``pipelines.core.configlib``)."""
    apply_to(configs, assignments, dict_prefixes={"sampler": "sampler_kwargs", "steps": "steps_by_kind",
                                                  "gate": "bounds"})


EVAL_PROFILES: dict[str, dict[str, Any]] = {
    # The references' settings (docs/design/method.md, sections 4 and 6): ReMDM-loop with T = 4096 for ADLM and 1024 for
    # the baselines, nucleus 0.9, 5,000 samples of the model's length for MAUVE against as many validation
    # texts, gen-PPL under gpt2-large with the first token scored. For a GPU cluster: hours of sampling.
    # The reference samples one sequence at a time; 16 rows a batch draw the same distribution (every sampler
    # here is row-wise: noise, nucleus and the cache's skipped steps are per row), only faster.
    # SSD-LM: T = 1000 steps per block, the reference's (the BD3-LM paper's table ran it so). The arbitrary-length
    # suite's settings are the BD3-LM paper's table: 300 samples of 2048 tokens.
    "paper": dict(sampler="auto", steps=1024, steps_by_kind={"adlm": 4096, "ssdlm": 1000}, nucleus_p=0.9,
                  num_samples=5000, long_length=2048, long_num_samples=300,
                  sample_batch_size=16, sample_length=0, eval_lm="gpt2-large", mauve_featurizer="gpt2-large",
                  gen_ppl_first_token="keep", t_draws=1, use_ema=True),
    # What `make demo` runs on 2 CPU cores: a wiring check whose figures do not compare with the papers'.
    # Each kind's own sampler (ReMDM-loop for the diffusion models, left to right for AR).
    "demo": dict(eval_lm="smollm2", mauve_featurizer="minilm", num_samples=16, sample_batch_size=16, steps=32,
                 nucleus_p=1.0, mauve_min_samples=16, sampler="auto", max_rows=256, batch_size=16,
                 cpus_per_task=1.0),
}


DEFAULT_EVAL_STEPS = 128
"""Sampling steps of an evaluation that sets none, of a version that names none (``sampling_steps``)."""


def sampling_steps(cfg: EvalConfig, kind: str | None, meta: dict[str, Any] | None = None) -> int:
    """T for a model of ``kind``: ``steps.KIND``, else ``steps``, else the checkpoint meta's ``sampler_steps`` (a
    distilled student's step count), else ``DEFAULT_EVAL_STEPS``."""
    if kind and kind in cfg.steps_by_kind:
        return int(cfg.steps_by_kind[kind])
    if cfg.steps:
        return int(cfg.steps)
    named = (meta or {}).get("sampler_steps")
    return int(named) if isinstance(named, int) and named >= 1 else DEFAULT_EVAL_STEPS


def eval_profile(name: str) -> EvalConfig:
    """The ``EvalConfig`` of a named profile (``EVAL_PROFILES``)."""
    if name not in EVAL_PROFILES:
        raise EvalError(f"unknown evaluation profile {name!r}; use one of {', '.join(EVAL_PROFILES)}")
    return EvalConfig(**{**EVAL_PROFILES[name], "profile": name})


def resolve_sampler(name: str, kind: str) -> str:
    if name != "auto":
        return name
    return model_kind(kind).default_sampler


TOKENIZER_IDS = ("bos_id", "eos_id", "pad_id")
"""Sampler options whose default is the tokenizer's special id of that name (when it has one)."""


def sampler_options(sampler: str, kwargs: dict[str, Any], tok: Any) -> dict[str, Any]:
    """Sampler options plus the special ids the sampler takes (those of its options named in ``TOKENIZER_IDS``:
    the samplers table says which) from the tokenizer, where not given."""
    kw = dict(kwargs)
    for k in get_sampler(sampler).options:
        if k in TOKENIZER_IDS and getattr(tok, k, None) is not None:
            kw.setdefault(k, getattr(tok, k))
    return kw
