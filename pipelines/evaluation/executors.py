"""Executors of the evaluation's jobs: one after the other in this process, or one Ray task each.

Every Ray task has a deadline (``EvalConfig.job_timeout_s``): the driver never waits on a task without one. A
task still running when no task has finished for that long is cancelled, and ``JobDeadlineError`` says which
work it was doing and for how long (a job of the in-process executor runs in the caller's thread: nothing can
stop it there, so it has none).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pipelines.core.logs import verbosity
from pipelines.core.runtime import cpu_work_options


class JobDeadlineError(RuntimeError):
    """A Ray task of the evaluation ran past its deadline and was cancelled (work that started, then failed:
    the commands exit 1)."""

    exit_code = 1


class LocalExecutor:
    """Runs jobs one after the other in this process, with progress bars."""

    name = "in-process"

    def run(self, fn: Callable[..., Any], jobs: list[dict[str, Any]], desc: str, unit: str = "job",
            total_units: int | None = None, progress_kw: str | None = None, step_total: int | None = None,
            large: bool = False) -> list[Any]:
        # lazy: keeps tqdm out of this module's import
        from tqdm.auto import tqdm

        out = []
        # Kept on the console with -v only: by default a job's bar shows while it runs (the results say the rest).
        with tqdm(total=total_units or len(jobs), desc=desc, unit=unit, leave=verbosity() > 0) as bar:
            for job in jobs:
                kw = dict(job)
                if progress_kw == "rows":
                    kw["progress"] = bar.update
                    out.append(fn(**kw))
                    continue
                if progress_kw == "steps":
                    inner = tqdm(total=step_total, desc="  steps", unit="step", leave=False)

                    def step(i: int, total: int, _bar: Any = inner) -> None:
                        _bar.total = total
                        _bar.update(1)

                    kw["progress"] = step
                    try:
                        out.append(fn(**kw))
                    finally:
                        inner.close()
                    bar.update(kw.get("n", 1))
                    continue
                out.append(fn(**kw))
                bar.update(1)
        return out


class RayExecutor:
    """One Ray task per job; results in job order. ``gpus`` < 0 (auto): a job marked ``large`` asks for a GPU
    whether or not one is up (an autoscaling cluster then launches a GPU node; the work never silently falls
    back to CPU), other jobs take one only when the cluster has GPUs now."""

    name = "ray"

    def __init__(self, cpus: float, gpus: float, timeout_s: float = 10800.0) -> None:
        # lazy: keeps ray out of this module's import
        import ray

        self.ray = ray
        self.cpus, self.gpus, self.timeout_s = cpus, gpus, timeout_s

    def gpus_for(self, large: bool) -> float:
        """GPUs a task asks for (class docstring)."""
        if self.gpus >= 0:
            return self.gpus
        if large:
            return 1.0
        return 1.0 if self.ray.cluster_resources().get("GPU", 0) > 0 else 0.0

    def run(self, fn: Callable[..., Any], jobs: list[dict[str, Any]], desc: str, unit: str = "job",
            total_units: int | None = None, progress_kw: str | None = None, step_total: int | None = None,
            large: bool = False) -> list[Any]:
        # lazy: keeps tqdm out of this module's import
        from tqdm.auto import tqdm

        gpus = self.gpus_for(large)  # a task without a GPU is CPU work: never on a GPU node
        remote = self.ray.remote(fn).options(num_cpus=self.cpus, num_gpus=gpus, max_retries=1, **cpu_work_options(gpus))
        refs = [remote.remote(**job) for job in jobs]
        index = {r: i for i, r in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        started = last = time.monotonic()
        with tqdm(total=len(refs), desc=desc, unit="task", leave=verbosity() > 0) as bar:  # kept with -v only
            while pending:
                # The deadline runs from the submission or the last task to finish, whichever is later: a task
                # queued behind others for a slot is not charged for their time.
                left = self.timeout_s - (time.monotonic() - last)
                done, pending = self.ray.wait(pending, num_returns=1, timeout=max(left, 0.0))
                if not done:
                    self._cancel(pending)
                    raise JobDeadlineError(
                        f"{desc}: {len(pending)} of {len(refs)} Ray task(s) still running after "
                        f"{time.monotonic() - started:.0f} s, none finished in the last {self.timeout_s:g} s "
                        f"(job_timeout_s): cancelled; raise it with --set job_timeout_s=SECONDS if the work is "
                        f"that long, else look for the stuck task in the Ray worker logs")
                last = time.monotonic()
                for r in done:
                    results[index[r]] = self.ray.get(r, timeout=self.timeout_s)
                    bar.update(1)
        return results

    def _cancel(self, refs: list[Any]) -> None:
        """Stop the tasks (force: a task stuck in native code or a lock ignores a polite cancel)."""
        for r in refs:
            try:
                self.ray.cancel(r, force=True)
            except Exception:  # noqa: BLE001 - already finished or gone: nothing left to stop
                pass
