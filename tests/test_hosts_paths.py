"""The test hosts run this machine's Python even where it lives in a directory the hosts replace
with their own (/tmp, root's home): a clone made under /tmp, its environment inside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import REPO
from hosts_fixtures import require_test_hosts

from rayapp.launch import testhosts

pytestmark = pytest.mark.hosts

ON_A_HOST = textwrap.dedent(
    """
    import os, sys
    from rayapp.launch import testhosts

    hosts = testhosts.up(1, owner_pid=os.getpid())
    try:
        shown = hosts.hosts[0].run(
            [sys.executable, "-c", "import rayapp, sys; print(rayapp.__file__, sys.prefix)"],
            capture_output=True, text=True, timeout=60,
        )
        print(shown.returncode, shown.stdout.strip(), shown.stderr.strip()[-500:])
    finally:
        testhosts.down()
    """
)


def test_a_clone_and_its_environment_under_tmp_run_on_the_hosts():
    require_test_hosts()
    clone = Path(tempfile.mkdtemp(prefix="rayapp-clone-", dir="/tmp"))
    try:
        shutil.copytree(
            REPO / "rayapp", clone / "rayapp", ignore=shutil.ignore_patterns("__pycache__")
        )
        venv = clone / ".venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        # The clone's rayapp first; the packages it imports from this environment.
        site = Path(sys.prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}")
        path = os.pathsep.join([str(clone), str(site / "site-packages")])
        result = subprocess.run(
            [venv / "bin" / "python", "-c", ON_A_HOST],
            cwd=clone,
            env={**os.environ, "PYTHONPATH": path},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        code, module, prefix = result.stdout.split()[:3]
        assert (code, module, prefix) == ("0", f"{clone}/rayapp/__init__.py", str(venv)), (
            result.stdout
        )
    finally:
        testhosts.down()  # whatever the child left, if it died before its own cleanup
        shutil.rmtree(clone, ignore_errors=True)
    assert testhosts.leftovers() == []
