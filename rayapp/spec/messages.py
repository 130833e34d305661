"""pydantic's ValidationError as rayapp's one-line SpecError: the key as a dotted path
(``train.lr``, ``model.hidden[1]``), the bad value, and what is accepted, told from the same JSON
Schema that ``rayapp schema`` prints, so a field's rules are written once."""

from __future__ import annotations

import functools
import reprlib
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from rayapp.spec.errors import SpecError

Schema = dict[str, Any]

FORMATS = {
    "import-path": "an import path module:function",
    "node-range": "MIN:MAX (e.g. 1:2) for elastic training",
    "model-name": "a registered model name (non-blank, without '/' or ':')",
}
"""What the custom ``format`` of a string field accepts, in words."""
_UNKNOWN_KEY = ("unexpected_keyword_argument", "extra_forbidden", "invalid_key")
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80  # a bad value of any size keeps the message one short line


@functools.cache
def _schema(cls: type) -> Schema:
    schema: Schema = TypeAdapter(cls).json_schema()
    return schema


def spec_error(exc: ValidationError, cls: type, path: str = "") -> SpecError:
    """The first of `exc`'s errors, raised validating `cls` (the job's section at `path`)."""
    error = exc.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, SpecError):  # a rule across fields says it in its own words
        return SpecError(str(cause))
    root = _schema(cls)
    loc = error["loc"]
    if error["type"] in _UNKNOWN_KEY:
        return _unknown_key(root, path, loc, error)
    key, field = _walk(root, path, loc)
    if loc and loc[-1] == "[key]":  # a mapping's key that is not text
        return SpecError(f"{key}: key {_SHOWN.repr(error['input'])} is not accepted; use text keys")
    if error["type"] == "missing":
        return SpecError(f"{key}: missing; use {accepted(field, root)}")
    shown = _SHOWN.repr(error["input"])
    return SpecError(f"{key}: {shown} is not accepted; use {accepted(field, root)}")


def _unknown_key(root: Schema, path: str, loc: Any, error: ErrorDetails) -> SpecError:
    parent_key, parent = _walk(root, path, loc[:-1])
    keys = ", ".join(_resolve(parent, root).get("properties", {}))
    bad = error["input"] if error["type"] == "invalid_key" or not loc else loc[-1]
    if not parent_key:
        return SpecError(f"{_SHOWN.repr(bad)}: unknown top-level key; accepted keys are {keys}")
    plain = isinstance(bad, str) and bad.isprintable() and bad.strip() == bad != ""
    shown = bad if plain and len(bad) <= 80 else _SHOWN.repr(bad)
    return SpecError(f"{parent_key}.{shown}: unknown key; accepted keys are {keys}")


def field_schema(root: Schema, path: str) -> Schema:
    """The schema of the field at a dotted `path` (``train.pipeline.stages``) of `root`."""
    return _walk(root, "", tuple(path.split(".")))[1]


def known_field(root: Schema, path: str) -> bool:
    """Whether a dotted `path` (``train.pipeline.stages``) names a field of `root`."""
    return _walk(root, "", tuple(path.split(".")))[0] == path


def _walk(root: Schema, path: str, loc: Any) -> tuple[str, Schema]:
    """The dotted key of `loc` in `root` (the schema of the section at `path`), and the schema of
    the field there. Parts of `loc` that name no field (pydantic's names for the members of a
    union, ``[key]`` for a mapping's keys) are left out."""
    key, node = path, root
    for part in loc:
        here = _resolve(node, root)
        if isinstance(part, int) and "items" in here:
            key, node = f"{key}[{part}]", here["items"]
        elif isinstance(part, str) and part in here.get("properties", {}):
            key, node = f"{key}.{part}" if key else part, here["properties"][part]
    return key, node


def _resolve(node: Schema, root: Schema) -> Schema:
    """The object or array a field holds: its $ref followed, the non-null member of an anyOf."""
    if "$ref" in node:
        resolved: Schema = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
        return resolved
    for member in node.get("anyOf", ()):
        if "$ref" in member or member.get("type") in ("object", "array"):
            return _resolve(member, root)
    return node


def accepted(node: Schema, root: Schema, plural: bool = False) -> str:
    """What a field of this schema accepts, in words: ``a whole number >= 1``, ``one of: a, b``."""
    examples = node.get("examples")
    example = f", e.g. {examples[0]}" if examples and not plural else ""
    if "$ref" in node:
        node = _resolve(node, root)
    if "anyOf" in node:
        members = [m for m in node["anyOf"] if m.get("type") != "null"]
        return ", or ".join(accepted(member, root, plural) for member in members) + example
    if "enum" in node:
        return "one of: " + ", ".join(str(value) for value in node["enum"])
    kind = node.get("type")
    if kind == "object":
        keys = ", ".join(node.get("properties", ()))
        phrase = f"mappings of {keys}" if plural else f"a mapping of {keys}"
        if not keys:
            phrase = "mappings" if plural else "a mapping"
    elif kind == "array":
        phrase = f"a list of {accepted(node.get('items', {}), root, plural=True)}"
    elif kind == "boolean":
        phrase = "true or false"
    elif kind in ("integer", "number"):
        noun = "whole number" if kind == "integer" else "number"
        phrase = (f"{noun}s" if plural else f"a {noun}") + _bounds(node)
    elif kind == "string":
        noun = "text" if "pattern" not in node else "non-blank text"
        phrase = FORMATS.get(node.get("format", ""), f"{noun}s" if plural else noun)
    else:
        phrase = "a value"
    return phrase + example


def _bounds(node: Schema) -> str:
    bounds = (
        (">=", node.get("minimum")),
        (">", node.get("exclusiveMinimum")),
        ("<=", node.get("maximum")),
        ("<", node.get("exclusiveMaximum")),
    )
    return "".join(f" {sign} {value}" for sign, value in bounds if value is not None)
