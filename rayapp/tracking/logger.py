"""The writers training code logs through: :class:`RunLogger` on rank 0, :class:`NullLogger` on
every other rank, so that loops call the same methods everywhere and only one rank writes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

from rayapp.tracking.run import EPOCH_MARKER_METRIC, TAG_ATTEMPTS, WRITE_COST_METRICS


class NullLogger:
    """What every rank but 0 gets: logging calls that do nothing."""

    def close(self, timeout_s: float = 60.0, *, write_cost_step: int | None = None) -> Path | None:
        return None

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        pass

    def logged_epochs(self) -> set[int]:
        return set()

    def previous_attempts(self) -> int:
        return 0

    def run_metric(self, key: str) -> float:
        """The run's latest value of a metric logged once per run; NaN when unknown."""
        return math.nan


class RunLogger(NullLogger):
    """Rank 0's writer to the job's run. Writes go through an :class:`~rayapp.outbox.Outbox`, so a
    slow or absent tracking server never stalls training; reads (on resume) are direct."""

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        fallback_path: str,
        notify: Callable[[str], None] = lambda message: None,
    ) -> None:
        from rayapp.tracking.outbox import Outbox

        self._outbox = Outbox(tracking_uri, Path(fallback_path), notify=notify)
        self.run_id = run_id

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics(metrics, step=epoch)

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        from rayapp.tracking.outbox import Record

        self._outbox.put(
            Record(
                "metrics", self.run_id, step=step, values={k: float(v) for k, v in metrics.items()}
            )
        )

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from rayapp.tracking.outbox import Record

        self._outbox.put(Record("tags", self.run_id, values={k: str(v) for k, v in tags.items()}))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        from rayapp.tracking.outbox import Record

        self._outbox.put(
            Record("artifact", self.run_id, values={"path": path, "artifact_path": artifact_path})
        )

    def close(self, timeout_s: float = 120.0, *, write_cost_step: int | None = None) -> Path | None:
        """Flush; returns the fallback file when the server could not take everything.

        With write_cost_step, the last write logs what all the others cost (WRITE_COST_METRICS) at
        that step."""
        from rayapp.tracking.outbox import Record, WriteStats

        if write_cost_step is None:
            return self._outbox.close(timeout_s)
        step = write_cost_step

        def write_cost(stats: WriteStats) -> Record:
            return Record(
                "metrics",
                self.run_id,
                step=step,
                values=dict(
                    zip(
                        WRITE_COST_METRICS,
                        (stats.wall_s, stats.cpu_s, float(stats.writes)),
                        strict=True,
                    )
                ),
            )

        return self._outbox.close(timeout_s, last=write_cost)

    def previous_attempts(self) -> int:
        """How many times training already started in this run (restarts after worker failures)."""
        try:
            return int(self._outbox.client.get_run(self.run_id).data.tags.get(TAG_ATTEMPTS, 0))
        except Exception:  # server unreachable: the count is cosmetic, training goes on
            return 0

    def run_metric(self, key: str) -> float:
        try:
            return float(self._outbox.client.get_run(self.run_id).data.metrics.get(key, math.nan))
        except Exception:  # server unreachable: the caller goes on without the figure
            return math.nan

    def logged_epochs(self) -> set[int]:
        """Epochs already in the run: a resumed job skips re-logging them.

        If the server cannot say, every epoch is sent again; `rayapp import-metrics` and the
        outbox's per-record delivery keep that from mattering much, and no value is lost.
        """
        try:
            return {
                m.step
                for m in self._outbox.client.get_metric_history(self.run_id, EPOCH_MARKER_METRIC)
            }
        except Exception:
            return set()
