"""Checks of the user's code named by a job, made on the driver before any cluster starts.

Each factory, loss, optimizer and loop named by import path must import (from the job's
directory first, then installed packages), and factories must return what the loop needs.
The model factory is called on the "meta" device, so checking a large model allocates nothing;
the data factory is called as the workers will call it. Each problem is one SpecError line.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayapp.errors import first_line
from rayapp.spec import JobSpec, SpecError
from rayapp.spec.job import is_import_path
from rayapp.spec.mesh import is_tensor_parallel
from rayapp.train.data import as_datasets


def check_user_code(spec: JobSpec, code_dir: Path | None) -> None:
    """Raise SpecError for the first import path that does not import or build what it should."""
    if code_dir is not None and str(code_dir) not in sys.path:
        sys.path.insert(0, str(code_dir))  # the job's directory first, as on the workers
    if spec.train.loop:
        loop = resolve("train.loop", spec.train.loop, code_dir)
        if not callable(loop):
            raise SpecError(
                f"train.loop: {spec.train.loop!r} is a {type(loop).__name__}; "
                "expected a function(ctx)"
            )
    for field_name, target in (
        ("train.loss", spec.train.loss),
        ("train.optimizer", spec.train.optimizer),
    ):
        if (
            target
            and is_import_path(target)
            and not callable(resolve(field_name, target, code_dir))
        ):
            raise SpecError(f"{field_name}: {target!r} is not callable")
    if spec.model.factory:
        factory = resolve("model.factory", spec.model.factory, code_dir)
        with torch.device("meta"):  # shapes only: a billion-parameter model costs nothing here
            model = _call("model.factory", spec.model.factory, factory, spec.model.args)
        if not isinstance(model, nn.Module):
            raise SpecError(
                f"model.factory: {spec.model.factory} returned {type(model).__name__}; "
                "expected a torch.nn.Module"
            )
        if is_tensor_parallel(spec.train.strategy):  # a plan, and widths that divide, before start
            from rayapp.train.tensor_parallel import TensorParallelError, plan_for

            try:
                plan_for(model, spec.cluster.workers_per_node)
            except TensorParallelError as exc:
                raise SpecError(f"model.factory: {spec.model.factory}: {exc}") from None
    if spec.data.factory:
        factory = resolve("data.factory", spec.data.factory, code_dir)
        built = _call("data.factory", spec.data.factory, factory, spec.data.args)
        try:
            as_datasets(built, spec.data.factory)
        except TypeError as exc:
            raise SpecError(f"data.factory: {exc}") from None


def resolve(field_name: str, target: str, code_dir: Path | None) -> Any:
    """The object `target` (``module:attr``) names, or a SpecError saying why it cannot be had."""
    module_name, _, attribute = target.partition(":")
    where = f"{code_dir} and installed packages" if code_dir else "installed packages"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise SpecError(
                f"{field_name}: {target!r}: no module named {module_name!r} (looked in {where})"
            ) from None
        raise SpecError(
            f"{field_name}: importing {module_name} failed: {_described(exc)}"
        ) from None
    except Exception as exc:  # the user's module raised while importing
        raise SpecError(
            f"{field_name}: importing {module_name} failed: {_described(exc)}"
        ) from None
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            defined = sorted(
                name
                for name, value in vars(module).items()
                if not name.startswith("_")
                and callable(value)
                and getattr(value, "__module__", None) == module.__name__
            )
            raise SpecError(
                f"{field_name}: {target!r} not found in {module_name} "
                f"(defines: {', '.join(defined) or 'nothing callable'})"
            )
        obj = getattr(obj, part)
    return obj


def _call(field_name: str, target: str, factory: Any, args: dict) -> Any:
    if not callable(factory):
        raise SpecError(
            f"{field_name}: {target!r} is a {type(factory).__name__}, not a function or class"
        )
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as exc:
        raise SpecError(f"{field_name}: {target} does not take the args {args!r}: {exc}") from None
    except ValueError:  # no signature to read (a builtin): let the call say
        pass
    try:
        return factory(**args)
    except Exception as exc:
        raise SpecError(f"{field_name}: {target}(**{args!r}) raised {_described(exc)}") from None


def _described(exc: BaseException) -> str:
    """``ValueError: the message's first line``: what the user's code raised, on one line."""
    line = first_line(exc)
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
