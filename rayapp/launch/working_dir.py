"""The directory of the user's code that travels with a job to every worker.

Workers import users' modules (factories, loops, scripts) from the job's directory: rayapp ships
it as Ray's runtime_env ``working_dir``, which Ray unpacks on every node and puts on the
workers' ``sys.path``. Before anything starts this module plans the upload: what is left out
(caches, virtual environments, MLflow stores, checkpoints, files of LARGE_FILE_BYTES and more),
what that leaves, and whether it fits under Ray's upload limit.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from rayapp.spec import JobSpec, SpecError
from rayapp.spec.job import is_import_path

# Never code: version control, caches, environments, and what rayapp itself writes beside a job.
EXCLUDED_NAMES = (
    ".git",
    "__pycache__",
    "*.pyc",
    ".venv",
    "venv",
    ".tox",
    ".mypy_cache",
    ".pytest_cache",
    "node_modules",
    "mlruns",
    "mlartifacts",
    "mlflow.db",
    "rayapp_results",
    "*.egg-info",
)
LARGE_FILE_BYTES = 10 * 2**20
"""Ray warns about files this large in a working_dir; rayapp leaves them out and says so (data
sets belong in shared storage the workers read, not in the code upload)."""


def ray_upload_limit_bytes() -> int:
    """Ray's largest working_dir package (its gRPC message limit)."""
    try:
        from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE

        return int(GCS_STORAGE_MAX_SIZE)
    except (ImportError, AttributeError, ValueError):  # a Ray that moved it: its documented default
        return 512 * 2**20


@dataclass(frozen=True)
class WorkingDir:
    path: str
    excludes: list[str] = field(default_factory=list)
    """Ray runtime_env ``excludes`` patterns, relative to `path`."""
    large_files: list[tuple[str, int]] = field(default_factory=list)
    """(relative path, bytes) of the files left out for their size."""
    total_bytes: int = 0

    def runtime_env(self) -> dict:
        return {"working_dir": self.path, "excludes": list(self.excludes)}


JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor for a job's driver: the job's runtime_env and metadata, as JSON."""


def came_with_the_ray_job() -> bool:
    """Whether this process is the driver of a Ray job that brought a working_dir (a `rayapp
    submit --address` job): the workers get that one from the job, and a second one given to
    ray.init would conflict with it (Ray refuses to merge the two)."""
    try:
        job_config = json.loads(os.environ.get(JOB_CONFIG_ENV, "{}"))
    except ValueError:
        return False
    return bool((job_config.get("runtime_env") or {}).get("working_dir"))


def names_user_code(spec: JobSpec) -> bool:
    """Whether the job imports the user's code on the workers."""
    paths = (
        spec.model.factory,
        spec.data.factory,
        spec.train.loop,
        spec.train.loss,
        spec.train.optimizer,
    )
    return spec.train.script is not None or any(is_import_path(p) for p in paths if p)


def code_directory(spec: JobSpec, job_file: str | None) -> Path | None:
    """cluster.working_dir; else, when the job names the user's code, the job file's directory (the
    script's for a job given by --script alone); else None: nothing needs to travel."""
    if spec.cluster.working_dir:
        directory = Path(spec.cluster.working_dir).expanduser()
        if not directory.is_dir():
            raise SpecError(
                f"cluster.working_dir: {spec.cluster.working_dir!r} is not a directory; "
                "pass the directory that holds your code (--working-dir DIR)"
            )
        return directory.resolve()
    if not names_user_code(spec):
        return None
    if job_file:
        return Path(job_file).resolve().parent
    if spec.train.script:
        return Path(spec.train.script).resolve().parent
    return Path.cwd()


def plan(directory: Path) -> WorkingDir:
    """What of `directory` would be uploaded; SpecError when even that is over Ray's limit."""
    excludes = list(EXCLUDED_NAMES)
    large: list[tuple[str, int]] = []
    total = 0
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not _excluded(d)]
        for name in files:
            if _excluded(name):
                continue
            path = Path(root, name)
            try:
                size = path.stat().st_size
            except OSError:
                continue
            relative = path.relative_to(directory).as_posix()
            if size >= LARGE_FILE_BYTES:
                large.append((relative, size))
                excludes.append("/" + relative)  # gitignore-style, anchored at the working dir
            else:
                total += size
    limit = ray_upload_limit_bytes()
    if total >= limit:
        raise SpecError(
            f"cluster.working_dir: {str(directory)!r} holds {total / 2**20:.0f} MiB of files "
            f"to upload, over Ray's limit of {limit / 2**20:.0f} MiB; point --working-dir at "
            "the directory with just your code, or list large paths in a .rayignore file there"
        )
    return WorkingDir(path=str(directory), excludes=excludes, large_files=large, total_bytes=total)


def _excluded(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in EXCLUDED_NAMES)
