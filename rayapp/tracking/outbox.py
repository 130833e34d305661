"""Rank 0's MLflow writes, sent from a background thread so training never waits on the server.

Records (metrics, tags, artifacts) queue in memory and a sender thread delivers them in
batches. While the tracking server is down or slow, records stay queued and are retried
with back-off; the person at the terminal is told once. If the server is still unreachable
when training ends, the undelivered records are written to a fallback JSONL file (artifacts
copied beside it) that `rayapp import-metrics FILE` delivers later. Nothing is dropped.

Writes are paced. A write costs about the same whether it carries one epoch's metrics or ten
(against SQLite: 7.7 ms of CPU for one epoch, 13.9 ms for ten, on a 2-core VM), and it runs in
the training process. So after each write the sender waits until the write's time is at most
WRITE_BUDGET of the time since it began, and the next write carries every epoch that arrived
meanwhile. Against a fast store that is a second or two; metrics reach MLflow that much later.
Epochs still queued when a worker dies are in its last checkpoint's history, from which a
restarted worker logs them, or the driver once a job has ended early (rayapp.backfill).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

FALLBACK_SUFFIX = ".mlflow-fallback.jsonl"
GRACE_ENV = "RAYAPP_MLFLOW_GRACE_S"
"""How long a finished job waits for an unreachable tracking server before writing the fallback
file."""
DEFAULT_GRACE_S = 30.0
# A dead server should fail a request in seconds, not after MLflow's default minutes of retries:
# the outbox does its own retrying, and the training loop never waits on it.
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
WRITE_BUDGET = 0.005
"""Share of wall time the sender may spend writing (see the module docstring)."""
MAX_WRITE_GAP_S = 10.0
"""However slow the store, metrics are at most this much (plus one write) behind training."""
MAX_METRICS_PER_WRITE = 1000  # MLflow's limit for one log_batch


@dataclass
class Record:
    kind: str
    """metrics | tags | artifact | status"""
    run_id: str
    step: int = 0
    timestamp_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    values: dict[str, Any] = field(default_factory=dict)
    """metrics: {key: float}; tags: {key: str}; artifact: {path, artifact_path}; status:
    {status}."""


@dataclass
class WriteStats:
    """What the sender's successful writes cost, as the training process felt it."""

    writes: int = 0
    records: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    """CPU time of the sending thread itself."""


def leading_write(records: list[Record]) -> int:
    """How many records from the head go in one write: consecutive metrics records of one run, up
    to MLflow's batch limit, or else the first record alone. At least one."""
    first = records[0]
    if first.kind != "metrics":
        return 1
    count, metrics = 1, len(first.values)
    for record in records[1:]:
        if (
            record.kind != "metrics"
            or record.run_id != first.run_id
            or metrics + len(record.values) > MAX_METRICS_PER_WRITE
        ):
            break
        count, metrics = count + 1, metrics + len(record.values)
    return count


def deliver(client: MlflowClient, records: list[Record]) -> None:
    """Send records in order, consecutive metrics records of one run in one batch; raises on the
    first failure."""
    while records:
        count = leading_write(records)
        _write(client, records[:count])
        records = records[count:]


def _write(client: MlflowClient, records: list[Record]) -> None:
    """One MLflow call: several metrics records of one run, or one record of any kind."""
    from mlflow.entities import Metric, RunTag

    record = records[0]
    if record.kind == "metrics":
        metrics = [
            Metric(k, float(v), each.timestamp_ms, each.step)
            for each in records
            for k, v in each.values.items()
        ]
        client.log_batch(record.run_id, metrics=metrics, synchronous=True)
    elif record.kind == "tags":
        client.log_batch(record.run_id, tags=[RunTag(k, str(v)) for k, v in record.values.items()])
    elif record.kind == "artifact":
        client.log_artifact(
            record.run_id, record.values["path"], record.values.get("artifact_path")
        )
    elif record.kind == "status":
        client.set_terminated(record.run_id, status=record.values["status"])


class Outbox:
    def __init__(
        self,
        tracking_uri: str,
        fallback_path: Path,
        *,
        notify: Callable[[str], None] = lambda message: None,
        retry_s: tuple[float, float] = (1.0, 10.0),
        write_budget: float = WRITE_BUDGET,
    ) -> None:
        from mlflow.tracking import MlflowClient

        os.environ.update(CLIENT_ENV)
        self._client = MlflowClient(tracking_uri)
        self._tracking_uri = tracking_uri
        self.fallback_path = Path(fallback_path)
        self._notify = notify
        self._retry_s = retry_s
        self._pending: list[Record] = []
        self._condition = threading.Condition()
        self._closing = False
        self._down_since: float | None = None
        self._write_budget = write_budget
        self._next_write_at = 0.0
        self.stats = WriteStats()
        self._thread = threading.Thread(
            target=self._send_forever, name="rayapp-mlflow-outbox", daemon=True
        )
        self._thread.start()

    @property
    def client(self) -> MlflowClient:
        return self._client

    def put(self, record: Record) -> None:
        if record.kind == "artifact":
            # The caller may delete the file right after; keep a copy until it is delivered.
            record.values = {**record.values, "path": self._keep(record.values["path"])}
        with self._condition:
            self._pending.append(record)
            self._condition.notify()

    def close(
        self, timeout_s: float = 120.0, last: Callable[[WriteStats], Record] | None = None
    ) -> Path | None:
        """Wait up to timeout_s for delivery; returns the fallback file if records remain
        undelivered.

        `last` makes one more record from the finished stats (all writes but its own) and sends it
        after everything else."""
        started = time.monotonic()
        with self._condition:
            self._closing = True
            self._condition.notify()
            while self._pending and time.monotonic() - started < self._patience(timeout_s):
                self._condition.wait(timeout=0.5)
            left = list(self._pending)
            self._pending.clear()
            self._condition.notify()
        self._thread.join(timeout=5)
        if last is not None:
            record = last(self.stats)
            if not left:
                try:
                    deliver(self._client, [record])
                except (
                    Exception
                ):  # the server went away just now: the record joins the fallback file
                    left = [record]
            else:
                left.append(record)
        if not left:
            shutil.rmtree(self._kept_dir(), ignore_errors=True)
            return None
        append_fallback(self.fallback_path, left)
        return self.fallback_path

    # ---- internals ------------------------------------------------------------------

    def _patience(self, timeout_s: float) -> float:
        """While the server is answering, wait the full timeout; once it is down, a short grace."""
        grace = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
        return min(timeout_s, grace) if self._down_since is not None else timeout_s

    def _send_forever(self) -> None:
        """Deliver the oldest records, drop them from the queue only once delivered; back off while
        down."""
        delay = self._retry_s[0]
        while True:
            with self._condition:
                while not self._pending and not self._closing:
                    self._condition.wait()
                # Pacing: wait out the last write's share of the budget, unless closing.
                while not self._closing and (left_s := self._next_write_at - time.monotonic()) > 0:
                    self._condition.wait(timeout=left_s)
                if not self._pending:
                    return
                batch = self._pending[: leading_write(self._pending)]
            started, started_cpu = time.monotonic(), time.thread_time()
            try:
                deliver(self._client, batch)
            except Exception as exc:  # server down, slow, or refusing: keep the records, retry
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    self._notify(
                        f"MLflow at {self._tracking_uri} is not answering ({type(exc).__name__}); "
                        "training continues and metrics are buffered until it returns"
                    )
                with self._condition:
                    self._condition.wait(timeout=delay)
                delay = min(delay * 2, self._retry_s[1])
                continue
            took_s = time.monotonic() - started
            self._record_write(len(batch), took_s, time.thread_time() - started_cpu)
            if (
                self.stats.writes > 1
            ):  # the first write also opens the client's store: not a write's cost
                self._next_write_at = started + min(
                    took_s / self._write_budget, MAX_WRITE_GAP_S + took_s
                )
            with self._condition:
                # close() may have given up on the queue meanwhile and emptied it
                if len(self._pending) >= len(batch) and all(
                    a is b for a, b in zip(self._pending, batch, strict=False)
                ):
                    del self._pending[: len(batch)]
                self._condition.notify_all()
            if self._down_since is not None:
                self._notify(
                    f"MLflow is back after {time.monotonic() - self._down_since:.0f}s; "
                    "buffered metrics delivered"
                )
                self._down_since = None
            delay = self._retry_s[0]

    def _record_write(self, records: int, wall_s: float, cpu_s: float) -> None:
        stats = self.stats
        stats.writes, stats.records = stats.writes + 1, stats.records + records
        stats.wall_s, stats.cpu_s = stats.wall_s + wall_s, stats.cpu_s + cpu_s

    def _kept_dir(self) -> Path:
        return self.fallback_path.with_suffix("").with_suffix(".artifacts")

    def _keep(self, path: str) -> str:
        # One folder per artifact: the file keeps its name, which is its name in MLflow.
        kept = self._kept_dir()
        kept.mkdir(parents=True, exist_ok=True)
        folder = kept / str(len(os.listdir(kept)))
        folder.mkdir()
        target = folder / Path(path).name
        shutil.copyfile(path, target)
        return str(target)


def append_fallback(path: Path, records: list[Record]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(asdict(record)) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def import_fallback(path: Path, tracking_uri: str) -> int:
    """Deliver a fallback file's records, skipping metric values already in the run; returns records
    sent.

    On success the file is renamed to *.imported so a second import does nothing.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    records = [
        Record(**json.loads(line))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    to_send: list[Record] = []
    present: dict[tuple[str, str], set[int]] = {}
    for record in records:
        if record.kind == "metrics":
            fresh = {}
            for key, value in record.values.items():
                if (record.run_id, key) not in present:
                    present[(record.run_id, key)] = {
                        m.step for m in client.get_metric_history(record.run_id, key)
                    }
                if record.step not in present[(record.run_id, key)]:
                    fresh[key] = value
                    present[(record.run_id, key)].add(record.step)
            if not fresh:
                continue
            record.values = fresh
        to_send.append(record)
    deliver(client, to_send)
    path.rename(path.with_name(path.name + ".imported"))
    return len(to_send)
