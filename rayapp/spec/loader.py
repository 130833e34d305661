"""Build a :class:`JobSpec` from defaults < job YAML < command-line overrides."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rayapp.spec.job import (
    CheckpointSpec,
    ClusterSpec,
    DataSpec,
    JobSpec,
    ModelSpec,
    PipelineSpec,
    SpecError,
    TrackingSpec,
    TrainSpec,
)

SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "data": DataSpec,
    "train": TrainSpec,
    "cluster": ClusterSpec,
    "tracking": TrackingSpec,
    "checkpoint": CheckpointSpec,
}
YAML_ALIASES = {"checkpoint": {"async": "async_save"}}
"""Job-file keys that are Python keywords, and the fields they fill."""
NESTED: dict[tuple[str, str], type] = {("train", "pipeline"): PipelineSpec}
"""Keys whose value is a mapping of its own (``train.pipeline: {stages: 2}``; flag field ``train.pipeline.stages``)."""
TOP_LEVEL_KEYS = ("name", "description", *SECTIONS)
STORAGE_PATH_ENV = "RAYAPP_STORAGE_PATH"
"""Default for cluster.storage_path when the job does not set it (below flags and the job YAML)."""


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _yaml_keys(section: str, cls: type) -> tuple[str, ...]:
    """The keys a job file may use in a section: the field names, keywords under their YAML alias."""
    to_yaml = {field: key for key, field in YAML_ALIASES.get(section, {}).items()}
    return tuple(to_yaml.get(name, name) for name in _field_names(cls))


def read_job_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a job file into a mapping, with one-line errors for anything unreadable."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(
            f"job file {str(path)!r} does not exist; pass a job YAML such as jobs/seed_linear.yaml"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(
            f"job file {str(path)!r} cannot be read as UTF-8 text: {exc.__class__.__name__}"
        ) from None
    return parse_job_yaml(text, source=str(path))


class _JobYamlLoader(yaml.SafeLoader):
    """YAML as YAML 1.2 reads numbers: ``nodes: 1:2`` is the text "1:2" (elastic 1 to 2 nodes), not
    YAML 1.1's base-60 integer 62."""


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_JobYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_JobYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:
    [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
_JobYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(
        r"""^(?:
    [-+]?0b[0-1_]+
    |[-+]?0[0-7_]+
    |[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+)$""",
        re.X,
    ),
    list("-+0123456789"),
)


def parse_job_yaml(text: str, *, source: str = "<job>") -> dict[str, Any]:
    try:
        document = yaml.load(text, Loader=_JobYamlLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(f"job file {source!r} is not valid YAML{where}: {problem}") from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise SpecError(
            f"job file {source!r} must be a mapping of sections ({', '.join(TOP_LEVEL_KEYS)}), "
            f"not a {type(document).__name__}"
        )
    return document


def _section_values(document: Mapping[str, Any], section: str, cls: type) -> dict[str, Any]:
    values = document.get(section) or {}
    if not isinstance(values, dict):
        raise SpecError(
            f"{section}: {values!r} is not accepted; use a mapping of {', '.join(_yaml_keys(section, cls))}"
        )
    accepted = _yaml_keys(section, cls)
    for key in values:
        if key not in accepted:
            raise SpecError(
                f"{section}.{key}: unknown key; accepted keys are {', '.join(accepted)}"
            )
    aliases = YAML_ALIASES.get(section, {})
    values = {aliases.get(key, key): value for key, value in values.items()}
    for (outer, key), cls in NESTED.items():
        if outer == section and values.get(key) is not None:
            values[key] = _nested_values(f"{section}.{key}", values[key], cls)
    for key in ("hidden", "script_args"):  # YAML lists; the frozen spec keeps tuples
        if isinstance(values.get(key), list):
            values[key] = tuple(values[key])
    if isinstance(values.get("lr"), str):
        # YAML 1.1 reads `1e-3` (no dot) as a string; accept it as the number a person meant.
        try:
            values["lr"] = float(values["lr"])
        except ValueError:
            pass
    return values


def _nested_values(dotted: str, values: Any, cls: type) -> dict[str, Any]:
    accepted = _field_names(cls)
    if not isinstance(values, dict):
        raise SpecError(
            f"{dotted}: {values!r} is not accepted; use a mapping of {', '.join(accepted)}"
        )
    for key in values:
        if key not in accepted:
            raise SpecError(f"{dotted}.{key}: unknown key; accepted keys are {', '.join(accepted)}")
    return dict(values)


def build_spec(
    document: Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    *,
    default_name: str = "job",
) -> JobSpec:
    """Merge a parsed job document with overrides keyed `section.field` (None means "not given").

    Overrides that are None are ignored, so that callers can pass every CLI flag as-is.
    """
    for key in document:
        if not isinstance(key, str) or key not in TOP_LEVEL_KEYS:
            raise SpecError(
                f"{key!r}: unknown top-level key; accepted keys are {', '.join(TOP_LEVEL_KEYS)}"
            )
    sections = {name: _section_values(document, name, cls) for name, cls in SECTIONS.items()}
    # Cluster images export the shared checkpoint location once, for every job run there.
    if os.environ.get(STORAGE_PATH_ENV) and "storage_path" not in sections["cluster"]:
        sections["cluster"]["storage_path"] = os.environ[STORAGE_PATH_ENV]
    name = document.get("name", default_name)
    given = {dotted: value for dotted, value in (overrides or {}).items() if value is not None}
    if given.get("train.strategy", "pp") != "pp" and not any(
        k.startswith("train.pipeline.") for k in given
    ):
        sections["train"].pop(
            "pipeline", None
        )  # a pp job file run with another strategy (--strategy ddp)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        if dotted == "name":
            name = value
            continue
        section, _, key = dotted.partition(".")
        key, _, inner = key.partition(".")
        nested = NESTED.get((section, key))
        if (
            section not in SECTIONS
            or key not in _field_names(SECTIONS[section])
            or (inner and (nested is None or inner not in _field_names(nested)))
        ):
            raise SpecError(f"override {dotted!r} names no spec field")
        if inner:
            sections[section][key] = {**(sections[section].get(key) or {}), inner: value}
        else:
            sections[section][key] = value
    # Weak scaling states batch_size; strong scaling states global_batch_size. A job file that
    # switches to strong scaling should not trip over the weak-scaling default.
    train = sections["train"]
    if train.get("scaling") == "strong" and "batch_size" not in train:
        train["batch_size"] = None
    if train.get("scaling") == "strong" and train.get("batch_size") is not None:
        raise SpecError(
            f"train.batch_size: {train['batch_size']!r} is not accepted with scaling strong "
            "(it is global_batch_size / world_size); set train.global_batch_size (--global-batch-size) instead"
        )
    try:
        for (section, key), cls in NESTED.items():
            if isinstance(sections[section].get(key), dict):
                sections[section][key] = cls(**sections[section][key])
        built = {name_: cls(**sections[name_]) for name_, cls in SECTIONS.items()}
        return JobSpec(name=name, **built)
    except TypeError as exc:  # a value of the wrong shape reached a dataclass
        raise SpecError(f"job spec is malformed: {exc}") from None


def load_spec(path: str | Path, overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """Read a job YAML and apply overrides; the job name defaults to the file's stem."""
    document = read_job_yaml(path)
    return build_spec(document, overrides, default_name=Path(path).stem)


def spec_document(spec: JobSpec) -> dict[str, Any]:
    """The spec as a job document :func:`build_spec` accepts (plain lists, YAML key aliases), so a
    resolved spec can be written out and read back as the same spec."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value

    document = plain(dataclasses.asdict(spec))
    for section, aliases in YAML_ALIASES.items():
        for yaml_key, field_name in aliases.items():
            document[section][yaml_key] = document[section].pop(field_name)
    return document
