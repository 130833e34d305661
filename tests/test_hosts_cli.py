"""`rayapp hosts`: it refuses what it cannot do in one line, before making anything; as root, the
hosts it makes are what it prints, and `down` removes them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hosts_fixtures import assert_nothing_left, require_test_hosts

from rayapp.cli.app import main
from rayapp.launch import testhosts


def test_a_count_out_of_range_is_bad_input():
    result = CliRunner().invoke(main, ["hosts", "up", "--count", "0"])
    assert result.exit_code == 2
    assert "'--count': 0 is not in the range 1<=x<=100" in result.output


def test_without_root_one_line_says_so(monkeypatch):
    # This machine runs the tests as root; an ordinary user is what cannot exist here.
    monkeypatch.setattr(testhosts.os, "geteuid", lambda: 1000)
    result = CliRunner().invoke(main, ["hosts", "up", "--count", "2"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "rayapp: error: test hosts need root (network namespaces, bridges, mounts); run with sudo"
    ]


def test_status_with_no_hosts_up_says_how_to_make_them(tmp_path, monkeypatch):
    monkeypatch.setattr(testhosts, "STATE_DIR", tmp_path / "none")
    result = CliRunner().invoke(main, ["hosts", "status"])
    assert result.exit_code == 0
    assert "no test hosts are up" in result.output


@pytest.mark.hosts
def test_up_prints_what_onprem_yaml_needs_and_down_removes_everything():
    """`rayapp hosts up`, `status` and `down` as a user runs them: the printed values reach the
    printed hosts over SSH, each host is its own (its own address, its own /tmp, the shared
    directory shared), and `down` leaves nothing."""
    require_test_hosts()

    def rayapp(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "rayapp", "hosts", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    try:
        printed = rayapp("up", "--count", "2")
        values = dict(
            re.findall(r"^\s+(head_ip|worker_ips|ssh_user|ssh_private_key): (.+)$", printed, re.M)
        )
        assert values.keys() == {"head_ip", "worker_ips", "ssh_user", "ssh_private_key"}, printed
        head, workers = values["head_ip"], values["worker_ips"].strip("[]").split(", ")
        assert [head, *workers] == ["198.18.0.2", "198.18.0.3"], printed

        def ssh(address: str, command: str) -> str:
            done = subprocess.run(
                [
                    "ssh",
                    *testhosts.SSH_OPTIONS,
                    "-i",
                    values["ssh_private_key"],
                    f"{values['ssh_user']}@{address}",
                    command,
                ],
                capture_output=True,
                text=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
            )
            assert done.returncode == 0, done.stderr
            return done.stdout

        marker = f"rayapp-hosts-cli-{os.getpid()}"
        for address in (head, *workers):
            assert f"inet {address}/" in ssh(address, "ip -4 -o addr show"), address
        ssh(head, f"touch /tmp/{marker} {testhosts.SHARED_DIR}/{marker}")
        seen = ssh(
            workers[0],
            f"test -e /tmp/{marker} && echo tmp; "
            f"test -e {testhosts.SHARED_DIR}/{marker} && echo shared; true",
        )
        # The head's /tmp is its own; the shared directory is shared.
        assert seen.split() == ["shared"], seen
        assert not Path("/tmp", marker).exists()

        status = rayapp("status")
        for address in (head, *workers):
            assert re.search(
                rf"^\s+{re.escape(address)}\s+\d+ process\(es\), sshd up$", status, re.M
            ), status

        assert rayapp("down").startswith("rayapp: removed ")
        assert_nothing_left()
        assert (
            rayapp("status").strip()
            == "rayapp: no test hosts are up (rayapp hosts up --count N makes them)"
        )
    finally:
        testhosts.down()
