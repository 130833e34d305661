"""Registries: the names a job may use for its model, data set, loss, optimizer and strategy.

Each entry maps a name to a builder named by import path (``package.module:function``) and to
the metadata the spec needs to validate a job without importing torch (input and output sizes,
whether the data is labelled, which strategies run in one process). Built-ins are entries like
any other; the training side imports a builder only when a worker builds the job, and users'
own builders (``model.factory: "mymodels:build"``) go through the same import path resolution.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rayapp.spec.errors import SpecError


@dataclass(frozen=True)
class Entry:
    name: str
    target: str
    """Import path of the builder, ``package.module:attribute``."""
    summary: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)


class Registry:
    """The builders for the names a spec field accepts. The names are the field's ``Literal``
    type (what validation, the JSON Schema and the CLI's choices read); a name registered here
    must be one of them."""

    def __init__(self, field_name: str, accepted: tuple[str, ...]) -> None:
        self.field_name = field_name
        self.accepted = accepted
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, target: str, summary: str = "", **meta: Any) -> Entry:
        if name not in self.accepted:
            raise ValueError(f"{self.field_name}: {name!r} is not among {self.accepted}")
        if name in self._entries:
            raise ValueError(
                f"{self.field_name}: {name!r} is registered already (as "
                f"{self._entries[name].target})"
            )
        entry = Entry(name=name, target=target, summary=summary, meta=MappingProxyType(dict(meta)))
        self._entries[name] = entry
        return entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Entry:
        """The entry for `name`, or a one-line SpecError listing what is accepted."""
        if name not in self._entries:
            raise SpecError(
                f"{self.field_name}: {name!r} is not accepted; use one of: "
                f"{', '.join(self._entries)}"
            )
        return self._entries[name]
