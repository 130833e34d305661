"""The `rayapp` command line. Thin: parse flags, build the spec, call the library; nothing else in
rayapp imports it."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["main", "run"]


def __getattr__(name: str) -> Any:
    """`main` on first use: a Ray job's entrypoint (rayapp.cli.job_entry) imports this package
    before it can check that the cluster's Python has click and the rest, and say which it lacks."""
    if name == "main":
        from rayapp.cli.app import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run() -> None:
    """`rayapp` as a program (the console script and `python -m rayapp`): in a child of the warm
    cluster's preloaded driver when one serves this command (rayapp.cli.preloaded), else here; then
    an exit that skips the interpreter's teardown."""
    from rayapp.cli.preloaded import hand_over
    from rayapp.cli.program import run_here

    code = hand_over(sys.argv, status=lambda message: print(f"rayapp: {message}", file=sys.stderr))
    os._exit(run_here() if code is None else code)
