"""Rank 0's metric logging that a tracking outage never stalls, and the spool it leaves for the next command.

- ``ResilientLogger``: rank 0's metric logger, asynchronous: a tracking outage of any length costs the
  training loop nothing; what cannot be sent by the end of the run waits in the run's spool (``SPOOL`` in its
  storage) for the next command (``send_spool``). Steps already stored are not sent twice (a restart from a
  checkpoint).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque

from pipelines.core.logs import first_line, get_logger
from pipelines.core.storage import delete_dir, join, list_dir, read_text, write_text
from pipelines.tracking.runs import TrackingAuthError, client, redact_uri, tracking_reachable

log = get_logger("tracking")  # has a handler in a Ray worker too (the metric sender runs there)

SPOOL = "tracking_spool"
"""Folder of a run (in its storage) where metrics that could not be sent wait for the next command."""


class ResilientLogger:
    """Asynchronous MLflow metric logging that never stalls training (rank 0 of a training run).

    ``log_metrics`` only queues (bounded: past ``max_buffer`` entries the oldest are dropped and counted). A
    daemon thread sends the queue in batches with MLflow's own retries; when the store stays unreachable it
    warns once per outage and tries again with a bounded backoff, so an outage of any length costs the
    training loop nothing. Before the first send it reads the run's last stored step: steps at or below it
    (a restart from a checkpoint) are not sent twice. ``close`` waits a bounded time for the queue to drain
    and writes what is left to the run's spool (``<run_dir>/tracking_spool/``), which ``send_spool`` delivers
    on the next command. ``run_id=None`` (tracking was down when the run started) spools everything. At each
    checkpoint ``persist`` makes what is queued survive the process (sent, or spooled), so a worker lost after a
    checkpoint loses no metric of the steps before it.
    """

    def __init__(self, tracking_uri: str, run_id: str | None, *, spool_dir: str | None = None,
                 max_buffer: int = 200_000, retry_s: float = 5.0, max_retry_s: float = 60.0,
                 skip_through_step: int | None = None) -> None:
        self.tracking_uri, self.run_id, self.spool_dir = tracking_uri, run_id, spool_dir
        self.max_buffer, self.retry_s, self.max_retry_s = max_buffer, retry_s, max_retry_s
        self.skip_through = skip_through_step
        self.dropped = 0
        self.sent = 0
        self.failures = 0
        self._queue: deque = deque()
        self._in_flight = 0
        self._chunk: list = []
        self._cond = threading.Condition()
        self._closing = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="adlm-mlflow-sender", daemon=True)
        if run_id is not None:
            self._thread.start()

    def log_metrics(self, metrics: dict[str, float], step: int, *, force: bool = False) -> None:
        """Queue the metrics of one step (never blocks on the store). ``force``: send even a step at or below
        the run's last stored one (a resume marker)."""
        ts = int(time.time() * 1000)
        with self._cond:
            for k, v in metrics.items():
                if v is not None:
                    self._queue.append((k, float(v), ts, int(step), force))
            while len(self._queue) > self.max_buffer:
                self._queue.popleft()
                self.dropped += 1
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._in_flight

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is stored, at most ``timeout`` seconds; False if not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._in_flight:
                if self.run_id is None or not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=left if left is not None else 1.0)
        return True

    def close(self, timeout: float = 60.0) -> int:
        """Drain for at most ``timeout`` seconds (none while the store is failing: the run is over and must not
        wait on an outage), stop the sender, spool the rest; returns how many metrics were spooled."""
        # A store that is failing, or whose health check does not answer, is not waited for.
        try:
            dead = self.failures or self._in_flight and not tracking_reachable(self.tracking_uri, timeout=2.0)
        except TrackingAuthError:  # credentials revoked mid-run: spool, the next command says what to set
            dead = True
        sent = self.flush(0.0 if dead else timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        if sent:
            return 0
        with self._cond:  # the in-flight batch too: the stuck call may never return before the process ends
            rest = (list(self._chunk) if self._in_flight else []) + list(self._queue)
            self._queue.clear()
            self._chunk, self._in_flight = [], 0
        if rest and self.spool_dir:
            self._spool(rest)
            log.warning(f"MLflow at {redact_uri(self.tracking_uri)} is unreachable: {len(rest)} metrics kept in "
                        f"{self.spool_dir}; the next run of the same command sends them")
        return len(rest)

    def persist(self, timeout: float = 2.0) -> int:
        """At a checkpoint: make every metric queued so far outlive this process, so that a restart from this
        checkpoint (which replays only later steps) loses none. Waits at most ``timeout`` seconds for the store to
        take them (not at all while it is failing: training never waits on an outage); what it has not taken
        leaves the queue for the spool, which the end of this command (``send_spool``) or the next one sends.
        Returns how many metrics were spooled."""
        if self.run_id is not None and not self.failures and self.flush(timeout):
            return 0
        if not self.spool_dir:
            return 0
        with self._cond:  # the in-flight batch too (a call stuck in retries), though it stays in flight: should
            # it still succeed, ``send_spool`` skips its steps, which are then stored
            rest = (list(self._chunk) if self._in_flight else []) + list(self._queue)
            self._queue.clear()
        if rest:
            self._spool(rest)
        return len(rest)

    def _spool(self, rest: list) -> None:
        name = f"{int(time.time() * 1000)}-{os.getpid()}-{threading.get_ident()}.jsonl"
        lines = "".join(json.dumps({"key": k, "value": v, "timestamp": ts, "step": st}) + "\n"
                        for k, v, ts, st, _ in rest)
        write_text(join(self.spool_dir, name), lines)

    # -- the sender thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        # lazy: keeps mlflow out of this module's import
        from mlflow.entities import Metric

        delay = self.retry_s
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait(timeout=1.0)
                if self._closing and (not self._queue or self.failures):
                    return
                chunk = [self._queue.popleft() for _ in range(min(1000, len(self._queue)))]
                self._chunk, self._in_flight = chunk, len(chunk)
            try:
                if self.skip_through is None:
                    self.skip_through = last_logged_step(self.tracking_uri, self.run_id)
                batch = [Metric(k, v, ts, st) for k, v, ts, st, force in chunk if force or st > self.skip_through]
                if batch:
                    client(self.tracking_uri).log_batch(self.run_id, metrics=batch)
            except Exception as e:  # noqa: BLE001 - any outage: keep the metrics, keep training, try again
                with self._cond:
                    self._queue.extendleft(reversed(chunk))
                    self._in_flight = 0
                    self.failures += 1
                    if not self._warned:
                        log.warning(f"MLflow logging failed ({first_line(e)}); {len(self._queue)} metrics "
                                    "queued, training goes on; retrying")
                        self._warned = True
                    self._cond.notify_all()
                    self._cond.wait(timeout=delay)  # a close() wakes it early
                delay = min(self.max_retry_s, delay * 2)
                continue
            with self._cond:
                self._in_flight = 0
                self.sent += len(chunk)
                if self._warned:
                    log.info("MLflow logging recovered; queued metrics sent")
                self._warned, self.failures, delay = False, 0, self.retry_s
                self._cond.notify_all()


def last_logged_step(tracking_uri: str, run_id: str, key: str = "train/loss") -> int:
    """The highest step of ``key`` stored in the run (-1 if none)."""
    hist = client(tracking_uri).get_metric_history(run_id, key)
    return max((m.step for m in hist), default=-1)


def send_spool(tracking_uri: str, run_id: str, spool_dir: str) -> int:
    """Send the metrics a run could not send (``ResilientLogger.close``), skipping steps already stored
    per key; the spool files are removed once sent. Returns how many metrics were sent."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.entities import Metric

    files = [f for f in list_dir(spool_dir) if f.endswith(".jsonl")]
    if not files:
        return 0
    c = client(tracking_uri)
    stored: dict[str, set[int]] = {}
    n = 0
    for f in files:
        batch = []
        for line in read_text(join(spool_dir, f)).splitlines():
            m = json.loads(line)
            if m["key"] not in stored:
                stored[m["key"]] = {x.step for x in c.get_metric_history(run_id, m["key"])}
            if m["step"] not in stored[m["key"]]:  # stored, or already in this spool (a step spooled twice)
                batch.append(Metric(m["key"], m["value"], m["timestamp"], m["step"]))
                stored[m["key"]].add(m["step"])
        for i in range(0, len(batch), 1000):
            c.log_batch(run_id, metrics=batch[i:i + 1000])
        n += len(batch)
    delete_dir(spool_dir)
    return n
