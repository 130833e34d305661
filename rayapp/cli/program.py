"""The `rayapp` program's body: the command group in this process, as far as its exit status."""

from __future__ import annotations

import atexit
import sys
import threading

from rayapp.cli.app import main


def run_here() -> int:
    """The command group in this process; its exit status, once exit handlers have run.

    With torch, Ray and MLflow loaded, Python's teardown of their modules takes a second or more
    after the last line is printed (1.1 s of a 16 s warm submit on a 2-core machine), time in
    which the command has nothing left to do: the caller ends the process with os._exit. Exit
    handlers still run, threads that are not daemons are waited for, and output is flushed, as at
    a normal exit."""
    code: str | int | None = 0
    try:
        main(prog_name="rayapp")
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
    return code or 0
