"""The facts of one training run that the driver's steps share (``pipelines/training/trainer.py``): the recipe, its
data, where its checkpoints and metrics live, its MLflow run, and the checkpoint it exports. One object instead of
a list of path and URI strings, so that a step's signature says which run it works on, not how its folders are
spelled."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.core.storage import join
from pipelines.tracking.spool import SPOOL
from pipelines.training.config import TrainConfig
from pipelines.training.data import DataPlan


@dataclass
class RunContext:
    """One training run's facts, shared by the driver's steps: the recipe, its data, where its checkpoints and
    metrics live, and its MLflow run."""

    cfg: TrainConfig
    """The recipe (``run.init`` pinned once ``check_resume`` ran)."""
    plan: DataPlan
    workdir: str
    tracking_uri: str
    storage: str
    """Ray Train's storage root (``storage_root``)."""
    run_dir: str
    """The run's folder in that storage: its checkpoints, its best checkpoint, its spool."""
    prev: tuple[int, str] | None
    """The latest checkpoint already there (step, folder): a resume, or a rerun of a finished run."""
    prev_meta: dict[str, Any] = field(default_factory=dict)
    """That checkpoint's meta (its MLflow run id, tokenizer hash, lineage)."""
    parent_run_id: str | None = None
    """The MLflow run this one nests under (a Tune trial's sweep)."""
    extra_tags: dict[str, str] | None = None
    """Tags of the MLflow run and the registered version (a sweep's trial, a study's arm)."""
    run_id: str | None = None
    """The MLflow run (``open_run``); None while tracking is unavailable."""
    finished: bool = False
    """The latest checkpoint is at ``run.max_steps``: nothing to train (``check_resume``)."""

    @property
    def name(self) -> str:
        return self.cfg.run.name

    @property
    def spool(self) -> str:
        """Where rank 0's metrics wait while tracking is out (``pipelines.tracking.spool``)."""
        return join(self.run_dir, SPOOL)



@dataclass
class Export:
    """The checkpoint a finished run exports and registers: its best by validation bound, else its latest."""

    final: tuple[int, str]
    """The run's latest checkpoint (step, folder)."""
    source: str
    """The chosen checkpoint's folder in the run's storage (``final``'s, or the best one's)."""
    local_dir: Path
    """A local copy of the chosen checkpoint (what is logged, registered and published)."""
    meta: dict[str, Any]
    step: int
    val_ppl: float | None
    which: str
    """``best`` or ``latest``."""
    lineage: str | None
    """The version the exported weights started from (``run.init``), if any."""


__all__ = ["Export", "RunContext"]
