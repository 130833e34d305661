"""The `rayapp` command line. Thin: parse flags, build the spec, call the library; nothing else in
rayapp imports it."""

from __future__ import annotations

import os
import sys

from rayapp.cli.app import main
from rayapp.cli.program import run_here

__all__ = ["main", "run"]


def run() -> None:
    """`rayapp` as a program (the console script and `python -m rayapp`): in a child of the warm
    cluster's preloaded driver when one serves this command (rayapp.cli.preloaded), else here; then
    an exit that skips the interpreter's teardown."""
    from rayapp.cli.preloaded import hand_over

    code = hand_over(sys.argv, status=lambda message: print(f"rayapp: {message}", file=sys.stderr))
    os._exit(run_here() if code is None else code)
