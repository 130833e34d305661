"""Benchmark grids: ``--grid KEY=V1,V2`` axes over any spec field or flag, and their cross product.

A key is a flag's name (``nodes``, ``--strategy``, ``precision``) or a spec field's dotted path
(``train.strategy``, ``model.hidden``, as ``rayapp schema`` lists them). Values are read as a job
file's YAML would be (``64`` a number, ``[64,64]`` a list, ``true`` a switch), split at the commas
outside brackets, so ``model.hidden=[64],[64,64]`` is two values. Every point's spec is built,
and so validated, before anything starts: a bad key or value is one line naming it and what is
accepted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from rayapp.reports.grid import TAG_AXIS_PREFIX, TAG_GRID_AXES, TAG_GRID_POINT
from rayapp.spec import JobSpec, SpecError
from rayapp.spec.loader import job_schema
from rayapp.spec.messages import known_field
from rayapp.spec.overrides import BY_FLAG

GRID_EXAMPLE = "nodes=1,2,4"


@dataclass(frozen=True)
class Axis:
    key: str
    """As the user named it, without leading dashes: ``nodes``, ``train.precision``."""
    field: str
    """The spec field it sets, ``section.name``."""
    texts: tuple[str, ...]
    """The values as written, for labels and tags."""
    values: tuple[Any, ...]
    """The values as the spec receives them."""


@dataclass(frozen=True)
class GridPoint:
    settings: tuple[tuple[str, str], ...]
    """(axis key, value as written), in axis order."""
    spec: JobSpec

    @property
    def label(self) -> str:
        return " ".join(f"{key}={text}" for key, text in self.settings)

    @property
    def tags(self) -> dict[str, str]:
        return {
            TAG_GRID_POINT: self.label,
            TAG_GRID_AXES: ",".join(key for key, _ in self.settings),
            **{TAG_AXIS_PREFIX + key: text for key, text in self.settings},
        }


def field_of(key: str) -> str:
    """The spec field a grid key names: a flag's field, or the key itself when it is a field."""
    flag = BY_FLAG.get(key if key.startswith("--") else f"--{key}")
    if flag is not None:
        return flag.field
    if "." in key and known_field(job_schema(), key):
        return key
    flags = ", ".join(name.removeprefix("--") for name in BY_FLAG)
    raise SpecError(
        f"--grid: {key!r} is not a flag or spec field; use a flag's name ({flags}) "
        "or a field as section.name (rayapp schema lists them)"
    )


def split_values(text: str) -> list[str]:
    """``1,2,[64,64]`` -> ``['1', '2', '[64,64]']``: commas inside brackets or braces stay."""
    pieces, depth, current = [], 0, ""
    for char in text:
        depth += (char in "[{") - (char in "]}")
        if char == "," and depth == 0:
            pieces.append(current.strip())
            current = ""
        else:
            current += char
    pieces.append(current.strip())
    return pieces


def parse_axis(text: str) -> Axis:
    """``KEY=V1,V2,...`` -> an Axis; one-line SpecError naming what is wrong otherwise."""
    key, sep, values_text = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key or not values_text.strip():
        raise SpecError(f"--grid: {text!r} is not accepted; use KEY=V1,V2,... e.g. {GRID_EXAMPLE}")
    field = field_of(key)
    texts = split_values(values_text)
    if "" in texts:
        raise SpecError(
            f"--grid {key}: {values_text!r} has an empty value; give values between the commas, "
            f"e.g. {GRID_EXAMPLE}"
        )
    if len(set(texts)) != len(texts):
        raise SpecError(f"--grid {key}: {values_text!r} repeats a value; give each value once")
    return Axis(key=key, field=field, texts=tuple(texts), values=tuple(map(_read, texts)))


def _read(text: str) -> Any:
    """A value as a job file's YAML reads it; text that is not valid YAML stays text, for the spec
    to reject by name."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_axes(texts: tuple[str, ...] | list[str]) -> list[Axis]:
    axes = [parse_axis(text) for text in texts]
    fields = [axis.field for axis in axes]
    for axis in axes:
        if fields.count(axis.field) > 1:
            raise SpecError(
                f"--grid {axis.key}: {axis.field} is given by more than one --grid; "
                "give each field one axis"
            )
    return axes


def expand(axes: list[Axis], build: Callable[[Mapping[str, Any]], JobSpec]) -> list[GridPoint]:
    """Every point of the cross product (the first axis varies slowest), each with its spec from
    `build` (field overrides -> spec). The first point the spec rejects is named with the spec's
    own one line: a value alone (``train.precision: 'bf16x' is not accepted; ...``) or two
    settings that conflict (pp on one node)."""
    points = []
    for combination in itertools.product(*(range(len(axis.texts)) for axis in axes)):
        chosen = [
            (axis, axis.texts[i], axis.values[i]) for axis, i in zip(axes, combination, strict=True)
        ]
        settings = tuple((axis.key, text) for axis, text, _ in chosen)
        try:
            spec = build({axis.field: value for axis, _, value in chosen})
        except SpecError as exc:
            where = " ".join(f"{key}={text}" for key, text in settings)
            raise SpecError(f"--grid {where}: {exc}") from None
        points.append(GridPoint(settings, spec))
    return points
