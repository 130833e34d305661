"""The Ray Jobs API client rayapp uses (`--address http://HEAD:8265`): connect, submit, follow,
stop. It returns data and raises :class:`RayappError` with one line saying what to do; printing,
prompting and exit codes are the CLI's (:mod:`rayapp.cli.jobs`).

Ray token authentication: the Jobs client sends the cluster's token when ``RAY_AUTH_MODE=token``
is set and a token is found in ``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH`` or
``~/.ray/auth_token``. When ``RAY_AUTH_MODE`` is unset but such a token exists, rayapp turns token
mode on for its own process, as ``ray.init()`` does when it connects to an existing cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

import tenacity

from rayapp.errors import RayappError, first_line
from rayapp.launch import ray_auth

DEFAULT_DASHBOARD_ADDRESS = "http://127.0.0.1:8265"
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
STOP_TIMEOUT_S = 60.0
# How long a submission retries while the head has no job agent yet (right after `ray up`).
AGENT_WAIT_S = 30.0
REACH_TIMEOUT_S = 10.0
"""How long the head has to answer at all: a dropped connection (an address no machine holds, a
firewall) would otherwise wait minutes for the operating system to give up."""
TUNNEL_HINT = (
    "for a cloud cluster, open the SSH tunnel first with `ray dashboard "
    f"cluster_configs/<cloud>.yaml` and use --address {DEFAULT_DASHBOARD_ADDRESS}"
)


def normalize_address(address: str) -> str:
    return address.strip().rstrip("/")


def default_address() -> str:
    """$RAY_ADDRESS when it is a dashboard URL, else the local dashboard (or an SSH tunnel to
    one)."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    return env if env.startswith(("http://", "https://")) else DEFAULT_DASHBOARD_ADDRESS


def use_token_if_available() -> None:
    """Turn on Ray token auth for this process when RAY_AUTH_MODE is unset but a token exists.

    The Jobs client only sends a token in token mode; `ray.init()` makes the same choice when it
    connects to an existing cluster. An explicit RAY_AUTH_MODE (token or disabled) is respected.
    """
    if os.environ.get("RAY_AUTH_MODE") is not None or not ray_auth.token_available():
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    ray_auth.reload_settings()


def quiet_ray_client_logs() -> None:
    """Importing Ray sets its loggers to INFO; the client's upload and websocket notices are not for
    a person."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name == "ray" or name.startswith("ray.")) and isinstance(logger, logging.Logger):
            if logger.level < logging.WARNING:
                logger.setLevel(logging.WARNING)


def connect(address: str) -> Any:
    """A JobSubmissionClient for `address`, or a one-line RayappError saying why there is none."""
    if not address.startswith(("http://", "https://")):
        raise RayappError(f"--address {address!r} is not a Ray Jobs API URL; use http://HEAD:8265")
    use_token_if_available()
    check_reachable(address)  # Ray's client waits as long as the operating system does
    from ray.job_submission import JobSubmissionClient

    quiet_ray_client_logs()

    class Client(JobSubmissionClient):
        """Ray's Jobs client, raising a refused request as a JobsApiError with its HTTP status:
        Ray's own RuntimeError holds the status only in its text. Every failed response goes
        through _raise_error (ray.dashboard.modules.dashboard_sdk)."""

        def _raise_error(self, r: Any) -> None:
            raise JobsApiError(r.status_code, r.text)

    try:
        with api_errors(address):
            return Client(address)
    except RayappError:
        raise
    except RuntimeError:  # the client's version check: /api/version missing, or Ray < 2.0 there
        raise RayappError(
            f"{address} is not a Ray dashboard (no Jobs API of Ray 2.0 or later there); "
            f"{TUNNEL_HINT}"
        ) from None


class JobsApiError(RuntimeError):
    """A Jobs API request the dashboard refused with an HTTP error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {first_line(body) or 'no reason given'}")
        self.status, self.body = status, body


@contextlib.contextmanager
def api_errors(address: str, submission_id: str | None = None) -> Iterator[None]:
    """Turn what the Jobs client raises into one line that says what to do."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError:
        if ray_auth.sends_token():  # 403: a token went and was refused; else 401: none went
            raise RayappError(
                f"the Ray cluster at {address} rejected this machine's "
                "token; get the cluster's token (the file ~/.ray/auth_token "
                "on the head node) and point RAY_AUTH_TOKEN_PATH at it"
            ) from None
        raise RayappError(
            f"the Ray cluster at {address} requires a token; export RAY_AUTH_MODE=token and "
            "RAY_AUTH_TOKEN_PATH=<the cluster's token file> (or copy it to ~/.ray/auth_token)"
        ) from None
    except (ConnectionError, requests.exceptions.ConnectionError):
        raise RayappError(
            f"cannot reach the Ray Jobs API at {address}: nothing answers there; {TUNNEL_HINT}"
        ) from None
    except requests.exceptions.RequestException as exc:
        raise RayappError(
            f"cannot reach the Ray Jobs API at {address} ({type(exc).__name__}: "
            f"{first_line(exc)}); {TUNNEL_HINT}"
        ) from None
    except JobsApiError as exc:
        if submission_id and exc.status == HTTPStatus.NOT_FOUND:
            raise RayappError(
                f"no job {submission_id!r} on the Ray cluster at {address}; "
                f"`rayapp status --address {address}` lists its jobs"
            ) from None
        raise RayappError(f"the Ray Jobs API at {address} refused the request: {exc}") from None


def job_info(client: Any, submission_id: str, address: str) -> Any:
    with api_errors(address, submission_id):
        return client.get_job_info(submission_id)


def list_submissions(client: Any, address: str) -> list:
    """Submitted jobs (not interactive drivers), newest first."""
    with api_errors(address):
        jobs = client.list_jobs()
    submitted = [job for job in jobs if job.submission_id]
    return sorted(submitted, key=lambda job: job.start_time or 0, reverse=True)


def stream_logs(
    client: Any, submission_id: str, address: str, write: Callable[[str], None]
) -> None:
    """Hand the job's output to `write` as it comes, until the job ends."""

    async def pump() -> None:
        async for chunk in client.tail_job_logs(submission_id):
            write(chunk)

    job_info(client, submission_id, address)  # an unknown id fails here, in one line
    try:
        asyncio.run(pump())
    except (KeyboardInterrupt, RayappError):
        raise
    except Exception as exc:  # the websocket dropped: the tunnel or the dashboard went away
        raise RayappError(
            f"lost the log stream of job {submission_id} from {address} "
            f"({first_line(exc) or type(exc).__name__}); the job may still "
            f"be running: rayapp status {submission_id} --address {address}"
        ) from None


def job_logs(client: Any, submission_id: str, address: str) -> str:
    """The job's output so far."""
    job_info(client, submission_id, address)
    with api_errors(address, submission_id):
        return client.get_job_logs(submission_id)


def wait_for_terminal(client: Any, submission_id: str, address: str, *, timeout_s: float) -> Any:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED; returns its info."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = job_info(client, submission_id, address)
        if str(info.status) in TERMINAL_STATUSES or time.monotonic() > deadline:
            return info
        time.sleep(1.0)


def stop_job(client: Any, submission_id: str, address: str, *, timeout_s: float) -> str:
    """Ask the cluster to stop the job and wait until it has; returns the final status."""
    info = job_info(client, submission_id, address)
    if str(info.status) in TERMINAL_STATUSES:
        return str(info.status)
    with api_errors(address, submission_id):
        client.stop_job(submission_id)
    info = wait_for_terminal(client, submission_id, address, timeout_s=timeout_s)
    status = str(info.status)
    if status not in TERMINAL_STATUSES:
        raise RayappError(
            f"job {submission_id} is still {status} {timeout_s:.0f}s after the stop request; "
            f"check again with rayapp status {submission_id} --address {address}"
        )
    return status


def submit_with_retry(submit: Any, address: str) -> None:
    """submit(), again every 2 s for up to AGENT_WAIT_S while the head has no job agent yet."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_no_agent_yet),
        stop=tenacity.stop_after_delay(AGENT_WAIT_S),
        wait=tenacity.wait_fixed(2.0),
        reraise=True,
    )
    with api_errors(address):
        for attempt in retrying:
            with attempt:
                submit()


def _no_agent_yet(exc: BaseException) -> bool:
    """A cluster that has just started has no job agent registered yet: Ray answers 500, "No
    available agent to submit job, please try again later" (job_head.py)."""
    return (
        isinstance(exc, JobsApiError)
        and exc.status == HTTPStatus.INTERNAL_SERVER_ERROR
        and "No available agent" in exc.body
    )


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Fail within timeout_s when nothing answers at `address` (the dashboard's health check,
    which needs no token)."""
    import requests

    with api_errors(address):  # a refused connection or a bad URL: said as for any request
        try:
            requests.get(f"{address}/api/healthz", timeout=timeout_s)
        except requests.exceptions.ConnectTimeout:
            raise RayappError(
                f"no answer from {address} within {timeout_s:g} s: nothing took the connection "
                "(a wrong address, a head that is down, or a firewall dropping the port); "
                f"{TUNNEL_HINT}"
            ) from None
        except requests.exceptions.ReadTimeout:
            raise RayappError(
                f"{address} took the connection but sent no answer within {timeout_s:g} s; "
                "is it the head's dashboard (port 8265)?"
            ) from None


def cluster_ray_version(address: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """The Ray version the cluster's dashboard reports; None when it does not say."""
    import requests

    try:
        response = requests.get(
            f"{address}/api/version", headers=ray_auth.http_headers(), timeout=timeout_s
        )
        return str(response.json()["ray_version"]) if response.status_code == 200 else None
    except (requests.exceptions.RequestException, ValueError, KeyError, TypeError):
        return None


def ray_version_problem(
    address: str, cluster_version: str | None, local_version: str
) -> str | None:
    """One line when this machine's Ray differs from the cluster's; None when they match or the
    cluster did not say."""
    if cluster_version is None or cluster_version == local_version:
        return None
    return (
        f"the Ray cluster at {address} runs Ray {cluster_version} and this machine Ray "
        f"{local_version}; install the cluster's version here (pip install "
        f"'ray[default,train]=={cluster_version}') or the same Ray on the cluster's nodes"
    )
