"""Submit a job to a running Ray cluster through the Ray Jobs API (`--address http://HEAD:8265`).

The laptop resolves and validates the job spec, writes it to a one-file working directory and
submits ``python -m rayapp.remote submit job.yaml`` (the ``rayapp submit`` CLI, see :func:`job_main`)
as a Ray job. The job's driver runs on the head node with ``cluster.address: auto``, i.e. on the
cluster it was submitted to, and logs to the MLflow tracking server named in the spec. This side then streams the job's output and reports
how it ended; ``rayapp status``, ``rayapp logs`` and ``rayapp stop`` (:mod:`rayapp.cli_remote`)
follow it later.

Ray token authentication: the Jobs client sends the cluster's token when ``RAY_AUTH_MODE=token``
is set and a token is found in ``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH`` or
``~/.ray/auth_token``. When ``RAY_AUTH_MODE`` is unset but such a token exists, rayapp turns token
mode on for its own process, as ``ray.init()`` does when it connects to an existing cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import re
import secrets
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import urlparse

import click

from rayapp.errors import RayappError
from rayapp.spec import JobSpec
from rayapp.tracking.run import resolve_tracking_uri

DEFAULT_DASHBOARD_ADDRESS = "http://127.0.0.1:8265"
EXIT_INTERRUPTED = 130
JOB_FILE = "job.yaml"
# The job's driver runs `python -m rayapp.remote submit job.yaml ...`: the `rayapp` CLI, entered
# through job_main() below so that `rayapp stop` can interrupt it.
JOB_ENTRY_MODULE = "rayapp.launch.jobs_api"
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
STOP_TIMEOUT_S = 60.0
# How long a submission retries while the head has no job agent yet (right after `ray up`).
AGENT_WAIT_S = 30.0
# After `rayapp stop` the driver gets SIGINT (not Ray's default SIGTERM, which ends Python without
# running cleanup), so it aborts training, closes its MLflow run and releases the workers; it is
# SIGKILLed only if it has not exited after this long.
DRIVER_STOP_GRACE_S = 30
# MLflow client settings (never credentials) that the job's driver inherits from this terminal.
MLFLOW_SETTINGS_PASSED_ON = (
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_TRACKING_INSECURE_TLS",
)
TUNNEL_HINT = (
    "for a cloud cluster, open the SSH tunnel first with `ray dashboard cluster_configs/<cloud>.yaml` "
    f"and use --address {DEFAULT_DASHBOARD_ADDRESS}"
)


# ---- submit ---------------------------------------------------------------------------


def submit_remote(spec: JobSpec, *, job_yaml: Optional[str], detach: bool, schedule_timeout_s: float) -> int:
    """Submit `spec` as a Ray job to the Jobs API at spec.cluster.address; returns the exit code.

    job_yaml is only the file the spec was read from; the job runs the resolved spec, so the
    flags given here (--nodes, --epochs, ...) hold on the cluster too.
    """
    address = normalize_address(spec.cluster.address or DEFAULT_DASHBOARD_ADDRESS)
    tracking_uri = cluster_tracking_uri(spec, address)
    client = connect(address)
    submission_id = new_submission_id(spec.name)
    entrypoint = " ".join(
        shlex.quote(part)
        for part in ("python", "-m", JOB_ENTRY_MODULE, "submit", JOB_FILE, "--schedule-timeout", f"{schedule_timeout_s:g}")
    )
    with tempfile.TemporaryDirectory(prefix="rayapp-job-") as working_dir:
        Path(working_dir, JOB_FILE).write_text(remote_job_yaml(spec, tracking_uri), encoding="utf-8")
        submit = functools.partial(
            client.submit_job,
            entrypoint=entrypoint,
            submission_id=submission_id,
            runtime_env={"working_dir": working_dir, "env_vars": driver_env_vars(tracking_uri)},
            metadata={
                "rayapp_job": spec.name,
                "rayapp_nodes": str(spec.cluster.nodes),
                "rayapp_job_file": str(job_yaml or ""),
            },
        )
        try:
            submit_with_retry(submit, address)
        except KeyboardInterrupt:
            click.secho(
                f"rayapp: error: interrupted while submitting; the job may have been submitted as {submission_id}: "
                f"rayapp status --address {address}",
                err=True, fg="red",
            )
            return EXIT_INTERRUPTED
    echo = click.echo
    click.secho(f"submitted {submission_id} to {address}", bold=True)
    echo(f"  job {spec.name!r}: {spec.world_size} worker(s) on {spec.cluster.nodes} node(s); MLflow: {tracking_uri}")
    if "://" not in spec.cluster.storage_path:
        echo(
            f"  note: checkpoints go to {spec.cluster.storage_path!r} on the cluster's nodes; on a multi-machine "
            "cluster pass shared storage, e.g. --storage-path s3://BUCKET/rayapp"
        )
    print_follow_commands(submission_id, address)
    if detach:
        return 0
    return follow(client, submission_id, address)


def submit_with_retry(submit: Any, address: str) -> None:
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            with api_errors(address):
                submit()
            return
        except RayappError as exc:
            # A cluster that has just started has no job agent registered yet; Ray says "try again later".
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def print_follow_commands(submission_id: str, address: str) -> None:
    click.echo(f"  status: rayapp status {submission_id} --address {address}")
    click.echo(f"  logs:   rayapp logs {submission_id} -f --address {address}")
    click.echo(f"  stop:   rayapp stop {submission_id} --address {address}")


def follow(client: Any, submission_id: str, address: str) -> int:
    """Stream the job's logs until it ends; 0 if it SUCCEEDED, else 1. Ctrl-C asks: stop or detach."""
    click.echo("streaming the job's output (Ctrl-C to stop or detach):")
    try:
        stream_logs(client, submission_id, address)
        info = wait_for_terminal(client, submission_id, address, timeout_s=60.0)
    except KeyboardInterrupt:
        return on_interrupt(client, submission_id, address)
    status = str(info.status)
    if status == "SUCCEEDED":
        click.secho(f"job {submission_id} SUCCEEDED", fg="green")
        return 0
    if status not in TERMINAL_STATUSES:
        click.secho(
            f"rayapp: error: the log stream ended while job {submission_id} is still {status}; "
            f"follow it with rayapp logs {submission_id} -f --address {address}",
            err=True, fg="red",
        )
        return 1
    # Ray appends the driver's last output to the message; it has just been streamed above.
    message = re.sub(r",? *last available logs.*$", "", one_line(info.message or "")).rstrip(" :")
    detail = f": {message}" if message else ""
    click.secho(f"rayapp: error: job {submission_id} ended {status}{detail}", err=True, fg="red")
    return 1


def on_interrupt(client: Any, submission_id: str, address: str) -> int:
    """Ctrl-C while following a job: stop it, or leave it running (the default)."""
    click.echo("")
    if not sys.stdin.isatty():
        click.echo(f"interrupted; no terminal to ask whether to stop it, so job {submission_id} keeps running (detached)")
        print_follow_commands(submission_id, address)
        return 0
    try:
        choice = click.prompt(
            f"interrupted: stop job {submission_id}, or detach and leave it running?",
            type=click.Choice(["detach", "stop"]),
            default="detach",
        )
    except (click.Abort, KeyboardInterrupt, EOFError):
        choice = "detach"
    if choice == "detach":
        click.echo(f"detached; job {submission_id} keeps running")
        print_follow_commands(submission_id, address)
        return 0
    click.echo(f"stopping job {submission_id} ...")
    try:
        status = stop_job(client, submission_id, address, timeout_s=STOP_TIMEOUT_S)
    except KeyboardInterrupt:
        click.echo(f"not waiting; check that it stopped with rayapp status {submission_id} --address {address}")
        return EXIT_INTERRUPTED
    click.echo(f"job {submission_id} {status}")
    return EXIT_INTERRUPTED


# ---- the spec the cluster runs ---------------------------------------------------------


def normalize_address(address: str) -> str:
    return address.strip().rstrip("/")


def cluster_tracking_uri(spec: JobSpec, address: str) -> str:
    """The tracking URI the job's driver will use; refused when it names a store on this machine."""
    given = spec.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    uri = resolve_tracking_uri(spec.tracking.tracking_uri)
    if is_local_store(uri):
        source = "--tracking-uri" if spec.tracking.tracking_uri else (
            "$MLFLOW_TRACKING_URI" if given else "the default MLflow store"
        )
        raise RayappError(
            f"{source} {uri!r} is a store on this machine, which the Ray cluster at {address} cannot write to; "
            "pass --tracking-uri http://MLFLOW_HOST:5000 (the team's `mlflow server`, see docs/clusters.md)"
        )
    return uri


def is_local_store(uri: str) -> bool:
    """sqlite:, file: and plain paths resolve on the laptop; servers and databases do not."""
    if uri.startswith("databricks"):
        return False
    scheme = urlparse(uri).scheme.lower()
    return scheme in ("", "file", "sqlite") or len(scheme) == 1  # len 1: a Windows drive letter


def remote_job_yaml(spec: JobSpec, tracking_uri: str) -> str:
    """The resolved spec as a job YAML the loader accepts, pointed at the cluster it runs on."""
    import yaml

    document = _plain(dataclasses.asdict(spec))
    document["cluster"]["address"] = "auto"
    document["tracking"]["tracking_uri"] = tracking_uri
    return (
        f"# Resolved job spec submitted by `rayapp submit --address` for job {spec.name!r}.\n"
        + yaml.safe_dump(document, sort_keys=False)
    )


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def driver_env_vars(tracking_uri: str) -> dict[str, str]:
    env = {
        "MLFLOW_TRACKING_URI": tracking_uri,
        "RAY_JOB_STOP_SIGNAL": "SIGINT",
        "RAY_JOB_STOP_WAIT_TIME_S": str(DRIVER_STOP_GRACE_S),
    }
    for name in MLFLOW_SETTINGS_PASSED_ON:
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def new_submission_id(job_name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", job_name).strip("-")[:40] or "job"
    return f"rayapp-{safe}-{secrets.token_hex(4)}"


# ---- the Jobs API ----------------------------------------------------------------------


def default_address() -> str:
    """$RAY_ADDRESS when it is a dashboard URL, else the local dashboard (or an SSH tunnel to one)."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    return env if env.startswith(("http://", "https://")) else DEFAULT_DASHBOARD_ADDRESS


def use_token_if_available() -> None:
    """Turn on Ray token auth for this process when RAY_AUTH_MODE is unset but a token exists.

    The Jobs client only sends a token in token mode; `ray.init()` makes the same choice when it
    connects to an existing cluster. An explicit RAY_AUTH_MODE (token or disabled) is respected.
    """
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token auth
        return
    try:
        if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
            return
    except Exception:  # an unreadable RAY_AUTH_TOKEN_PATH: the request will say what is wrong
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")


def quiet_ray_client_logs() -> None:
    """Importing Ray sets its loggers to INFO; the client's upload and websocket notices are not for a person."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name == "ray" or name.startswith("ray.")) and isinstance(logger, logging.Logger):
            if logger.level < logging.WARNING:
                logger.setLevel(logging.WARNING)


def connect(address: str) -> Any:
    """A JobSubmissionClient for `address`, or a one-line RayappError saying why there is none."""
    if not address.startswith(("http://", "https://")):
        raise RayappError(f"--address {address!r} is not a Ray Jobs API URL; use http://HEAD:8265")
    use_token_if_available()
    from ray.job_submission import JobSubmissionClient

    quiet_ray_client_logs()

    with api_errors(address):
        return JobSubmissionClient(address)


@contextlib.contextmanager
def api_errors(address: str, submission_id: Optional[str] = None) -> Iterator[None]:
    """Turn what the Jobs client raises into one line that says what to do."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as exc:
        text = str(exc)
        if "Authentication failed" in text or "403" in text:
            raise RayappError(
                f"the Ray cluster at {address} rejected this machine's token; get the cluster's token "
                "(the file ~/.ray/auth_token on the head node) and point RAY_AUTH_TOKEN_PATH at it"
            ) from None
        raise RayappError(
            f"the Ray cluster at {address} requires a token; export RAY_AUTH_MODE=token and "
            "RAY_AUTH_TOKEN_PATH=<the cluster's token file> (or copy it to ~/.ray/auth_token)"
        ) from None
    except (ConnectionError, requests.exceptions.ConnectionError):
        raise RayappError(f"cannot reach the Ray Jobs API at {address}: nothing answers there; {TUNNEL_HINT}") from None
    except requests.exceptions.RequestException as exc:
        raise RayappError(
            f"cannot reach the Ray Jobs API at {address} ({type(exc).__name__}: {one_line(str(exc))}); {TUNNEL_HINT}"
        ) from None
    except RuntimeError as exc:
        text = one_line(str(exc))
        if submission_id and ("404" in text or "does not exist" in text):
            raise RayappError(
                f"no job {submission_id!r} on the Ray cluster at {address}; `rayapp status --address {address}` "
                "lists its jobs"
            ) from None
        if "Version check returned 404" in text or "Jobs API is not supported" in text:
            raise RayappError(f"{address} is not a Ray dashboard (no Jobs API there); {TUNNEL_HINT}") from None
        raise RayappError(f"the Ray Jobs API at {address} refused the request: {text}") from None


def job_info(client: Any, submission_id: str, address: str) -> Any:
    with api_errors(address, submission_id):
        return client.get_job_info(submission_id)


def list_submissions(client: Any, address: str) -> list:
    """Submitted jobs (not interactive drivers), newest first."""
    with api_errors(address):
        jobs = client.list_jobs()
    submitted = [job for job in jobs if job.submission_id]
    return sorted(submitted, key=lambda job: job.start_time or 0, reverse=True)


def stream_logs(client: Any, submission_id: str, address: str) -> None:
    """Write the job's output to this terminal as it comes, until the job ends."""

    async def pump() -> None:
        async for chunk in client.tail_job_logs(submission_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    job_info(client, submission_id, address)  # an unknown id fails here, in one line
    try:
        asyncio.run(pump())
    except (KeyboardInterrupt, RayappError):
        raise
    except Exception as exc:  # the websocket dropped: the tunnel or the dashboard went away
        raise RayappError(
            f"lost the log stream of job {submission_id} from {address} ({one_line(str(exc)) or type(exc).__name__}); "
            f"the job may still be running: rayapp status {submission_id} --address {address}"
        ) from None


def print_logs(client: Any, submission_id: str, address: str) -> None:
    job_info(client, submission_id, address)
    with api_errors(address, submission_id):
        text = client.get_job_logs(submission_id)
    sys.stdout.write(text)
    sys.stdout.flush()


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


def one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


# ---- the job's driver, on the cluster ----------------------------------------------------


def job_main() -> None:
    """`python -m rayapp.remote submit job.yaml ...`: the `rayapp` CLI as a Ray job's driver.

    Ray starts job drivers with SIGINT ignored (inherited from its worker processes), and Python
    then leaves it ignored, so the SIGINT `rayapp stop` sends would do nothing until Ray's SIGKILL.
    Restoring Python's handler turns it into KeyboardInterrupt: the driver marks its MLflow run
    KILLED and shuts down its Ray Train workers, as after Ctrl-C in a terminal.
    """
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    from rayapp.cli import main

    main(prog_name="rayapp")


if __name__ == "__main__":
    job_main()
