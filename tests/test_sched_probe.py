"""benchmarks/sched_probe.py against real processes: its figures come from /proc, nothing is
faked."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import sched_probe  # noqa: E402


@pytest.fixture
def busy_process():
    """A child that spins on the CPU, named by a marker no other process has."""
    marker = f"rayapp-sched-probe-{uuid.uuid4().hex}"
    process = subprocess.Popen([sys.executable, "-c", "while True: pass", marker])
    try:
        deadline = time.monotonic() + 10
        while not sched_probe.matching_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child has exec'd and its command line shows the marker
        yield process, marker
    finally:
        process.kill()
        process.wait(timeout=10)


def test_a_spinning_process_is_seen_running(busy_process):
    process, marker = busy_process
    assert sched_probe.matching_pids(marker) == [process.pid]
    before = sched_probe.sample([process.pid])
    subprocess.run([sys.executable, "-c", "import time; time.sleep(1)"], check=True)
    after = sched_probe.sample([process.pid])
    main_thread = after[process.pid]
    # A pure spin never sleeps of its own accord and runs for most of a second on an idle core.
    assert main_thread.run_ns - before[process.pid].run_ns > 0.1e9
    assert main_thread.pid == process.pid


def test_table_lists_the_spinning_thread(busy_process, capsys):
    process, marker = busy_process
    assert sched_probe.main([marker, "0.5"]) == 0
    out = capsys.readouterr().out
    assert str(process.pid) in out and "all shown" in out


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (
            ["no-process-has-this-in-its-command-line-" + uuid.uuid4().hex, "0.1"],
            1,
            "no running process",
        ),
        (["anything", "0"], 2, "seconds must be > 0"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(argv, code, message, capsys):
    assert sched_probe.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
