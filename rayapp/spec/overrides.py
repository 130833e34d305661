"""Command-line overrides of the job spec, declared once.

Each row names a flag, the spec field it overrides, its type and its help. The CLI turns rows into
Click options (:mod:`rayapp.cli.flags`) and :func:`overrides_from_flags` turns parsed flags back
into the ``section.field`` overrides :func:`rayapp.spec.loader.build_spec` takes, so a flag cannot
be declared in one place and mapped in another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rayapp.spec.catalog import STRATEGIES
from rayapp.spec.cluster import BACKENDS
from rayapp.spec.job import PRECISIONS, SCALINGS
from rayapp.spec.pipeline import SCHEDULES


@dataclass(frozen=True)
class Override:
    flag: str
    """The long option, e.g. ``--nodes``."""
    field: str
    """The spec field it overrides, ``section.name``."""
    type: type
    help: str

    @property
    def dest(self) -> str:
        """The keyword Click passes the value as (``--workers-per-node`` -> ``workers_per_node``)."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def full_help(self) -> str:
        return f"{self.help} [{self.field}]"


def _choices(names: tuple[str, ...]) -> str:
    return "|".join(names)


OVERRIDES: tuple[Override, ...] = (
    Override(
        "--nodes",
        "cluster.nodes",
        str,
        "Ray nodes to spread workers over; MIN:MAX (e.g. 1:2) for elastic training.",
    ),
    Override(
        "--workers-per-node", "cluster.workers_per_node", int, "Training workers on each node."
    ),
    Override(
        "--backend",
        "cluster.backend",
        str,
        f"torch.distributed backend: {_choices(BACKENDS)}; auto = nccl on GPUs, gloo on CPUs.",
    ),
    Override(
        "--strategy", "train.strategy", str, f"Parallel strategy: {_choices(STRATEGIES.names())}."
    ),
    Override(
        "--pp-stages",
        "train.pipeline.stages",
        int,
        "Strategy pp: pipeline stages, one per worker (default: the world size).",
    ),
    Override(
        "--microbatches",
        "train.pipeline.microbatches",
        int,
        "Strategy pp: micro-batches each batch is split into (>= stages keeps the bubble small).",
    ),
    Override(
        "--pp-schedule",
        "train.pipeline.schedule",
        str,
        f"Strategy pp: schedule, {_choices(SCHEDULES)}.",
    ),
    Override("--scaling", "train.scaling", str, f"{_choices(SCALINGS)} scaling."),
    Override("--epochs", "train.epochs", int, "Epochs to train."),
    Override("--batch-size", "train.batch_size", int, "Per-worker batch, weak scaling."),
    Override(
        "--global-batch-size", "train.global_batch_size", int, "Global batch, strong scaling."
    ),
    Override("--lr", "train.lr", float, "Learning rate."),
    Override("--seed", "train.seed", int, "Seed for data, weights and shuffling."),
    Override("--experiment", "tracking.experiment", str, "MLflow experiment name."),
    Override(
        "--tracking-uri",
        "tracking.tracking_uri",
        str,
        "MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.",
    ),
    Override(
        "--address",
        "cluster.address",
        str,
        "Existing Ray cluster: HOST:PORT or 'auto' to run here, http://HEAD:8265 to submit through the "
        "Ray Jobs API; none starts an embedded one.",
    ),
    Override(
        "--storage-path",
        "cluster.storage_path",
        str,
        "Checkpoint storage, shared on real clusters.",
    ),
    Override("--max-failures", "cluster.max_failures", int, "Worker failures to recover from."),
    Override("--cpus-per-worker", "cluster.cpus_per_worker", int, "CPUs reserved per worker."),
    Override(
        "--precision",
        "train.precision",
        str,
        f"{_choices(PRECISIONS)}; bf16/fp16 train in mixed precision.",
    ),
    Override(
        "--compile", "train.compile", bool, "torch.compile the model (after the strategy wraps it)."
    ),
    Override(
        "--checkpoint-every",
        "checkpoint.every_epochs",
        int,
        "Checkpoint after every K-th epoch (and always after the last).",
    ),
    Override(
        "--log-every-steps", "tracking.log_every_steps", int, "Log step_loss every N steps; 0: off."
    ),
    Override(
        "--system-metrics-interval",
        "tracking.system_metrics_s",
        float,
        "Seconds between per-node CPU/memory/network/GPU samples; 0: off.",
    ),
    Override(
        "--working-dir",
        "cluster.working_dir",
        str,
        "Directory of your code, shipped to every worker; default: the job file's directory.",
    ),
    Override(
        "--script",
        "train.script",
        str,
        "Run this torchrun-style script on every worker instead of a loop; its arguments follow --.",
    ),
)
BY_FLAG: Mapping[str, Override] = {row.flag: row for row in OVERRIDES}
BY_DEST: Mapping[str, Override] = {row.dest: row for row in OVERRIDES}


def overrides_from_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Parsed flags (Click's keyword names) -> ``{"section.field": value}``; other keys are ignored."""
    return {BY_DEST[name].field: value for name, value in flags.items() if name in BY_DEST}


def rows(*flags: str) -> tuple[Override, ...]:
    """The rows for these flags, in the order given (a command that takes only some of them)."""
    return tuple(BY_FLAG[flag] for flag in flags)
