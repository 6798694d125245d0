"""What each profile of ``python -m pipelines.run_all`` runs: the training recipes, the sweep, the staged
evaluation's settings and the data it prepares. ``demo`` is what ``make demo`` runs; ``smoke`` the same
stages on a toy (a quick check of an installation or a cluster)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adlm_model.config import ConfigError
from pipelines.core.storage import join
from pipelines.data.embedded import embedded_slices
from pipelines.data.plan import PrepareConfig
from pipelines.evaluation.config import EVAL_PROFILES
from pipelines.training.config import load_config
from pipelines.tuning.space import load_space

if TYPE_CHECKING:
    from pipelines.data.plan import PrepareConfig

PROFILES = ("demo", "smoke")


@dataclass(frozen=True)
class DemoGoals:
    """What the demo promises (checked and printed in its summary; never a timed test assertion). Its time is
    printed with the stages' times but is no promise: on a machine that other work shares it measures the load."""

    champion_bound_over_vocab: float = 0.1
    """The champion's validation bound at most a tenth of the vocabulary size: a model that has learned
    (an untrained model's bound is about the vocabulary size)."""
    min_trials: int = 4
    min_stopped: int = 1
    """The sweep has at least 4 trials and ASHA stops at least one early."""
    samples: int = 2
    """Short samples of the champion printed in the summary."""


@dataclass
class Profile:
    """What one profile of the pipeline runs."""

    name: str
    train_runs: list[tuple[str, str, list[str]]]
    """(label, recipe, --set overrides) of each training run."""
    sweep: str | None
    """The search space (``tune_spaces/<name>.yaml``) of the sweep over ``configs/demo.yaml``, or None."""
    sweep_overrides: list[str] = field(default_factory=list)
    eval_settings: dict[str, Any] = field(default_factory=dict)
    promotion: dict[str, Any] = field(default_factory=dict)
    sample_length: int = 48
    """Tokens in each of the champion's samples in the summary."""
    goals: DemoGoals | None = None
    """The promises the summary checks (the demo's), or None."""
    comparable: bool = False
    """Whether its evaluation figures compare with published ones (only ``pipelines.evaluate --profile
    paper``'s do; no profile of run_all trains long enough)."""


def profile(name: str) -> Profile:
    if name == "demo":
        return Profile(
            name="demo",
            # ADLM first (the first champion, fully evaluated), then the AR baseline (the one model that learns
            # context within these minutes: it replaces ADLM), then MDLM (screened out by the fast stage).
            train_runs=[("ADLM", "configs/demo.yaml", []), ("AR", "configs/demo_ar.yaml", []),
                        ("MDLM", "configs/demo_mdlm.yaml", [])],
            sweep="demo",
            # Sized for 2 cores: 16 samples of 32 steps (gen-PPL under SmolLM2 costs ~2 s a sample here), MAUVE
            # on those 16 (a wiring check at this size, not a measurement), and no nucleus: the demo models'
            # distributions are nearly flat, so top-p is vocabulary-wide work at every step (a bottom-k
            # selection at best, a full sort at worst), which this time budget leaves out.
            eval_settings=dict(EVAL_PROFILES["demo"], profile="demo"),
            promotion=dict(stage1_rows=64, stage1_tolerance=0.10, margin=0.0,
                           stage2_suite=("ppl", "generate", "gen_ppl", "mauve")),
            goals=DemoGoals(),
        )
    if name == "smoke":
        tiny = ["model.hidden=32", "model.heads=2", "model.n_blocks=1", "model.denoiser_blocks=1", "model.cond_dim=16",
                "run.max_steps=8", "run.val_every=4", "run.ckpt_every=4", "run.log_every=4", "run.val_batches=1",
                "batch.global_batch=8", "batch.micro_batch=8", "scaling.num_workers=1", "scaling.cpus_per_worker=0.5",
                "run.name=smoke-adlm", "data.train=data/smoke/train",
                "data.validation=data/smoke/validation", "model.vocab_size=512", "model.seq_len=32",
                "mlflow.experiment=adlm-smoke"]
        return Profile(
            name="smoke", train_runs=[("ADLM", "configs/demo.yaml", tiny)], sweep="smoke",
            sweep_overrides=[s for s in tiny if not s.startswith(("run.name=", "run.max_steps", "run.val_every",
                                                                  "run.ckpt_every", "run.log_every"))],
            eval_settings=dict(num_samples=8, sample_batch_size=8, steps=8, sampler="mdlm", max_rows=32, batch_size=8,
                               cpus_per_task=0.5),
            promotion=dict(stage1_rows=16, stage2_suite=("ppl", "generate")),
            sample_length=24,
        )
    raise ConfigError(f"unknown profile {name!r}; use one of {', '.join(PROFILES)}")


def prepare_options(prof: Profile, wd: str) -> PrepareConfig:
    """``pipelines.data.prepare.prepare``'s config for the profile's data under the work directory."""
    if prof.name == "smoke":
        # Small slices of the embedded corpus as local text files, with a 512-entry BPE trained on them.
        files = embedded_slices(join(wd, "data", "smoke-text"), {"train": 60_000, "validation": 12_000})
        return PrepareConfig(source=[f"{split}={p}" for split, p in files.items()], out=join(wd, "data", "smoke"),
                             train_tokenizer=512, length=32, actor_cpus=0.25)
    return PrepareConfig(source=["embedded"], out=join(wd, "data", "embedded"))


def validate_profile(prof: Profile, root: Any, wd: str, skip_sweep: bool = False) -> tuple[list, Any]:
    """Load every recipe and the sweep's space of ``prof`` (paths under the project ``root``) and plan the sweep,
    before any work starts: a bad one fails in one line. Returns ``[(label, TrainConfig)]`` and the space (or
    None when the profile has no sweep or it is skipped)."""
    cfgs = [(label, load_config(root / recipe, sets)) for label, recipe, sets in prof.train_runs]
    space = None
    if prof.sweep and not skip_sweep:
        # lazy: keeps ray out of this module's import
        from pipelines.tuning.sweep import plan_sweep

        space = load_space(root / "tune_spaces" / f"{prof.sweep}.yaml")
        plan_sweep(space, root / "configs" / "demo.yaml", prof.sweep_overrides, workdir=wd, check_data=False)
    return cfgs, space
