"""What every section of the job spec is made of: one pydantic configuration, the value types
its fields share, and the step that turns pydantic's errors into a one-line SpecError.

Sections are pydantic dataclasses rather than models: they stay frozen standard dataclasses
(``dataclasses.replace``, ``asdict`` and ``FrozenInstanceError`` work as the rest of rayapp
expects), and pydantic validates them wherever they are built, from a job file or by ``replace``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, ConfigDict, Field, Strict, ValidationError
from pydantic_core import ArgsKwargs, PydanticCustomError

from rayapp.spec.messages import spec_error

SECTION_CONFIG = ConfigDict(
    extra="forbid",  # a misspelt key is an error naming it, not a setting silently ignored
    allow_inf_nan=False,
    validate_by_name=True,  # dataclasses.replace passes fields by name, job files by alias
    validate_by_alias=True,
    # Python's own regular expressions, as the JSON Schema's readers use (their \s and \w differ
    # from the Rust engine's at the edges).
    regex_engine="python-re",
)

IMPORT_PATH = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"

# Job files come from YAML, so types are strict where YAML could pass the wrong kind of value
# quietly: true is no whole number, 2.5 no count of epochs, "yes" no switch.
WholeNumber = Annotated[int, Strict()]
Switch = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
NonBlank = Annotated[str, Strict(), Field(pattern=r"\S")]
ImportPath = Annotated[
    str,
    Strict(),
    Field(pattern=IMPORT_PATH, json_schema_extra={"format": "import-path"}),
]
"""``package.module:function``, the form users name their own builders and loops in."""


def _no_switch(value: object) -> object:
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


Number = Annotated[float, BeforeValidator(_no_switch)]
"""A number; also a number written as text, as YAML 1.1 reads ``1e-3`` (no dot)."""
# Bounds inside the type, before the validator, so that they hold, and show in the JSON Schema,
# where the field may also be none.
PositiveNumber = Annotated[float, Field(gt=0), BeforeValidator(_no_switch)]
"""A number > 0."""
NonNegativeNumber = Annotated[float, Field(ge=0), BeforeValidator(_no_switch)]
"""A number >= 0."""


def is_import_path(value: object) -> bool:
    return isinstance(value, str) and re.match(IMPORT_PATH, value) is not None


def given_fields(data: Any) -> dict[str, Any] | None:
    """The values a section is being built from: a job file's mapping, or the keywords of a
    constructor call (pydantic passes those to a before-validator as ArgsKwargs); None for
    anything else, which validation then rejects."""
    if isinstance(data, ArgsKwargs):
        return None if data.args else dict(data.kwargs or {})
    return dict(data) if isinstance(data, dict) else None


def with_fields(data: Any, fields: dict[str, Any]) -> Any:
    """`fields` in the form `data` came in (see :func:`given_fields`)."""
    return ArgsKwargs((), fields) if isinstance(data, ArgsKwargs) else fields


Section = TypeVar("Section", bound=type)


def section(path: str) -> Callable[[Section], Section]:
    """Marks a pydantic dataclass as the job's section at `path` (``cluster``, ``train.pipeline``;
    ``""`` for the whole job): built directly (``dataclasses.replace``) it raises the same
    one-line SpecError, naming ``path.key``, as a job file does."""

    def mark(cls: Section) -> Section:
        init = cls.__dict__["__init__"]

        @functools.wraps(init)
        def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as exc:
                raise spec_error(exc, cls, path) from None

        cls.__init__ = checked_init  # type: ignore[misc]
        return cls

    return mark
