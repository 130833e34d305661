"""Search spaces of `rayapp tune`: ``--param FIELD=SPACE`` read into a :class:`Param`, checked
against the job spec before anything starts, and handed to Ray Tune as its own sampling domains.

A space is one of ``choice(a,b,…)`` and ``grid(a,b,…)`` (any values a job YAML takes, lists in
brackets: ``choice([64],[128,128])``), ``uniform(low,high)``, ``loguniform(low,high)`` (floats) and
``randint(low,high)`` (integers low <= n < high, as Ray Tune draws them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from rayapp.spec import JobSpec, SpecError

ACCEPTED = (
    "choice(a,b,...), grid(a,b,...), uniform(low,high), loguniform(low,high), randint(low,high)"
)
LISTED = ("choice", "grid")
RANGES = ("uniform", "loguniform", "randint")
_SPACE = re.compile(r"^\s*([a-z]+)\s*\((.*)\)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Param:
    """One tuned field: ``train.lr=loguniform(1e-4,1e-1)``."""

    field: str
    """The spec field path, as a job YAML nests it (``train.lr``, ``model.args.hidden``)."""
    kind: str
    """choice, grid, uniform, loguniform or randint."""
    values: tuple[Any, ...]
    """The listed values, or (low, high) of a range."""
    text: str
    """The space as given, for messages."""

    def domain(self) -> Any:
        """The Ray Tune sampling domain (or grid) of this space."""
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.values))
        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        low, high = self.values
        make: dict[str, Callable[[Any, Any], Any]] = {
            "uniform": tune.uniform,
            "loguniform": tune.loguniform,
            "randint": tune.randint,
        }
        return make[self.kind](low, high)

    def extremes(self) -> tuple[Any, ...]:
        """Values that stand for the whole space when the spec checks it: every listed value, or
        a range's ends (randint's highest value is high - 1)."""
        if self.kind in LISTED:
            return self.values
        low, high = self.values
        return (low, high - 1) if self.kind == "randint" else (low, high)


def parse_param(text: str) -> Param:
    """``FIELD=SPACE`` -> Param, or a one-line SpecError naming the bad part and what is
    accepted."""
    field, sep, space = text.partition("=")
    field = field.strip()
    if not sep or not field or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", field):
        raise SpecError(
            f"--param {text!r}: expected FIELD=SPACE with FIELD a job field path such as "
            f"train.lr, and SPACE one of {ACCEPTED}"
        )
    return Param(field, *_parse_space(field, space.strip()), text=space.strip())


def _parse_space(field: str, space: str) -> tuple[str, tuple[Any, ...]]:
    def bad(why: str) -> SpecError:
        return SpecError(f"--param {field}={space!r}: {why}; accepted: {ACCEPTED}")

    match = _SPACE.match(space)
    if match is None or match.group(1) not in LISTED + RANGES:
        raise bad(f"{space!r} is not a space")
    kind, inner = match.groups()
    try:
        values = yaml.safe_load(f"[{inner}]")
    except yaml.YAMLError:
        raise bad(f"the values {inner!r} cannot be read (lists go in brackets: [64,64])") from None
    values = tuple(_number_or_text(v) for v in values)
    if kind in LISTED:
        if not values:
            raise bad(f"{kind}() lists no values")
        if len({repr(v) for v in values}) != len(values):
            raise bad(f"{kind}() repeats a value")
        return kind, values
    if len(values) != 2:
        raise bad(f"{kind} takes two bounds (low, high), got {len(values)}")
    number = int if kind == "randint" else (int, float)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, number):
            what = "whole numbers" if kind == "randint" else "numbers"
            raise bad(f"bound {value!r} is not a number; {kind} takes {what}")
    low, high = values
    if not low < high:
        raise bad(f"low {low!r} is not below high {high!r}")
    if kind == "loguniform" and low <= 0:
        raise bad(f"loguniform's low {low!r} must be above 0")
    return kind, (low, high)


def _number_or_text(value: Any) -> Any:
    """YAML 1.1 reads 1e-3 (no dot) as text; as a sampled value it is the number it looks like."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return [_number_or_text(v) for v in value]
    return value


def parse_params(texts: tuple[str, ...] | list[str]) -> list[Param]:
    params = [parse_param(text) for text in texts]
    seen: set[str] = set()
    for param in params:
        if param.field in seen:
            raise SpecError(f"--param {param.field}: given twice; give each field once")
        seen.add(param.field)
    return params


def check_params(params: list[Param], build: Callable[[Mapping[str, Any]], JobSpec]) -> None:
    """Build the spec with each space's extreme values (the others at their first), so a value
    the job cannot take fails now, in one line, and not in a trial on the cluster."""
    firsts = {param.field: param.extremes()[0] for param in params}
    for param in params:
        for value in param.extremes():
            try:
                build({**firsts, param.field: value})
            except SpecError as exc:
                raise SpecError(f"--param {param.field}={param.text!r}: {exc}") from None


def param_space(params: list[Param]) -> dict[str, Any]:
    """Tune's param_space: one flat key per field path, as :func:`trial_overrides` reads back."""
    return {param.field: param.domain() for param in params}


def trial_overrides(config: Mapping[str, Any], fields: list[str]) -> dict[str, Any]:
    """A trial's sampled values as spec overrides (numpy scalars made plain Python)."""
    return {field: _plain(config[field]) for field in fields if field in config}


def _plain(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) and not isinstance(value, (list, tuple)) else value
