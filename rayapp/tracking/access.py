"""Whether an MLflow tracking server takes requests from here: one read of its REST API with a
short timeout (MLflow's own client retries for minutes), and what the answer means, in one line.

Used on the submitting machine before any cluster starts and, on a real cluster, from every node
before training (:mod:`rayapp.launch.node_check`). Imports only the standard library and
``requests``, so a node that lacks MLflow or torch can still run it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from rayapp.errors import first_line

ACCESS_CHECK_TIMEOUT_S = 10.0
ACCESS_CHECK_PATH = "/api/2.0/mlflow/experiments/search"
"""An API read: MLflow exempts /health from its Host-header check, so /health says nothing of it."""
HOST_HEADER_REFUSAL = "Invalid Host header"
"""What MLflow 3's server answers (HTTP 403) to a Host header outside its --allowed-hosts."""
PERMISSION_REFUSAL = "Permission denied"
"""What MLflow's basic-auth app answers (HTTP 403) to an account without the permission."""


@dataclass(frozen=True)
class ServerAnswer:
    status: int | None
    """The HTTP status; None when the server did not answer."""
    body: str = ""
    failure: str = ""
    """Why there was no answer, in words: `connection refused`, `no answer within 10 s`."""


def is_server_uri(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def host_header(uri: str) -> str:
    """The Host header a client sends for `uri`: host[:port], as in the URI."""
    return urlparse(uri).netloc.rsplit("@", 1)[-1]


def request_auth(
    credentials: Mapping[str, str],
) -> tuple[tuple[str, str] | None, dict[str, str]]:
    """The basic-auth pair or the bearer header (requests' `auth`, `headers`) that MLflow's client
    would send with these MLFLOW_TRACKING_* credentials; a token wins over a user name."""
    if "MLFLOW_TRACKING_TOKEN" in credentials:
        return None, {"Authorization": f"Bearer {credentials['MLFLOW_TRACKING_TOKEN']}"}
    if "MLFLOW_TRACKING_USERNAME" in credentials:
        user = credentials["MLFLOW_TRACKING_USERNAME"]
        return (user, credentials.get("MLFLOW_TRACKING_PASSWORD", "")), {}
    return None, {}


def ask_server(
    uri: str, credentials: Mapping[str, str], timeout_s: float = ACCESS_CHECK_TIMEOUT_S
) -> ServerAnswer:
    """One GET of the server's experiment search with these credentials."""
    import requests

    auth, headers = request_auth(credentials)
    try:
        response = requests.get(
            f"{uri.rstrip('/')}{ACCESS_CHECK_PATH}",
            params={"max_results": 1},
            auth=auth,
            headers=headers,
            timeout=timeout_s,
            verify=os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() != "true",
        )
    except requests.Timeout:
        return ServerAnswer(None, failure=f"no answer within {timeout_s:g} s")
    except requests.ConnectionError as exc:
        refused = "refused" in str(exc).lower()
        return ServerAnswer(None, failure="connection refused" if refused else _reason(exc))
    except requests.RequestException as exc:
        return ServerAnswer(None, failure=_reason(exc))
    return ServerAnswer(response.status_code, body=response.text[:500])


def _reason(exc: BaseException) -> str:
    """The innermost cause of a requests error (`Name or service not known`, ...), short."""
    text = str(exc)
    for marker in ("] ", ": "):
        if marker in text:
            text = text.rsplit(marker, 1)[-1]
    return text.strip(" )'\"") or type(exc).__name__


def who(credentials: Mapping[str, str]) -> str:
    if "MLFLOW_TRACKING_USERNAME" in credentials:
        return f"user {credentials['MLFLOW_TRACKING_USERNAME']!r}"
    return "a token" if "MLFLOW_TRACKING_TOKEN" in credentials else "no credentials"


def refusal(uri: str, answer: ServerAnswer, credentials: Mapping[str, str]) -> str | None:
    """What the server's refusal means and how to fix it; None when it did not refuse.

    An HTTP 403 is a credentials problem only when the server says so (basic-auth's `Permission
    denied`); MLflow's Host-header guard answers 403 too, and more passwords would not help."""
    status, body = answer.status, answer.body
    if status == 403 and HOST_HEADER_REFUSAL in body:
        host = host_header(uri)
        return (
            f"MLflow at {uri} refused the Host header {host!r} (HTTP 403: {body.strip()}); "
            f"start the server with `mlflow server --allowed-hosts {host},...` naming every "
            "host name and address clients use for it"
        )
    if status == 401 or (status == 403 and PERMISSION_REFUSAL in body):
        return (
            f"MLflow at {uri} refused {who(credentials)} (HTTP {status}); set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) "
            "to an account that may write runs"
        )
    if status == 403:
        said = first_line(body)[:200] or "no reason given"
        return (
            f"MLflow at {uri} refused the request (HTTP 403: {said}); it is not MLflow's "
            "credentials answer, so check what stands in front of the server (a proxy's or "
            "firewall's access rules)"
        )
    return None
