"""rayapp.launch.ray_auth against the installed Ray: whether a token is at hand, whether this
process sends one, and the header it goes in, read as Ray reads them (each case in a fresh
process: Ray caches both)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = (
    "from rayapp.launch import ray_auth; "
    "print(ray_auth.token_available(), ray_auth.sends_token(), ray_auth.http_headers())"
)


def probe(home, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, "HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "False False {}"),  # no token anywhere
        ({"RAY_AUTH_TOKEN": "a" * 64}, "True False {}"),  # a token, but token mode is off
        (
            {"RAY_AUTH_TOKEN": "a" * 64, "RAY_AUTH_MODE": "token"},
            "True True {'authorization': 'Bearer " + "a" * 64 + "'}",
        ),
        ({"RAY_AUTH_MODE": "token"}, "False False {}"),  # token mode with nothing to send
    ],
)
def test_token_at_hand_and_sent(tmp_path, env, expected):
    assert probe(tmp_path, **env) == expected


def test_the_default_token_file_counts(tmp_path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("b" * 64)
    assert probe(tmp_path, RAY_AUTH_MODE="token") == (
        "True True {'authorization': 'Bearer " + "b" * 64 + "'}"
    )
