"""The training context: what rayapp gives a training loop on each worker.

rayapp's built-in loop (:mod:`rayapp.train.loop`) and users' own loops (``train.loop:
"mytrain:train_loop"``) are written against the same object, so both get, without extra code:
the job's strategy applied to the model, sharded loaders, an epoch iterator that resumes after
a restart and skips epochs already done, phase timers that feed the standard per-epoch metrics,
one checkpoint per epoch through Ray Train, and logging into the job's one MLflow run with every
epoch logged exactly once. A loop looks like this::

    def train_loop(ctx: TrainContext) -> None:
        model = ctx.prepare(MyModel(**ctx.args))
        optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.spec.train.lr)
        loader = ctx.loader(my_dataset)
        for epoch in ctx.epochs(model, optimizer):
            for inputs, targets in ctx.batches(loader):
                with ctx.compute():
                    with ctx.autocast():                    # train.precision: bf16/fp16
                        loss = F.cross_entropy(model(inputs), targets)
                    ctx.backward(loss)                      # fp16 loss scaling, accumulation
                    ctx.step(optimizer)                     # clipping; steps every grad_accum_steps
            ctx.log_epoch({"loss": ctx.mean(loss)})

A loop may also call ``loss.backward()`` and ``optimizer.step()`` itself; ctx.backward/ctx.step
add what the job's settings ask for (precision, accumulation, clipping, step-level metrics).

Stopping early: ``break`` out of :meth:`TrainContext.epochs` on every rank at the same epoch (decide
from figures every rank shares, such as :meth:`TrainContext.mean`), or call
:meth:`TrainContext.stop` on any rank and let the loop run out. Either way the last epoch is logged
and checkpointed, ``trained_model`` is set and the run ends FINISHED, tagged
``rayapp.early_stopped``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset

from rayapp.spec.mesh import is_tensor_parallel, uses_mesh
from rayapp.tracking.run import TAG_MESH
from rayapp.train import checkpoint, collectives
from rayapp.train.comm_bytes import CollectiveBytes
from rayapp.train.data import build_loader, shard_sampler
from rayapp.train.mesh import build_mesh, describe
from rayapp.train.strategies import Placement, apply_strategy, local_parameter_bytes
from rayapp.train.timing import DdpCommClock, synchronize
from rayapp.train.worker_state import WorkerState, batch_size_of

COMM_COUNTED_STEP = 1
"""The step of each epoch (from 0) whose collectives are counted as comm_bytes_per_step."""


class TrainContext(WorkerState):
    """One worker's view of the job. Every rank runs the loop; only rank 0 writes to MLflow."""

    _mesh: DeviceMesh | None = None
    _comm_epoch: int | None = -1  # the epoch whose steps _comm_steps counts
    _comm_steps = 0

    # ---- what a loop reads ------------------------------------------------------------

    @property
    def args(self) -> Mapping[str, Any]:
        """The job's own arguments (``train.args`` in the job YAML)."""
        return getattr(self.spec.train, "args", None) or {}

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far in this attempt (counted by :meth:`step`)."""
        return self._stepper.global_step

    @property
    def mesh(self) -> DeviceMesh:
        """The run's 2-D device mesh, dims ``replicate`` (nodes) and ``shard`` (the workers of a
        node); built once, on first use (a collective: every rank asks for it at the same point,
        as :meth:`prepare` does under hsdp, tp and fsdp+tp)."""
        if self._mesh is None:
            self._mesh = build_mesh(
                world_size=self.world_size,
                workers_per_node=self.spec.cluster.workers_per_node,
                device=self.device,
            )
        return self._mesh

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the data this rank reads: its rank, but under tp and fsdp+tp its node's
        (the workers of a node split each layer, so they take the same batches)."""
        if is_tensor_parallel(self.spec.train.strategy):
            return self.mesh.get_local_rank("replicate")
        return self.rank

    @property
    def data_parallel_size(self) -> int:
        """How many shares the data is split into (see :attr:`data_parallel_rank`)."""
        return self.spec.data_parallel_at(self.world_size)

    @property
    def input_device(self) -> torch.device:
        return self._placement.input_device if self._placement else self.device

    @property
    def output_device(self) -> torch.device:
        return self._placement.output_device if self._placement else self.device

    # ---- set-up -----------------------------------------------------------------------

    def prepare(self, model: nn.Module) -> nn.Module:
        """The job's strategy (train.strategy: ddp, fsdp, ...) applied to `model`, on this
        worker's device."""
        mesh = self.mesh if uses_mesh(self.spec.train.strategy) else None
        placement = apply_strategy(self.spec, model, self.device, mesh)
        if mesh is not None:
            self.logger.set_tags({TAG_MESH: describe(mesh)})
        # NaN for strategies without DDP's reducer
        self._comm_clock = DdpCommClock(placement.model, every=self.spec.train.timing_every)
        self._efficiency.watch(model, placement.model, lambda: self._compute_timer.mark_ready())
        if self.spec.train.compile:
            # After the strategy: DDP's optimizer splits the graph at its buckets, FSDP2 compiles
            # through.
            compiled = cast(nn.Module, torch.compile(placement.model))  # an OptimizedModule
            placement = Placement(compiled, placement.input_device, placement.output_device)
        self._placement = placement
        return placement.model

    def loader(
        self,
        dataset: Dataset,
        *,
        batch_size: int | None = None,
        shuffle: bool = True,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """This rank's shard of `dataset` (DistributedSampler, reshuffled each epoch by
        :meth:`epochs`), in batches of `batch_size` (default: the job's per-worker batch); every
        rank takes the same number of steps (the last incomplete batch is dropped)."""
        loader = build_loader(
            self.spec,
            dataset,
            rank=self.data_parallel_rank,
            world_size=self.data_parallel_size,
            batch_size=batch_size or self.spec.batch_size_at(self.world_size),
            shuffle=shuffle,
            pin_memory=self.device.type == "cuda",
            **loader_kwargs,
        )
        self._samplers.append(shard_sampler(loader))
        return loader

    def measure_comm_with(self, clock: Any) -> None:
        """Take ``comm_time_s`` from `clock` (``step_finished()``, ``take_total_s()``) instead of
        DDP's reducer: a strategy that communicates on its own (pipeline send/recv) times itself."""
        self._comm_clock = clock

    @property
    def trained_model(self) -> nn.Module | None:
        """The model :meth:`epochs` trained, once the loop over it has ended (run out, stopped,
        or left with ``break``); None before."""
        return self._trained

    @property
    def last_epoch(self) -> int | None:
        """The last epoch :meth:`epochs` finished (logged and reported); None before the first."""
        return self._last_epoch

    # ---- the epoch loop ---------------------------------------------------------------

    def epochs(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **stateful: Any
    ) -> Iterator[int]:
        """The epochs left to train: resumes `model`, `optimizer` and any other `stateful` object
        (anything with state_dict/load_state_dict, e.g. an LR scheduler) from the last checkpoint
        after a restart. After each epoch's body it takes the timings, logs the epoch once, and
        checkpoints.

        Stopping early: after :meth:`stop`, this is the last epoch; after ``break``, the epoch
        left is logged and checkpointed when the job's loop returns (the ranks meet in collectives
        there, so every rank must break at the same epoch). Either way the run is tagged
        ``rayapp.early_stopped`` and ends FINISHED."""
        start = self._resume(model, optimizer, stateful)
        for epoch in range(start, self.spec.train.epochs):
            self._start_epoch(epoch)
            self._left_epoch = (epoch, model, optimizer, stateful)
            try:
                yield epoch
            except GeneratorExit:
                # `break` (or an exception) left the loop in this epoch. Which of the two is not
                # visible here, so nothing collective or recorded happens now: an exception must
                # fail the epoch, not checkpoint it. end_loop() finishes the epoch once the loop
                # has returned normally; an exception never gets there.
                self._leave_epoch(model)
                raise
            self._left_epoch = None
            if self._end_epoch(epoch, model, optimizer, stateful, leaving=False):
                break
        self._trained = model
        self._epoch = None

    def stop(self) -> None:
        """Make the current epoch the last: it is logged and checkpointed as usual, then
        :meth:`epochs` ends on every rank (the ranks agree at the epoch's end, so a call on one
        rank is enough)."""
        self._stop_requested = True

    def end_loop(self) -> None:
        """After the job's loop returned: log and checkpoint the epoch a ``break`` left (a
        collective, as at every epoch's end). rayapp calls it on every rank."""
        if self._left_epoch is None:
            return
        epoch, model, optimizer, stateful = self._left_epoch
        self._leave_epoch(model)
        self._end_epoch(epoch, model, optimizer, stateful, leaving=True)
        self._epoch = None

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """Batches of `loader` moved to the model's devices (inputs to where the model takes them,
        the last tensor, the target, to where the loss is taken), with the wait timed as
        ``data_time_s``. The epoch's clock (``epoch_time_s``) stops when the loader is exhausted,
        so evaluation after the step loop is not counted as training time."""
        iterator = iter(loader)
        while True:
            self._heartbeat.mark()  # the step before (or the loader's start): the watchdog's news
            self._data_timer.start()
            self._compute_timer.mark_step_begin()
            try:
                batch = next(iterator)
            except StopIteration:
                self._data_timer.stop()
                break
            batch = self._to_devices(batch)
            self._data_timer.stop()
            if self._counts_samples:
                self._samples += batch_size_of(batch)
            yield batch
        if self._epoch_stopped is None:
            synchronize(self.device)
            self._epoch_stopped = time.perf_counter()

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Times one training step (forward, backward, optimizer step) as ``compute_time_s``. With
        gradient accumulation, a micro-step that does not end in an optimizer step skips the
        gradient all-reduce (DDP's no_sync, FSDP's requires_gradient_sync)."""
        first_step_started = None if self._attempt_stepped else time.perf_counter()
        self._compute_timer.start()
        counter = self._comm_counter_for_this_step()
        with (
            counter,
            self._stepper.gradient_sync(self._placement.model if self._placement else None),
            self._efficiency.counting_step(lambda: self._samples_before_epoch + self._samples),
        ):
            yield
            if self._comm_clock is not None:  # inside: DDP's no_sync still says if it all-reduced
                self._comm_clock.step_finished()
        self._compute_timer.stop()
        self._heartbeat.mark()  # a loop with a loader of its own marks its steps here
        if isinstance(counter, CollectiveBytes):
            self._epoch_metrics["comm_bytes_per_step"] = float(counter.total)
        if first_step_started is not None:  # logs time_to_first_step_s on the first attempt
            self._first_step_done(first_step_started)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for the forward pass (train.precision bf16/fp16); a no-op for fp32."""
        return self._stepper.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), averaged over train.grad_accum_steps micro-steps, scaled under fp16."""
        self._stepper.backward(loss)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Every train.grad_accum_steps calls: clip (train.grad_clip), step, zero the gradients, and
        log step-level metrics when due (tracking.log_every_steps). Returns whether it stepped."""
        return self._stepper.step(optimizer)

    # ---- logging ----------------------------------------------------------------------

    def mean(self, value: torch.Tensor | float) -> float:
        """The mean of a per-rank value over all ranks (a collective: every rank must call it)."""
        return collectives.mean_over_ranks(value, self.device)

    def log_epoch(self, metrics: Mapping[str, float]) -> None:
        """Metrics of the current epoch (rank 0's values are logged); they go to MLflow with the
        standard timings when the epoch ends, at step = epoch."""
        self._epoch_metrics.update({key: float(value) for key, value in metrics.items()})

    def log_step(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Step-level metrics (rank 0's) at `step`, default the global step."""
        self.logger.log_metrics(
            {k: float(v) for k, v in metrics.items()},
            step=self.global_step if step is None else step,
        )

    def final_model_state(self) -> dict | None:
        """The trained model's full state on CPU, gathered once, at the end (a collective under
        FSDP: every rank calls it); None when the loop trained no model through :meth:`epochs`."""
        return checkpoint.full_model_state(self._trained) if self._trained is not None else None

    @property
    def prepared(self) -> bool:
        """Whether the loop gave rayapp its model (:meth:`prepare`)."""
        return self._placement is not None

    def parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds (its shard under FSDP)."""
        return local_parameter_bytes(self._placement.model) if self._placement else 0

    @property
    def _counts_samples(self) -> bool:
        """Whether this rank's batches count as samples trained: under tp and fsdp+tp the workers
        of a node share each batch, so only the first of them counts it."""
        return not is_tensor_parallel(self.spec.train.strategy) or (
            self.mesh.get_local_rank("shard") == 0
        )

    def _comm_counter_for_this_step(self) -> contextlib.AbstractContextManager:
        """The epoch's second step (the first may set up the strategy's buffers) counts the bytes
        its collectives move (comm_bytes_per_step); the others run unwatched."""
        if self._comm_epoch != self._epoch:
            self._comm_epoch, self._comm_steps = self._epoch, 0
        self._comm_steps += 1
        return (
            CollectiveBytes()
            if self._comm_steps == COMM_COUNTED_STEP + 1
            else contextlib.nullcontext()
        )

    def _to_devices(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.input_device, non_blocking=True)
        if (
            isinstance(batch, (list, tuple))
            and batch
            and all(isinstance(t, torch.Tensor) for t in batch)
        ):
            *inputs, target = batch
            moved = [t.to(self.input_device, non_blocking=True) for t in inputs]
            moved.append(target.to(self.output_device, non_blocking=True))
            return type(batch)(moved) if isinstance(batch, tuple) else moved
        return batch
