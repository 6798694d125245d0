"""Executors of the evaluation's jobs: one after the other in this process, or one Ray task each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LocalExecutor:
    """Runs jobs one after the other in this process, with progress bars."""

    name = "in-process"

    def run(self, fn: Callable[..., Any], jobs: list[dict[str, Any]], desc: str, unit: str = "job",
            total_units: int | None = None, progress_kw: str | None = None, step_total: int | None = None,
            large: bool = False) -> list[Any]:
        from tqdm.auto import tqdm

        out = []
        with tqdm(total=total_units or len(jobs), desc=desc, unit=unit) as bar:
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

    def __init__(self, cpus: float, gpus: float) -> None:
        import ray

        self.ray = ray
        self.cpus, self.gpus = cpus, gpus

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
        from tqdm.auto import tqdm

        remote = self.ray.remote(fn).options(num_cpus=self.cpus, num_gpus=self.gpus_for(large), max_retries=1)
        refs = [remote.remote(**job) for job in jobs]
        index = {r: i for i, r in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        with tqdm(total=len(refs), desc=desc, unit="task") as bar:
            while pending:
                done, pending = self.ray.wait(pending, num_returns=1)
                for r in done:
                    results[index[r]] = self.ray.get(r)
                    bar.update(1)
        return results
