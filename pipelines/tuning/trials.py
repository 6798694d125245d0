"""A sweep's trial as a training run: its recipe (``trial_config``), and the end of its run done by the sweep when the
trial's own end fell in a tracking outage (``finish_trial_runs``).

A trial trains in a Tune actor that is gone once it ends. If MLflow was down then, the trial's metrics wait in its
run's spool and its checkpoint is not logged; nothing else would ever send them, and the sweep could never register
it. The sweep therefore finishes such runs after its trials, as a rerun of the trial's command would.
"""

from __future__ import annotations

import json
from typing import Any

from pipelines.core.logs import get_logger
from pipelines.core.storage import join, list_dir
from pipelines.tracking.runs import client
from pipelines.tracking.spool import SPOOL, send_spool
from pipelines.training.config import TrainConfig, apply_override
from pipelines.tuning.report import TrialRow
from pipelines.tuning.space import SearchSpace

log = get_logger(__name__)


def with_params(base_raw: dict[str, Any], params: dict[str, Any], space: SearchSpace) -> dict[str, Any]:
    """The recipe ``base_raw`` (a copy) with the space's ``params`` applied to their keys."""
    raw = json.loads(json.dumps(base_raw))
    for p in space.params:
        if p.name in params:
            apply_override(raw, f"{p.key}={json.dumps(params[p.name])}")
    return raw


def trial_config(base_raw: dict[str, Any], space: SearchSpace, trial_id: str,
                 params: dict[str, Any]) -> tuple[TrainConfig, dict[str, str]]:
    """A trial's training recipe (the base plus its params, run name ``<sweep>-<trial id>``) and its run's tags."""
    cfg = TrainConfig.from_dict(with_params(base_raw, params, space))
    cfg.run.name = f"{space.name}-{trial_id}"
    return cfg, {"sweep": space.name, "tune.trial_id": trial_id, "tune.params": json.dumps(params, sort_keys=True)}


def finish_trial_runs(base_raw: dict[str, Any], space: SearchSpace, workdir: str, tracking_uri: str, parent: str,
                      rows: list[TrialRow], children: dict[str, Any]) -> bool:
    """The end of each trial's run that fell in a tracking outage, done now (``children``: the trials' MLflow runs by
    trial id). A trial whose training finished but whose run did not (no ``checkpoint`` artifact, not FINISHED, or
    no run at all when the outage spanned its start) gets the end of its run as a rerun of its command does it:
    ``train`` on a finished run trains nothing, sends the spool, logs the checkpoint. A trial the scheduler stopped
    only has its spool sent. Returns whether any trial was finished here."""
    # lazy: keeps torch.distributed out of this module's import
    from pipelines.training.trainer import storage_root, train

    done = False
    for r in rows:
        if r.status == "error":  # its rerun resumes it, spool included
            continue
        cfg, tags = trial_config(base_raw, space, r.trial_id, r.params)
        spool = join(storage_root(cfg, workdir), cfg.run.name, SPOOL)
        run = children.get(r.trial_id)
        ended = r.step is not None and r.step >= cfg.run.max_steps
        if ended and (run is None or run.info.status != "FINISHED"
                      or not client(tracking_uri).list_artifacts(run.info.run_id, "checkpoint")):
            log.info(f"[sweep {space.name}] trial {r.trial_id} ended while MLflow was unavailable: finishing its run")
            res = train(cfg, workdir=workdir, tracking_uri=tracking_uri, parent_run_id=parent, extra_tags=tags,
                        register=False)
            r.mlflow_run_id, done = res.run_id or r.mlflow_run_id, True
        elif run is not None and any(f.endswith(".jsonl") for f in list_dir(spool)):
            sent = send_spool(tracking_uri, run.info.run_id, spool)
            log.info(f"[sweep {space.name}] trial {r.trial_id}: sent {sent} metrics that waited in its spool")
            done = True
    return done
