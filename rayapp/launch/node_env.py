"""Environment a node of rayapp's own clusters starts with, beyond the cluster's addresses."""

from __future__ import annotations

import getpass
import os
import re
import tempfile

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def dashboard_temp_env(cluster_temp_dir: str) -> dict[str, str]:
    """TMPDIR for a head that runs Ray's dashboard: the cluster's own temp dir, removed with it.

    The dashboard starts its modules through a multiprocessing forkserver, whose socket
    directory (pymp-*) under TMPDIR is removed only when the dashboard exits cleanly; stopped with
    its node, it stayed in the machine's /tmp, one per cluster. torch's compile cache, which
    would follow TMPDIR, stays where every run on this machine shares it (torch's default,
    <tmp>/torchinductor_<user>), unless the user named one."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    inductor_cache = os.environ.get(INDUCTOR_CACHE_ENV) or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{user}"
    )
    return {"TMPDIR": cluster_temp_dir, INDUCTOR_CACHE_ENV: inductor_cache}
