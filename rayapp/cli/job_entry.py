"""`python -m rayapp.cli.job_entry submit job.yaml ...`: the `rayapp` CLI as a Ray job's driver.

Ray starts job drivers with SIGINT ignored (inherited from its worker processes), and Python then
leaves it ignored, so the SIGINT `rayapp stop` sends would do nothing until Ray's SIGKILL.
Restoring Python's handler turns it into KeyboardInterrupt: the driver marks its MLflow run KILLED
and shuts down its Ray Train workers, as after Ctrl-C in a terminal.
"""

from __future__ import annotations

import signal


def job_main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from rayapp.cli.app import main

    main(prog_name="rayapp")


if __name__ == "__main__":
    job_main()
