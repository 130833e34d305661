"""The hang watchdog: ends a run in which no rank finishes a step, and says which rank is stuck.

Every rank counts its finished steps and epochs and a thread of its own sends the count every
few seconds (:mod:`rayapp.train.heartbeat`) to a small actor on the driver's node, which notes
when each rank's count last moved, on its own clock (the nodes' clocks need not agree). A thread
in the driver reads those notes; when no rank has moved for the hang timeout, it

1. reads every rank's Python stack on the rank's node (:mod:`rayapp.driver.stacks`) and logs it
   to the MLflow run as ``hang/rank<N>.txt``; a rank whose heartbeat has stopped as well (its
   process or node gone, or cut off from the network) is not waited for: no task reaches it;
2. names the ranks and nodes outside the collective the others wait in
   (:mod:`rayapp.driver.hang_verdict`), tags the run ``rayapp.failure=hang`` and
   ``rayapp.hung_ranks``, and says so at the terminal;
3. kills every rank's process it can reach, so Ray Train restarts the workers from the last
   checkpoint while ``max_failures`` allows, or the run fails with
   :meth:`HangWatch.failure_line`.

The hang timeout (``train.hang_timeout_s``, ``--hang-timeout``): 0 turns the watchdog off; unset,
it is 600 s until some rank has finished an epoch, then 10 times the longest pause between two
steps (or a step and an epoch's end, which covers evaluation and checkpoints) any rank has had so
far, and at least 300 s. A script (``train.script``) reports no steps, so it is not watched.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from rayapp.driver import stacks
from rayapp.driver.hang_verdict import Verdict, judge

if TYPE_CHECKING:  # the heartbeat actor imports this module: only the standard library at import
    from rayapp.spec import JobSpec

DEFAULT_HANG_TIMEOUT_S = 600.0
SIZED_FACTOR = 10.0
SIZED_FLOOR_S = 300.0
POLL_S = 2.0
MAX_HEARTBEAT_S = 5.0
SILENT_BEATS = 3
"""A rank that has sent no heartbeat for this many intervals (and at least SILENT_MIN_S) is
silent: its process or node is gone or cut off, so no task would reach it."""
SILENT_MIN_S = 10.0
TAG_FAILURE = "rayapp.failure"
TAG_HUNG_RANKS = "rayapp.hung_ranks"
TAG_HUNG_NODES = "rayapp.hung_nodes"
TIMEOUT_WORDS = ("timed out", "timeout")
COLLECTIVE_WORDS = ("gloo", "nccl", "collective", "c10d", "processgroup", "allreduce", "barrier")
"""An error that has a word of each list is a collective's timeout (Gloo: "Timed out waiting
20000ms for recv operation", NCCL: "Watchdog caught collective operation timeout")."""


def hang_timeout_s(configured: float | None, ranks: Mapping[int, Mapping[str, Any]]) -> float:
    """The timeout in force now (see the module's docstring); 0 when the watchdog is off."""
    if configured is not None:
        return configured
    if not any(report.get("epochs", 0) > 0 for report in ranks.values()):
        return DEFAULT_HANG_TIMEOUT_S
    longest = max(float(report.get("longest_gap_s", 0.0)) for report in ranks.values())
    return max(SIZED_FLOOR_S, SIZED_FACTOR * longest)


def heartbeat_interval_s(configured: float | None) -> float:
    """A few beats per timeout, so a hang is seen within the timeout plus one beat and a poll."""
    if not configured:
        return MAX_HEARTBEAT_S
    return min(MAX_HEARTBEAT_S, max(0.5, configured / 8))


def silent_ranks(ranks: Mapping[int, Mapping[str, Any]], heartbeat_s: float) -> set[int]:
    """The ranks whose heartbeats stopped arriving (a rank waiting in a collective still beats:
    its heartbeat thread runs while the training thread waits)."""
    limit = max(SILENT_MIN_S, SILENT_BEATS * heartbeat_s)
    return {rank for rank, report in ranks.items() if report.get("silent_s", 0.0) >= limit}


def is_hung(ranks: Mapping[int, Mapping[str, Any]], timeout_s: float) -> bool:
    """No rank has finished a step (or an epoch) for `timeout_s`."""
    return bool(ranks) and timeout_s > 0 and min(r["idle_s"] for r in ranks.values()) >= timeout_s


class Beats:
    """The actor the ranks' heartbeats go to: each rank's last report, how long since its count
    of steps last moved and how long since it last beat at all, on this actor's clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ranks: dict[int, dict[str, Any]] = {}
        self._moved_at: dict[int, float] = {}
        self._beat_at: dict[int, float] = {}

    def beat(self, report: dict[str, Any]) -> None:
        rank, now = report["rank"], self._clock()
        previous = self._ranks.get(rank)
        if previous is not None and previous["token"] != report["token"]:
            # A new worker group (Ray Train restarted the workers): the old group's notes go.
            self.forget()
            previous = None
        if previous is None or previous["marks"] != report["marks"]:
            self._moved_at[rank] = now
        self._beat_at[rank] = now
        self._ranks[rank] = report

    def snapshot(self) -> dict[int, dict[str, Any]]:
        now = self._clock()
        return {
            rank: {
                **report,
                "idle_s": now - self._moved_at[rank],
                "silent_s": now - self._beat_at[rank],
            }
            for rank, report in self._ranks.items()
        }

    def forget(self) -> None:
        self._ranks, self._moved_at, self._beat_at = {}, {}, {}


class HangWatch:
    """The driver's side: the actor for the ranks, and the thread that watches it."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        tracking_uri: str,
        run_id: str,
        status: Callable[[str], None],
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._configured = spec.train.hang_timeout_s
        self._tracking_uri, self._run_id, self._status = tracking_uri, run_id, status
        # num_cpus=0 and on the driver's node, as the progress queue: it never competes with the
        # workers for a slot, and a lost worker node does not take it along.
        self.actor: Any = (
            ray.remote(Beats)
            .options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=ray.get_runtime_context().get_node_id(), soft=False
                ),
            )
            .remote()
        )
        self.heartbeat_s = heartbeat_interval_s(self._configured)
        self.verdict: Verdict | None = None
        self.timeout_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rayapp-watchdog", daemon=True)
        self._thread.start()

    def failure_line(self) -> str | None:
        """The one line a failed run ends with after a hang; None when none was seen."""
        if self.verdict is None:
            return None
        return (
            f"hung: no rank finished a step for {self.timeout_s:.0f} s; {self.verdict.summary()}; "
            f"every rank's stack is in the run's artifacts, hang/"
        )

    def close(self) -> None:
        import ray

        self._stop.set()
        self._thread.join(timeout=POLL_S + stacks.TASK_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)

    def _watch(self) -> None:
        import ray

        while not self._stop.wait(POLL_S):
            try:
                ranks: dict[int, dict[str, Any]] = ray.get(self.actor.snapshot.remote(), timeout=30)
            except Exception:  # the cluster is going down with the job
                continue
            timeout = hang_timeout_s(self._configured, ranks)
            if is_hung(ranks, timeout) and not self._stop.is_set():
                self.timeout_s = timeout
                self._end_hang(ranks)

    def _end_hang(self, ranks: dict[int, dict[str, Any]]) -> None:
        import ray

        self._status(
            f"no rank finished a step for {self.timeout_s:.0f} s: reading every rank's stack"
        )
        # A rank that stopped beating is not waited for (a task for it would wait out
        # stacks.TASK_TIMEOUT_S, and the end of the hang with it): it is named for what it is.
        silent = silent_ranks(ranks, self.heartbeat_s)
        for rank in silent:
            ranks[rank]["silent"] = True
            ranks[rank]["no_stack"] = (
                f"no heartbeat for {ranks[rank]['silent_s']:.0f} s: its process or node is gone, "
                "or cut off from the network"
            )
        reachable = {rank: report for rank, report in ranks.items() if rank not in silent}
        dumps: dict[int, Any] = stacks.on_each_rank_node(stacks.dump_stack, reachable)
        texts = {
            rank: dump if isinstance(dump, str) else f"no stack read: {dump}\n"
            for rank, dump in dumps.items()
        }
        texts.update({rank: f"no stack read: {ranks[rank]['no_stack']}\n" for rank in silent})
        verdict = judge({r: t for r, t in dumps.items() if isinstance(t, str)}, ranks)
        self.verdict = verdict
        self._record(texts, verdict)
        self._status(f"hang: {verdict.summary()}")
        # Every rank it can reach, not only the culprits: Ray Train replaces the whole worker
        # group anyway, and a rank left waiting in a collective would hold up its teardown
        # (destroying its process group waits for the collective, up to Ray Train's 30 s
        # shutdown timeout).
        stacks.on_each_rank_node(stacks.kill_process, reachable)
        # Wait for the next worker group (a restart) or the end; the old notes would read as hung.
        with contextlib.suppress(Exception):
            ray.get(self.actor.forget.remote(), timeout=30)

    def _record(self, texts: Mapping[int, str], verdict: Verdict) -> None:
        """The stacks as artifacts, the verdict as tags; MLflow unreachable: said, not fatal."""
        from mlflow import MlflowClient

        try:
            client = MlflowClient(self._tracking_uri)
            for rank, text in sorted(texts.items()):
                header = f"# rank {rank}, node {verdict.nodes.get(rank, '?')}: "
                header += f"{verdict.where.get(rank, '')}\n"
                client.log_text(self._run_id, header + text, f"hang/rank{rank}.txt")
            client.set_tag(self._run_id, TAG_FAILURE, "hang")
            client.set_tag(self._run_id, TAG_HUNG_RANKS, ",".join(map(str, verdict.hung_ranks)))
            client.set_tag(
                self._run_id,
                TAG_HUNG_NODES,
                ",".join(sorted({verdict.nodes.get(r, "?") for r in verdict.hung_ranks})),
            )
        except Exception as exc:
            self._status(f"could not log the hang's stacks to MLflow ({type(exc).__name__})")


@contextlib.contextmanager
def hang_watch(
    spec: JobSpec, *, tracking_uri: str, run_id: str, status: Callable[[str], None]
) -> Iterator[HangWatch | None]:
    """A watchdog for the job's run, or None where it is off (hang_timeout_s 0, a script)."""
    if spec.train.hang_timeout_s == 0 or spec.train.script is not None:
        yield None
        return
    watch = HangWatch(spec, tracking_uri=tracking_uri, run_id=run_id, status=status)
    try:
        yield watch
    finally:
        watch.close()


def explain_collective_timeout(cause: str, spec: JobSpec) -> str:
    """A collective that timed out says only that; add what it means and the setting behind it."""
    lowered = cause.lower()
    if not (
        any(word in lowered for word in TIMEOUT_WORDS)
        and any(word in lowered for word in COLLECTIVE_WORDS)
    ):
        return cause
    return (
        f"{cause} (a collective waited past train.collective_timeout_s = "
        f"{spec.train.collective_timeout_s:g} s for a peer rank that was lost or stuck)"
    )


def heartbeat_settings(watch: HangWatch | None) -> dict[str, Any]:
    """The WorkerConfig fields that point every rank's heartbeat at `watch`."""
    if watch is None:
        return {}
    return {"watchdog": watch.actor, "heartbeat_s": watch.heartbeat_s}
