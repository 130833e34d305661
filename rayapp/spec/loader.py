"""Build a :class:`JobSpec` from defaults < job YAML < command-line overrides."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from rayapp.spec.errors import SpecError
from rayapp.spec.job import JobSpec
from rayapp.spec.messages import spec_error

JOB: TypeAdapter[JobSpec] = TypeAdapter(JobSpec)
TOP_LEVEL_KEYS = tuple(field.name for field in dataclasses.fields(JobSpec))
SECTIONS = tuple(key for key in TOP_LEVEL_KEYS if key not in ("name", "description"))
STORAGE_PATH_ENV = "RAYAPP_STORAGE_PATH"
"""Default for cluster.storage_path when the job does not set it (below flags and the job YAML)."""


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
    """YAML 1.1 but for one thing: a plain ``1:2`` is the text it looks like (``nodes: 1:2``,
    elastic 1 to 2 nodes), as YAML 1.2 reads it, not YAML 1.1's base-60 integer 62."""


def _number_or_base_60_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    if ":" in node.value:
        return loader.construct_scalar(node)
    return yaml.SafeLoader.yaml_constructors[node.tag](loader, node)


for _tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
    _JobYamlLoader.add_constructor(_tag, _number_or_base_60_text)


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


def build_spec(
    document: Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    *,
    default_name: str = "job",
) -> JobSpec:
    """Merge a parsed job document with overrides keyed by field path (``train.lr``,
    ``train.pipeline.stages``; None means "not given", so callers can pass every CLI flag as-is)
    and validate the result: a JobSpec, or a one-line SpecError naming the first bad key."""
    # An empty section (`train:` with nothing under it) is the defaults. Values are set into
    # copies of the document's mappings, never into the caller's document.
    merged = {key: value for key, value in document.items() if key not in SECTIONS or value}
    merged.setdefault("name", default_name)
    given = {path: value for path, value in (overrides or {}).items() if value is not None}
    # Cluster images export the shared checkpoint location once, for every job run there.
    if os.environ.get(STORAGE_PATH_ENV) and "cluster.storage_path" not in given:
        _set(merged, "cluster.storage_path", os.environ[STORAGE_PATH_ENV], keep=True)
    train = merged.get("train")
    if (
        isinstance(train, dict)
        and given.get("train.strategy", "pp") != "pp"
        and not any(path.startswith("train.pipeline.") for path in given)
    ):
        # a pp job file run with another strategy (--strategy ddp)
        merged["train"] = {key: value for key, value in train.items() if key != "pipeline"}
    for path, value in given.items():
        _set(merged, path, value)
    try:
        return JOB.validate_python(merged)
    except ValidationError as exc:
        raise spec_error(exc, JobSpec) from None


def _set(document: dict[str, Any], path: str, value: Any, *, keep: bool = False) -> None:
    """``document[a][b][c] = value`` for the path ``a.b.c``, copying the mappings on the way. A
    part of the path that is not a mapping is left as it is, for validation to name it.
    `keep`: a value the document has already stays."""
    *outer, key = path.split(".")
    node = document
    for part in outer:
        inner = node.get(part)
        if inner is None:
            inner = {}
        if not isinstance(inner, dict):
            return
        node[part] = inner = dict(inner)
        node = inner
    if not (keep and key in node):
        node[key] = value


def load_spec(path: str | Path, overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """Read a job YAML and apply overrides; the job name defaults to the file's stem."""
    document = read_job_yaml(path)
    return build_spec(document, overrides, default_name=Path(path).stem)


def spec_document(spec: JobSpec) -> dict[str, Any]:
    """The spec as a job document :func:`build_spec` accepts (plain lists, YAML key aliases), so a
    resolved spec can be written out and read back as the same spec."""
    document: dict[str, Any] = JOB.dump_python(spec, mode="json", by_alias=True)
    return document


def job_schema() -> dict[str, Any]:
    """The JSON Schema of a job file, for editors (``rayapp schema``)."""
    schema: dict[str, Any] = JOB.json_schema(by_alias=True)
    schema.pop("required", None)  # a job file's name defaults to the file's own name
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": "rayapp job",
    }
