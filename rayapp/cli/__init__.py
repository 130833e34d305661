"""The `rayapp` command line. Thin: parse flags, build the spec, call the library; nothing else in
rayapp imports it."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from rayapp.cli.app import main

__all__ = ["main", "run"]


def run() -> None:
    """`rayapp` as a program (the console script and `python -m rayapp`): the command group, then
    an exit that skips the interpreter's teardown.

    With torch, Ray and MLflow loaded, Python's teardown of their modules takes a second or more
    after the last line is printed (1.1 s of a 16 s warm submit on a 2-core machine), time in
    which the command has nothing left to do. Exit handlers still run, threads that are not
    daemons are waited for, and output is flushed, as at a normal exit."""
    try:
        main(prog_name="rayapp")
        code = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, exit 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
