"""The submitting machine's Python and packages against the cluster's, for a Jobs API submission.

rayapp's own code travels with the job (runtime_env ``py_modules``), so the cluster's Python needs
only what rayapp imports: Ray, torch, MLflow and a few small libraries. The submitting machine
records its versions in the job's environment; the job's driver (on the head node) compares them
with its own before anything else, and names what to install where when they differ or a package
is missing. Standard library only: it runs before the driver imports anything that might be absent.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from importlib import metadata

SUBMITTED_WITH_ENV = "RAYAPP_SUBMITTED_WITH"
DISTRIBUTIONS = (
    "ray",
    "torch",
    "mlflow",
    "click",
    "rich",
    "pyyaml",
    "matplotlib",
    "scikit-learn",
    "pyarrow",
    "psutil",
)
"""What rayapp imports on the cluster (pyproject.toml's dependencies)."""
MODULE_DISTRIBUTIONS = {"yaml": "pyyaml", "sklearn": "scikit-learn"}
"""Import names that differ from the name pip installs."""


def this_environment() -> dict[str, str]:
    """This machine's host name, Python and the installed versions of DISTRIBUTIONS."""
    found = {"host": socket.gethostname(), "python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def submitted_with() -> dict[str, str] | None:
    """The submitting machine's environment, as recorded in the job's; None outside such a job."""
    try:
        return dict(json.loads(os.environ[SUBMITTED_WITH_ENV]))
    except (KeyError, ValueError, TypeError):
        return None


def head_description() -> str:
    return f"the head node {socket.gethostname()} ({sys.executable})"


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def mismatch_problem(submitter: dict[str, str], cluster: dict[str, str], where: str) -> str | None:
    """One line when the cluster's Python (major.minor) or Ray differs from the submitter's."""
    python_differs = _minor(submitter.get("python", "")) != _minor(cluster.get("python", ""))
    ray_differs = submitter.get("ray") != cluster.get("ray")
    if not (python_differs or ray_differs):
        return None
    ours = f"Python {cluster.get('python')} with Ray {cluster.get('ray', '(none)')}"
    theirs = f"Python {submitter.get('python')} with Ray {submitter.get('ray', '(none)')}"
    return (
        f"{where} runs {ours} and the submitting machine {submitter.get('host', '')} runs "
        f"{theirs}; rayapp's code travels from there, so install on the cluster Python "
        f"{_minor(submitter.get('python', ''))} and pip install "
        f"'ray[default,train]=={submitter.get('ray')}', or submit from an environment with "
        f"{ours}"
    )


def missing_module_problem(module: str, submitter: dict[str, str] | None, where: str) -> str:
    """One line naming the module the cluster's Python lacks and the pip command that adds it."""
    top = module.split(".")[0]
    distribution = MODULE_DISTRIBUTIONS.get(top, top)
    version = (submitter or {}).get(distribution)
    pin = f"{distribution}=={version}" if version else distribution
    return (
        f"{where} has no module {top!r}, which rayapp imports; install it there: pip install "
        f"{pin}" + (" (the submitting machine's version)" if version else "")
    )
