"""What a Jobs API submission (`rayapp submit --address http://HEAD:8265`) sends to the cluster.

The laptop resolves and validates the job spec and writes it, pointed at the cluster, as
``job.yaml`` into a working directory, beside a copy of the user's code when the job names any.
The submission's entrypoint, ``python -m rayapp.cli.job_entry submit job.yaml``, is the
``rayapp submit`` CLI run as the job's driver on the head node (``cluster.address: auto``); it
logs to the MLflow tracking server named in the spec. This rayapp package goes with the job
(runtime_env ``py_modules``), so the cluster's Python needs only Ray, torch, MLflow and rayapp's
small dependencies; the laptop's versions go too, for the driver to compare with the head's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import secrets
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rayapp.errors import RayappError
from rayapp.launch import working_dir
from rayapp.launch.jobs_api import (
    DEFAULT_DASHBOARD_ADDRESS,
    cluster_ray_version,
    connect,
    normalize_address,
    ray_version_problem,
    submit_with_retry,
)
from rayapp.launch.versions import SUBMITTED_WITH_ENV, this_environment
from rayapp.spec import JobSpec
from rayapp.spec.loader import spec_document
from rayapp.tracking.run import resolve_tracking_uri

JOB_FILE = "job.yaml"
JOB_ENTRY_MODULE = "rayapp.cli.job_entry"
# After `rayapp stop` the driver gets SIGINT (not Ray's default SIGTERM, which ends Python without
# running cleanup), so it aborts training, closes its MLflow run and releases the workers; it is
# SIGKILLed only if it has not exited after this long.
DRIVER_STOP_GRACE_S = 30
# MLflow client settings that the job's driver inherits from this terminal. Credentials are not
# among them: they would be visible in the submission's runtime_env to anyone who can list jobs.
MLFLOW_SETTINGS_PASSED_ON = (
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_TRACKING_INSECURE_TLS",
)


@dataclass(frozen=True)
class Submission:
    submission_id: str
    address: str
    tracking_uri: str
    client: Any
    code_from: str | None = None
    """The directory of the user's code that went with the job, if any."""


def submit(spec: JobSpec, *, job_yaml: str | None, schedule_timeout_s: float) -> Submission:
    """Submit `spec` as a Ray job to the Jobs API at spec.cluster.address.

    job_yaml is only the file the spec was read from; the job runs the resolved spec, so the
    flags given here (--nodes, --epochs, ...) hold on the cluster too. KeyboardInterrupt during
    the upload propagates: the job may or may not have been submitted."""
    address = normalize_address(spec.cluster.address or DEFAULT_DASHBOARD_ADDRESS)
    tracking_uri = cluster_tracking_uri(spec, address)
    client = connect(address)
    here = this_environment()
    problem = ray_version_problem(address, cluster_ray_version(address), here.get("ray", ""))
    if problem:
        raise RayappError(problem)
    submission_id = new_submission_id(spec.name)
    entrypoint = " ".join(
        shlex.quote(part)
        for part in (
            "python",
            "-m",
            JOB_ENTRY_MODULE,
            "submit",
            JOB_FILE,
            "--schedule-timeout",
            f"{schedule_timeout_s:g}",
        )
    )
    code_dir = working_dir.code_directory(spec, job_yaml)
    with (
        tempfile.TemporaryDirectory(prefix="rayapp-job-") as directory,
        tempfile.TemporaryDirectory(prefix="rayapp-package-") as package_parent,
    ):
        if code_dir is not None:
            plan = working_dir.plan(code_dir)  # refuses a directory over Ray's upload limit
            shutil.copytree(
                code_dir, directory, dirs_exist_ok=True, ignore=_ignore(code_dir, plan.excludes)
            )
            spec = _relative_to(spec, code_dir)
        Path(directory, JOB_FILE).write_text(remote_job_yaml(spec, tracking_uri), encoding="utf-8")
        submit_job = functools.partial(
            client.submit_job,
            entrypoint=entrypoint,
            submission_id=submission_id,
            runtime_env={
                "working_dir": directory,
                "py_modules": [rayapp_package_copy(Path(package_parent))],
                "env_vars": {
                    **driver_env_vars(tracking_uri),
                    SUBMITTED_WITH_ENV: json.dumps(here),
                },
            },
            metadata={
                "rayapp_job": spec.name,
                "rayapp_nodes": str(spec.cluster.nodes),
                "rayapp_job_file": str(job_yaml or ""),
            },
        )
        submit_with_retry(submit_job, address)
    return Submission(
        submission_id, address, tracking_uri, client, str(code_dir) if code_dir else None
    )


def rayapp_package_copy(parent: Path) -> str:
    """This rayapp's package directory, copied under `parent` without caches: it travels with the
    job as runtime_env ``py_modules``, so the job's driver and workers run the rayapp that submitted
    it, whatever the cluster's Python has installed (or lacks)."""
    import rayapp

    source = Path(rayapp.__file__).resolve().parent
    target = parent / "rayapp"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return str(target)


def _relative_to(spec: JobSpec, code_dir: Path) -> JobSpec:
    """The spec as it runs from the copy of code_dir: a script named relative to it, no local
    dir."""
    train = spec.train
    if train.script:
        script = Path(train.script).expanduser().resolve()
        if not script.is_relative_to(code_dir):
            raise RayappError(
                f"--script {train.script!r} is outside {code_dir}, the directory that goes with "
                "the job; pass --working-dir with a directory that holds it"
            )
        train = dataclasses.replace(train, script=script.relative_to(code_dir).as_posix())
    return dataclasses.replace(
        spec, train=train, cluster=dataclasses.replace(spec.cluster, working_dir=None)
    )


def _ignore(root: Path, excludes: list[str]):
    names = {pattern for pattern in excludes if not pattern.startswith("/")}
    anchored = {pattern.lstrip("/") for pattern in excludes if pattern.startswith("/")}

    def ignore(directory: str, entries: list[str]) -> set[str]:
        import fnmatch

        relative = Path(directory).relative_to(root)
        return {
            entry
            for entry in entries
            if any(fnmatch.fnmatch(entry, pattern) for pattern in names)
            or (relative / entry).as_posix() in anchored
        }

    return ignore


def cluster_tracking_uri(spec: JobSpec, address: str) -> str:
    """The tracking URI the job's driver will use; refused when it names a store on this machine."""
    given = spec.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    uri = resolve_tracking_uri(spec.tracking.tracking_uri)
    if is_local_store(uri):
        source = (
            "--tracking-uri"
            if spec.tracking.tracking_uri
            else ("$MLFLOW_TRACKING_URI" if given else "the default MLflow store")
        )
        raise RayappError(
            f"{source} {uri!r} is a store on this machine, which the Ray cluster at "
            f"{address} cannot write to; pass --tracking-uri http://MLFLOW_HOST:5000 "
            "(the team's `mlflow server`, see docs/clusters.md)"
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

    document = spec_document(spec)
    document["cluster"]["address"] = "auto"
    document["tracking"]["tracking_uri"] = tracking_uri
    return (
        f"# Resolved job spec submitted by `rayapp submit --address` for job {spec.name!r}.\n"
        + yaml.safe_dump(document, sort_keys=False)
    )


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
