"""conftest.wait_for_line, the helper the integration tests use to act at a given point of a run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import wait_for_line

# a burst of lines in one write, the needle last, then silence: the shape of a run's start-up output
BURST = (
    "import sys, time; sys.stdout.write(''.join(f'line {i}\\n' for i in range(50)) + "
    "'needle\\n'); sys.stdout.flush(); time.sleep(60)"
)


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_a_needle_at_the_end_of_a_burst_is_seen_while_the_process_still_runs():
    process = child(BURST)
    try:
        started = time.monotonic()
        seen = wait_for_line(process, "needle", timeout=20)
        assert time.monotonic() - started < 15
        assert process.poll() is None
        assert len(seen) == 51 and seen[-1] == "needle\n"
    finally:
        process.kill()
        process.wait()


def test_a_needle_that_never_comes_fails_with_the_output_so_far():
    process = child("print('only this'); import time; time.sleep(60)")
    try:
        with pytest.raises(AssertionError, match="(?s)never saw .needle.*only this"):
            wait_for_line(process, "needle", timeout=3)
    finally:
        process.kill()
        process.wait()


def test_a_process_that_ends_without_the_needle_fails_at_once():
    process = child("print('bye')")
    started = time.monotonic()
    with pytest.raises(AssertionError, match="never saw 'needle'"):
        wait_for_line(process, "needle", timeout=30)
    assert time.monotonic() - started < 15
    process.wait()
