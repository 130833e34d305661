"""Checks the spec's fields share: each raises a one-line SpecError naming the field, the value
and what is accepted."""

from __future__ import annotations

import re

from rayapp.spec.errors import SpecError


def check_one_of(field_name: str, value: object, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise SpecError(
            f"{field_name}: {value!r} is not accepted; use one of: {', '.join(accepted)}"
        )


def check_positive_int(field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{field_name}: {value!r} is not accepted; use a whole number >= 1")


_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_import_path(value: object) -> bool:
    """``package.module:function``, the form users name their own builders and loops in."""
    return isinstance(value, str) and bool(_IMPORT_PATH.match(value))


def check_import_path(field_name: str, value: object) -> None:
    if value is not None and not is_import_path(value):
        raise SpecError(
            f"{field_name}: {value!r} is not accepted; use an import path module:function, e.g. mymodels:build"
        )


def check_mapping(field_name: str, value: object) -> None:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise SpecError(
            f"{field_name}: {value!r} is not accepted; use a mapping of keyword arguments, e.g. {{hidden: 48}}"
        )


def check_one_source(section: str, kind: object, factory: object) -> None:
    if kind is not None and factory is not None:
        raise SpecError(
            f"{section}.factory: {factory!r} is not accepted together with {section}.kind {kind!r}; "
            f"give one of them: kind for a built-in, factory for your own"
        )


def check_positive_number(field_name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or value != value
    ):
        raise SpecError(f"{field_name}: {value!r} is not accepted; use a number > 0")


def check_bool(field_name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{field_name}: {value!r} is not accepted; use true or false")
