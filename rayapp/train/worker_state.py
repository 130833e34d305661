"""The per-worker state behind :class:`rayapp.train.context.TrainContext`: attempts and where the
ranks run, the epoch's clocks, and the end-of-epoch record (timings reduced over ranks, the
checkpoint, the MLflow epoch). TrainContext adds the API a loop calls on top of it."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from rayapp.spec import JobSpec
from rayapp.tracking.logger import NullLogger
from rayapp.tracking.run import (
    TAG_ATTEMPTS,
    TAG_EARLY_STOPPED,
    TAG_NODE_IDS,
    TAG_NODE_IPS,
    TAG_RESUMED_FROM_EPOCH,
)
from rayapp.train import checkpoint, collectives, heartbeat, socket_ifname, system_metrics
from rayapp.train.config import WorkerConfig
from rayapp.train.efficiency import EpochEfficiency, step_to_count
from rayapp.train.goodput import FirstStep, GoodputLedger
from rayapp.train.stepping import Stepper
from rayapp.train.strategies import Placement
from rayapp.train.timing import DdpCommClock, DeviceTimer, HostTimer, synchronize


class WorkerState:
    """One worker's attempt, epoch clocks and records; every rank has one."""

    _epoch_stopped: float | None
    """When this epoch's batches ran out (None until they have); set afresh for each epoch."""

    def __init__(
        self,
        config: WorkerConfig,
        logger: NullLogger,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        loop_started: float,
    ) -> None:
        self.config = config
        self.spec: JobSpec = config.spec
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = device
        self.logger = logger
        self._loop_started = loop_started
        self._loop_started_wall = time.time() - (time.perf_counter() - loop_started)
        self._placement: Placement | None = None
        self._comm_clock: DdpCommClock | None = None
        self._samplers: list[DistributedSampler] = []
        self._epoch: int | None = None
        self._epoch_metrics: dict[str, float] = {}
        self._history: list[dict] = []
        self._trained: nn.Module | None = None
        self._last_epoch: int | None = None
        # The epoch a `break` left: its logging and checkpoint wait for the loop to return.
        self._left_epoch: tuple[int, nn.Module, Any, Mapping[str, Any]] | None = None
        self._stop_requested = False
        self._attempt = 1
        self._stepper = Stepper(
            self.spec,
            device,
            logger,
            world_size=world_size,
            samples_seen=lambda: self._samples_before_epoch + self._samples,
        )
        self._system_monitor = None
        self._efficiency = EpochEfficiency(
            device=device,
            precision=self.spec.train.precision,
            logger=logger,
            counted_step=step_to_count(self.spec.train),
        )
        self._samples_before_epoch = self._samples = 0
        # -- goodput: the run's time ledger (restored from the checkpoint on a restart), and the
        # attempt's first step, which start-up or the restart owns rather than its epoch
        self._ledger = GoodputLedger()
        self._resumed = False
        self._attempt_stepped = False
        self._first_step: FirstStep | None = None
        self._background_write = checkpoint.BackgroundWrite()
        self._reset_epoch_clocks()
        self._heartbeat = heartbeat.start(config.watchdog, rank, config.heartbeat_s)

    @property
    def is_chief(self) -> bool:
        """Rank 0: the one rank that writes to MLflow and prints progress."""
        return self.rank == 0

    def tell(self, message: str) -> None:
        """A warning for the person at the submitting terminal (rank 0's)."""
        if self.is_chief:
            self.config.tell(message)

    # ---- internals --------------------------------------------------------------------

    def _resume(self, model: nn.Module, optimizer, stateful: Mapping[str, Any]) -> int:
        start, self._history = 0, []
        saved = checkpoint.restore(model, optimizer, stateful)
        self._resumed = saved is not None
        if saved is not None:
            self._ledger = GoodputLedger.from_saved(saved.get("goodput"))
            start, self._history = saved["epoch"] + 1, saved["history"]
            self._last_epoch = saved["epoch"]
            self.logger.set_tags({TAG_RESUMED_FROM_EPOCH: str(saved["epoch"])})
            if saved["stopped"]:  # the loop had stopped early there: nothing is left to train
                start = self.spec.train.epochs
        self.begin_attempt()
        # After a restart each epoch is logged once: epochs checkpointed whose metrics never
        # reached MLflow are logged from the checkpoint; epochs logged but not checkpointed (the
        # failure came between the two) are re-run from the checkpoint, deterministically, and not
        # logged again.
        self._already_logged = self.logger.logged_epochs() if self._attempt > 1 else set()
        for epoch, metrics in enumerate(self._history):
            if epoch not in self._already_logged:
                self.logger.log_epoch(epoch, metrics)
        return start

    def begin_attempt(self) -> int:
        """Count this attempt (restarts after failures) and record where every rank runs; a
        collective. :meth:`epochs` calls it; a loop without epochs (a script) calls it itself."""
        # Counted in the run itself, so a restart before the first checkpoint counts too.
        self._attempt = self.logger.previous_attempts() + 1
        node_ip = self._record_placement()
        if self.local_rank == 0 and self._system_monitor is None:
            self._system_monitor = system_metrics.start(
                run_id=self.config.run_id,
                tracking_uri=self.config.tracking_uri,
                node=node_ip,
                interval_s=self.spec.tracking.system_metrics_s,
                resume=self._attempt > 1,
            )
        # -- startup: from the cluster being ready until every worker's loop had started
        started = collectives.max_over_ranks([self._loop_started_wall], self.device)[0]
        if self._attempt == 1 and self.config.cluster_ready_at:
            self.logger.log_metrics({"startup_workers_s": started - self.config.cluster_ready_at})
        return self._attempt

    def finish_checkpoints(self) -> None:
        """Wait for the last checkpoint's background write (checkpoint.async), counted as
        checkpoint time; every rank calls it before the end-of-run records."""
        waited_from = time.perf_counter()
        self._background_write.wait()
        self._ledger.add_checkpoint(time.perf_counter() - waited_from)

    def goodput_parts(self) -> dict[str, float]:
        """The run's measured goodput parts so far (``goodput_*_s``; see rayapp.train.goodput)."""
        return {
            name: value for name, value in self._ledger.metrics().items() if math.isfinite(value)
        }

    def _first_step_done(self, compute_started: float) -> None:
        """The attempt's first step ended: start-up (first attempt) or the restart (later ones)
        ends here; a device sync, once per attempt, so the step's time is the device's."""
        synchronize(self.device)
        step = FirstStep(
            ended_at=time.time(),
            data_s=self._data_timer.total_s(),
            compute_s=time.perf_counter() - compute_started,
        )
        self._attempt_stepped, self._first_step = True, step
        # A restart with no checkpoint to resume from lost everything after the first attempt's
        # first step: the run's record of that step says when it was.
        startup_s = (
            self.logger.run_metric("time_to_first_step_s")
            if self._attempt > 1 and not self._resumed
            else math.nan
        )
        self._ledger.first_step(
            step,
            attempt=self._attempt,
            submitted_at=self.config.submitted_at,
            resumed=self._resumed,
            startup_s=startup_s,
        )
        if self._attempt == 1 or self._startup_lost_with_the_first_attempt():
            self.logger.log_metrics({"time_to_first_step_s": self._ledger.startup_s})

    def _startup_lost_with_the_first_attempt(self) -> bool:
        """The first attempt measured its start-up, but its workers were killed before their
        writer sent it: the checkpoint's ledger still has it, the run does not."""
        return math.isfinite(self._ledger.startup_s) and math.isnan(
            self.logger.run_metric("time_to_first_step_s")
        )

    def close(self) -> None:
        """Stop what the context started on this worker (the node's system-metrics sampler)."""
        system_metrics.stop(self._system_monitor)
        self._system_monitor = None
        self._heartbeat.close()

    def _record_placement(self) -> str:
        """Tag where every rank runs; returns this rank's node IP."""
        placed = collectives.placements(self.world_size)
        if self.spec.train.script is None:  # a script's epochs are its own: no figures per epoch
            node_ids = [node_id for node_id, _, _ in placed]
            self._efficiency.place(node_ids, self.rank, self.spec.train.collective_timeout_s)
        self.logger.set_tags(
            {
                TAG_NODE_IDS: ",".join(node_id for node_id, _, _ in placed),
                TAG_NODE_IPS: ",".join(ip for _, ip, _ in placed),
                socket_ifname.TAG_SOCKET_IFNAMES: ",".join(ifname for _, _, ifname in placed),
                TAG_ATTEMPTS: str(self._attempt),
            }
        )
        nodes_used = len({node_id for node_id, _, _ in placed})
        if self.spec.cluster.elastic and self.is_chief:
            self.config.say(
                f"elastic ({self.spec.cluster.nodes_label} nodes): training on "
                f"{nodes_used} node(s), world size {self.world_size}"
            )
        elif nodes_used != self.spec.cluster.nodes:
            # SPREAD (several workers per node) is a preference, not a rule: say where workers
            # landed.
            self.tell(
                f"workers landed on {nodes_used} node(s), not the {self.spec.cluster.nodes} asked "
                "for; per-node figures in this run do not describe that many nodes"
            )
        return placed[self.rank][1]

    def _reset_epoch_clocks(self) -> None:
        self._samples_before_epoch += self._samples
        self._data_timer = HostTimer()  # host-side waiting for batches: no device sync needed
        self._compute_timer = DeviceTimer(self.device, self.spec.train.timing_every)
        self._samples = 0
        self._epoch_stopped = None

    def _start_epoch(self, epoch: int) -> None:
        self._epoch, self._epoch_metrics = epoch, {}
        for sampler in self._samplers:
            sampler.set_epoch(epoch)
        self._reset_epoch_clocks()
        if self._comm_clock is not None:
            self._comm_clock.take_total_s()  # drop anything recorded outside this epoch
        synchronize(self.device)
        self._epoch_started = time.perf_counter()

    def _leave_epoch(self, model: nn.Module) -> None:
        """The loop left the current epoch early: its clock stops here and the model is the
        trained one; nothing collective (see :meth:`epochs`)."""
        self._trained = model
        if self._epoch_stopped is None:
            synchronize(self.device)
            self._epoch_stopped = time.perf_counter()

    def _end_epoch(
        self,
        epoch: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        stateful: Mapping[str, Any],
        *,
        leaving: bool,
    ) -> bool:
        """Time, checkpoint and log the current epoch on every rank; returns whether the ranks
        agreed to stop after it (one rank's `break` or :meth:`stop` is enough)."""
        if self._epoch_stopped is None:
            synchronize(self.device)
            self._epoch_stopped = time.perf_counter()
        epoch_time = self._epoch_stopped - self._epoch_started
        comm_time = self._comm_clock.take_total_s() if self._comm_clock is not None else math.nan
        # a sampled estimate; the all-reduce runs within the compute phase, so never above it
        comm_time = min(comm_time, self._compute_timer.total_s())
        # -- timing: the slowest rank's; samples: all ranks'; stopping: any rank's, in the same
        # all-reduce, so every rank reports and checkpoints this epoch and then stops alike
        epoch_time, compute_time, data_time, comm_time, peak_mem, stopping = (
            collectives.max_over_ranks(
                [
                    epoch_time,
                    self._compute_timer.total_s(),
                    self._data_timer.total_s(),
                    comm_time,
                    collectives.peak_memory_mb(self.device),
                    float(leaving or self._stop_requested),
                ],
                self.device,
            )
        )
        samples = collectives.sum_over_ranks(self._samples, self.device)
        first_step, self._first_step = self._first_step, None
        self._ledger.add_epoch(
            compute_s=compute_time, comm_s=comm_time, data_s=data_time, first_step=first_step
        )
        metrics = {
            **self._epoch_metrics,  # the loop's own (loss, test_accuracy, ...)
            "epoch_time_s": epoch_time,
            "samples_per_s": samples / epoch_time if epoch_time > 0 else 0.0,
            "compute_time_s": compute_time,
            "comm_time_s": comm_time,
            "data_time_s": data_time,
            "peak_mem_mb": peak_mem,
            "world_size": float(self.world_size),
        }
        metrics.update(  # tflops_per_s, mfu, peak_tflops, each rank's step times
            self._efficiency.epoch_metrics(
                samples=self._samples,
                step_times_s=self._compute_timer.step_times_s(),
                epoch_time_s=epoch_time,
                rank=self.rank,
            )
        )
        self._history.append(metrics)
        # -- checkpoint first, then MLflow: a failure between them re-logs from the checkpoint on
        # resume
        every, last = self.spec.checkpoint.every_epochs, self.spec.train.epochs - 1
        stopped_early = bool(stopping) and epoch < last
        save_now = (epoch + 1) % every == 0 or epoch == last or stopped_early
        saving_started = time.perf_counter()
        if not save_now:
            # Ray Train passes reports on in order, so this one would wait for the previous async
            # save's write anyway: waited for here, that is counted as checkpoint time.
            self._background_write.wait()
            self._ledger.add_checkpoint(time.perf_counter() - saving_started)
        checkpoint.report_epoch(
            self.spec,
            metrics,
            save_now=save_now,
            model=model,
            optimizer=optimizer,
            extra=stateful,
            history=self._history,
            epoch=epoch,
            run_id=self.config.run_id,
            rank=self.rank,
            stopped=stopped_early,
            goodput=self._ledger.to_saved(time.time()),
            background=self._background_write,
        )
        if save_now:  # what training waited for: all of a sync save, the staging of an async one
            self._ledger.add_checkpoint(time.perf_counter() - saving_started)
        self._last_epoch = epoch
        self._heartbeat.mark(epoch_ended=True)
        if epoch not in self._already_logged:
            if save_now:
                metrics = {**metrics, "checkpoint_time_s": time.perf_counter() - saving_started}
            self.logger.log_epoch(epoch, metrics)
        if self.is_chief:
            self.config.send_progress({"epoch": epoch, **metrics})
        if stopped_early:
            self.logger.set_tags({TAG_EARLY_STOPPED: "true"})
            if self.is_chief:
                self.config.say(f"stopped early after epoch {epoch + 1}/{self.spec.train.epochs}")
        return bool(stopping)


def batch_size_of(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 0
