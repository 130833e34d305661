"""Ray's token authentication as this process sees it: the one place rayapp reaches into Ray's
private API.

Ray (2.52 and later) reads RAY_AUTH_MODE and the token once per process and caches both in its
C++ core (``ray._raylet.Config`` and ``AuthenticationTokenLoader``); Ray offers no public call to
ask whether a token is at hand or to make the process see a changed environment. rayapp needs
both: the Jobs client sends a token only in token mode, and a sweep starts a second cluster with
its own token in the same process. Older Rays have no token auth, and these calls do nothing.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any

TOKEN_AUTH_SINCE = (2, 52)
"""The first Ray release with token authentication."""


def _core() -> Any | None:
    """``ray._raylet`` where this Ray has token auth, else None."""
    try:
        release = re.match(r"(\d+)\.(\d+)", version("ray"))
    except PackageNotFoundError:
        return None
    if release is None or (int(release[1]), int(release[2])) < TOKEN_AUTH_SINCE:
        return None
    try:
        from ray import _raylet
    except ImportError:
        return None
    return _raylet


def token_available() -> bool:
    """Whether Ray finds a token for this process (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token), whatever RAY_AUTH_MODE says."""
    core = _core()
    if core is None:
        return False
    try:
        return bool(core.AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True))
    except Exception:  # an unreadable RAY_AUTH_TOKEN_PATH: the request itself will say so
        return False


def sends_token() -> bool:
    """Whether this process's requests carry a token (token mode, and a token found)."""
    return os.environ.get("RAY_AUTH_MODE", "").lower() == "token" and token_available()


def http_headers() -> dict[str, str]:
    """The Authorization header Ray's own HTTP clients send from this process; {} when they send
    none (token mode off, or a Ray without token auth)."""
    core = _core()
    if core is None or not sends_token():  # Ray raises when token mode has no token to send
        return {}
    return dict(core.AuthenticationTokenLoader.instance().get_token_for_http_header())


def reload_settings(*, forget_token: bool = False) -> None:
    """Make Ray see this process's RAY_AUTH_* environment as it is now; with `forget_token`, read
    the token again too (Ray keeps the first one it read)."""
    core = _core()
    if core is None:
        return
    core.Config.initialize("")
    if forget_token:
        core.AuthenticationTokenLoader.instance().reset_cache()
