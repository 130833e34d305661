"""What every command shares: help settings, exit codes, and one-line errors instead of
tracebacks."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from rayapp.driver.signals import Terminated
from rayapp.errors import RayappError
from rayapp.spec import SpecError

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


def fail(message: str, code: int) -> None:
    click.secho(f"rayapp: error: {message}", err=True, fg="red")
    sys.exit(code)


def friendly_errors(command: Callable) -> Callable:
    """One line for a person, never a traceback: bad input exits 2, failures 1, Ctrl-C 130,
    SIGTERM 143 and SIGHUP 129."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except SpecError as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        except RayappError as exc:
            fail(str(exc), EXIT_FAILED)
        except Terminated as exc:
            fail(
                f"terminated by {exc}; training stopped and the MLflow run marked KILLED",
                exc.exit_code,
            )
        except KeyboardInterrupt:
            fail("interrupted; training stopped and the MLflow run marked KILLED", EXIT_INTERRUPTED)

    return wrapper


def quiet_library_logs() -> None:
    """MLflow announces database migrations and Ray its connections at INFO; a person needs
    neither."""
    import logging

    os.environ.setdefault(
        "MLFLOW_LOGGING_LEVEL", "WARNING"
    )  # read when mlflow configures its loggers
    for name in ("mlflow", "alembic", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
