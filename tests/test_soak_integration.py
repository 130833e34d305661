"""Soak: short jobs back to back on one warm cluster leak nothing.

After a first job has warmed everything up, the cluster's processes, their open file
descriptors, the ports they listen on and the temporary directories of the cluster and of every
job are counted; after the other jobs they are counted again. A job that leaked one process,
port, directory or two descriptors a node each time would show it four times over, past what the
counts allow. RAYAPP_SOAK_JOBS sets how many jobs (default 5; more for a longer soak)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import JOBS, cmdline, descendants, run_rayapp

from rayapp.launch import warm

pytestmark = [pytest.mark.integration, pytest.mark.slow]
JOBS_IN_A_ROW = int(os.environ.get("RAYAPP_SOAK_JOBS", "5"))
# Long-lived Ray processes whose descriptors grow with finished jobs by Ray's own design, counted
# apart: the log monitor keeps finished workers' log files open up to RAY_LOG_MONITOR_MAX_OPEN_FILES
# (200); the GCS keeps two sockets more per finished job (seen: 2 a job, every job).
COUNTED_APART = ("log_monitor.py", "gcs_server")


def process_name(pid: int) -> str:
    words = cmdline(pid).split()
    if not words:
        return "?"
    if os.path.basename(words[0]).startswith("python"):
        return os.path.basename(next((w for w in words[1:] if w.endswith(".py")), words[-1]))
    return os.path.basename(words[0])


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports in LISTEN held by these processes, from /proc/net/tcp and their descriptors."""
    owned = set().union(*(socket_inodes(pid) for pid in pids)) if pids else set()
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in owned:
            ports.add(int(fields[1].split(":")[1], 16))
    return ports


def descriptors(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def footprint(record: warm.WarmCluster, temp_root: Path) -> dict:
    processes = sorted(
        {*record.leaders, *(child for leader in record.leaders for child in descendants(leader))}
    )
    by_name: dict[str, int] = {}
    for pid in processes:
        by_name[process_name(pid)] = by_name.get(process_name(pid), 0) + descriptors(pid)
    return {
        "processes": len(processes),
        "descriptors": sum(n for name, n in by_name.items() if name not in COUNTED_APART),
        **{f"{name} descriptors": by_name.get(name, 0) for name in COUNTED_APART},
        "listening ports": len(listening_ports(processes)),
        "temp dirs": len(os.listdir(temp_root)),
        # per process, for the descriptors of the processes that live through every job
        "by pid": {pid: (process_name(pid), descriptors(pid)) for pid in processes},
    }


def lasting_descriptors(first: dict, last: dict) -> tuple[int, int]:
    """Descriptors held after the first and after the last job by the processes alive at both
    counts, the log monitor and the GCS apart. Ray's idle worker processes come and go between jobs
    (about 40 descriptors each); a new process carries nothing over from earlier jobs, so only a
    process that lives through them all can accumulate a leak."""
    lasting = [
        pid
        for pid, (name, _) in first["by pid"].items()
        if pid in last["by pid"] and name not in COUNTED_APART
    ]
    return sum(first["by pid"][pid][1] for pid in lasting), sum(
        last["by pid"][pid][1] for pid in lasting
    )


def test_jobs_in_a_row_leak_nothing(tmp_path, monkeypatch):
    # Everything the cluster and the jobs put in the temp dir goes in one of this test's own, with a
    # short path: Ray's socket paths under it must fit a Unix socket address (107 bytes).
    temp_root = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(temp_root))
    monkeypatch.setenv(warm.STATE_DIR_ENV, str(tmp_path / "state"))
    assert run_rayapp("cluster", "up", "--nodes", "2", cwd=tmp_path).returncode == 0
    record = warm.find()
    try:
        counts = []
        for job in range(JOBS_IN_A_ROW):
            result = run_rayapp(
                "submit",
                "--nodes",
                "2",
                "--epochs",
                "1",
                str(JOBS / "seed_linear.yaml"),
                cwd=tmp_path,
            )
            assert result.returncode == 0, f"job {job + 1}: {result.stderr[-2000:]}"
            counts.append(footprint(record, temp_root))
            print(
                f"after job {job + 1}: { ({k: v for k, v in counts[-1].items() if k != 'by pid'}) }"
            )
    finally:
        assert run_rayapp("cluster", "down", cwd=tmp_path).returncode == 0
        # torch's compile cache (torchinductor_<user>) is shared by every run on purpose
        left = [name for name in os.listdir(temp_root) if not name.startswith("torchinductor_")]
        shutil.rmtree(temp_root, ignore_errors=True)
    assert not left, f"left in the temp dir after `cluster down`: {left}"
    first, last = counts[0], counts[-1]
    # Ray keeps a pool of idle workers (one per CPU) for the next job; at the moment of counting
    # it may be full or refilling, hence one process (and its port) per node.
    assert last["processes"] <= first["processes"] + record.nodes, counts
    before, after = lasting_descriptors(first, last)
    grown = {
        f"{name} ({pid})": (n, last["by pid"][pid][1])
        for pid, (name, n) in first["by pid"].items()
        if pid in last["by pid"] and last["by pid"][pid][1] != n
    }
    print(f"lasting processes' descriptors: {before} -> {after}; changed: {grown}")
    # Each raylet keeps up to one descriptor more per finished job (seen: 55 -> 62 and 52 -> 55 over
    # nine jobs), as the GCS keeps two; plus two of slack a node for a connection open at the moment
    # of counting. A job that leaked two or more descriptors per node would go past it (after five
    # jobs: 2 x 2 nodes x 4 = 16 more, over the 12 allowed).
    allowed = before + (len(counts) - 1) * record.nodes + 2 * record.nodes
    assert after <= allowed, (before, after, allowed, grown)
    assert last["listening ports"] <= first["listening ports"] + record.nodes, counts
    assert last["temp dirs"] <= first["temp dirs"], counts
