"""Command-line overrides of the job spec: which fields have a flag, and under what name.

Everything else about a flag comes from its field, declared once in the spec: the type its text
is read as, the choices of a ``Literal`` field, and the help (the field's description, as
``rayapp schema`` shows it). The CLI turns these rows into Click options (:mod:`rayapp.cli.flags`)
and :func:`overrides_from_flags` turns parsed flags back into the ``section.field`` overrides
:func:`rayapp.spec.loader.build_spec` takes, so a flag cannot be declared in one place and
mapped in another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rayapp.spec.loader import job_schema
from rayapp.spec.messages import Schema, field_schema


@dataclass(frozen=True)
class Override:
    flag: str
    """The long option, e.g. ``--nodes``."""
    field: str
    """The spec field it overrides, ``section.name``."""
    type: type
    """What the flag's text is read as: int, float, str, or bool (an on/off flag pair)."""
    help: str
    choices: tuple[str, ...] = ()
    """A ``Literal`` field's values."""
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """Click's keyword for the value (``--workers-per-node`` -> ``workers_per_node``)."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def full_help(self) -> str:
        return f"{self.help} [{self.field}]"


FLAGS: tuple[tuple[str, str], ...] = (
    ("--nodes", "cluster.nodes"),
    ("--workers-per-node", "cluster.workers_per_node"),
    ("--backend", "cluster.backend"),
    ("--strategy", "train.strategy"),
    ("--pp-stages", "train.pipeline.stages"),
    ("--microbatches", "train.pipeline.microbatches"),
    ("--pp-schedule", "train.pipeline.schedule"),
    ("--scaling", "train.scaling"),
    ("--epochs", "train.epochs"),
    ("--batch-size", "train.batch_size"),
    ("--global-batch-size", "train.global_batch_size"),
    ("--lr", "train.lr"),
    ("--seed", "train.seed"),
    ("--experiment", "tracking.experiment"),
    ("--tracking-uri", "tracking.tracking_uri"),
    ("--address", "cluster.address"),
    ("--storage-path", "cluster.storage_path"),
    ("--max-failures", "cluster.max_failures"),
    ("--cpus-per-worker", "cluster.cpus_per_worker"),
    ("--precision", "train.precision"),
    ("--compile", "train.compile"),
    ("--checkpoint-every", "checkpoint.every_epochs"),
    ("--log-every-steps", "tracking.log_every_steps"),
    ("--system-metrics-interval", "tracking.system_metrics_s"),
    ("--working-dir", "cluster.working_dir"),
    ("--script", "train.script"),
    ("--hang-timeout", "train.hang_timeout_s"),
    ("--register-model", "tracking.register_model"),
)
"""Flag and field, in the order `--help` lists them."""
METAVARS = {"--nodes": "N|MIN:MAX", "--hang-timeout": "SECONDS", "--register-model": "NAME"}
_TYPES: dict[str, type] = {"boolean": bool, "integer": int, "number": float}


def _override(flag: str, field: str, root: Schema) -> Override:
    schema = field_schema(root, field)
    members = [m for m in schema.get("anyOf", [schema]) if m.get("type") != "null"]
    kinds = [_TYPES.get(m.get("type", ""), str) for m in members]
    value_type = next((kind for kind in (bool, int, float) if kind in kinds), str)
    choices = tuple(str(v) for m in members for v in m.get("enum", ()))
    return Override(
        flag,
        field,
        value_type,
        schema.get("description", ""),
        choices=choices if all("enum" in m for m in members) else (),
        metavar=METAVARS.get(flag),
    )


def _overrides() -> tuple[Override, ...]:
    root = job_schema()
    return tuple(_override(flag, field, root) for flag, field in FLAGS)


OVERRIDES: tuple[Override, ...] = _overrides()
BY_FLAG: Mapping[str, Override] = {row.flag: row for row in OVERRIDES}
BY_DEST: Mapping[str, Override] = {row.dest: row for row in OVERRIDES}


def overrides_from_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Parsed flags (Click's keyword names) -> ``{"section.field": value}``; other keys are
    ignored."""
    return {BY_DEST[name].field: value for name, value in flags.items() if name in BY_DEST}


def rows(*flags: str) -> tuple[Override, ...]:
    """The rows for these flags, in the order given (a command that takes only some of them)."""
    return tuple(BY_FLAG[flag] for flag in flags)
