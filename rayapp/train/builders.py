"""Import-path resolution for registry entries and users' own builders (``package.module:attr``)."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(target: str) -> Any:
    """The object a ``module:attribute`` path names (attribute may be dotted:
    ``mod:Class.method``)."""
    module_name, _, attribute = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split(".") if attribute else ():
        obj = getattr(obj, part)
    return obj
