"""`rayapp hosts` refuses what it cannot do in one line, before making anything."""

from __future__ import annotations

from click.testing import CliRunner

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
