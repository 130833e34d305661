"""`python -m rayapp.cli.job_entry submit job.yaml ...`: the `rayapp` CLI as a Ray job's driver.

Ray starts job drivers with SIGINT ignored (inherited from its worker processes), and Python then
leaves it ignored, so the SIGINT `rayapp stop` sends would do nothing until Ray's SIGKILL.
Restoring Python's handler turns it into KeyboardInterrupt: the driver marks its MLflow run KILLED
and shuts down its Ray Train workers, as after Ctrl-C in a terminal.

Before anything else the driver compares the head's Python and Ray with the submitting machine's,
and a module the head's Python lacks is named with the pip command that adds it, in one line.
"""

from __future__ import annotations

import signal
import sys


def job_main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from rayapp.launch import versions

    submitter, where = versions.submitted_with(), versions.head_description()
    problem = submitter and versions.mismatch_problem(submitter, versions.this_environment(), where)
    if problem:
        _fail(problem)
    try:
        from rayapp.cli.app import main

        main(prog_name="rayapp")
    except ModuleNotFoundError as exc:  # the cluster's Python lacks what rayapp imports
        _fail(versions.missing_module_problem(exc.name or str(exc), submitter, where))


def _fail(message: str) -> None:
    """The CLI's one-line error, without the CLI (click may be what is missing)."""
    print(f"rayapp: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    job_main()
