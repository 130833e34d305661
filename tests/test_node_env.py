"""The head's environment when it runs Ray's dashboard (rayapp.launch.node_env)."""

from __future__ import annotations

import getpass
import tempfile

from rayapp.launch.node_env import INDUCTOR_CACHE_ENV, dashboard_temp_env


def test_the_head_temp_is_the_clusters_and_torchs_compile_cache_stays_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try:
        env = dashboard_temp_env("/tmp/rayapp-abc")
    finally:
        tempfile.tempdir = None
    assert env == {
        "TMPDIR": "/tmp/rayapp-abc",
        INDUCTOR_CACHE_ENV: f"{tmp_path}/torchinductor_{getpass.getuser()}",
    }
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, "/data/inductor")  # the user's own stays theirs
    assert dashboard_temp_env("/tmp/rayapp-abc")[INDUCTOR_CACHE_ENV] == "/data/inductor"
