"""What rayapp makes of a wrong cluster setup, decided from what the nodes and servers answered:
one line naming the bad value, the hosts concerned and what to do. The answers are built here;
tests/test_setup_checks_integration.py gets them from a real cluster and real servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayapp.launch.jobs_api import ray_version_problem
from rayapp.launch.node_check import (
    NodeReport,
    packages_problem,
    storage_directory,
    storage_problem,
    store_directory,
    tracking_problem,
)
from rayapp.launch.remote_job import rayapp_package_copy
from rayapp.launch.versions import mismatch_problem, missing_module_problem
from rayapp.tracking.access import ServerAnswer, refusal

HOST_REFUSAL = "Invalid Host header - possible DNS rebinding attack detected"
PACKAGES = {"ray": "2.60.0", "torch": "2.13.0", "mlflow": "3.17.2"}


def report(ip: str, *, unseen=(), tracking=None, python="3.11.7", **packages) -> NodeReport:
    return NodeReport(
        node_ip=ip,
        python=python,
        executable="/usr/bin/python3",
        packages={**PACKAGES, **packages},
        unseen=tuple(unseen),
        tracking=tracking,
    )


# ---- MLflow's refusals --------------------------------------------------------------------


def test_host_header_refusal_names_allowed_hosts_not_credentials():
    line = refusal("http://198.18.0.1:5055", ServerAnswer(403, HOST_REFUSAL), {})
    assert "--allowed-hosts 198.18.0.1:5055" in line and "Invalid Host header" in line
    assert "MLFLOW_TRACKING_USERNAME" not in line


@pytest.mark.parametrize(
    ("status", "body"), [(401, "You are not authenticated."), (403, "Permission denied")]
)
def test_credentials_refusal_only_when_the_server_says_so(status, body):
    line = refusal(
        "http://mlflow:5000", ServerAnswer(status, body), {"MLFLOW_TRACKING_USERNAME": "ana"}
    )
    assert f"refused user 'ana' (HTTP {status})" in line and "MLFLOW_TRACKING_PASSWORD" in line


def test_other_403_is_not_called_a_credentials_problem():
    line = refusal("http://mlflow:5000", ServerAnswer(403, "blocked by proxy policy"), {})
    assert "HTTP 403: blocked by proxy policy" in line
    assert "MLFLOW_TRACKING_USERNAME" not in line and "--allowed-hosts" not in line


def test_an_accepting_server_is_no_problem():
    assert refusal("http://mlflow:5000", ServerAnswer(200, '{"experiments": []}'), {}) is None


# ---- shared storage ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("storage", "directory"),
    [
        ("/tmp/ckpt", "/tmp/ckpt"),
        ("file:///mnt/nfs/ckpt", "/mnt/nfs/ckpt"),
        ("s3://bucket/rayapp", None),
        ("gs://bucket/rayapp", None),
    ],
)
def test_object_stores_skip_the_marker_check(storage, directory):
    assert storage_directory(storage) == directory


def test_node_local_storage_names_the_path_and_the_blind_nodes():
    reports = [
        report("198.18.0.2"),
        report("198.18.0.3", unseen=["/tmp/ckpt"]),
        report("198.18.0.4", unseen=["/tmp/ckpt"]),
    ]
    line = storage_problem("/tmp/ckpt", "/tmp/ckpt", "198.18.0.2", reports)
    assert "'/tmp/ckpt'" in line and "198.18.0.3, 198.18.0.4" in line
    assert "198.18.0.2 wrote" in line and "NFS" in line and "s3://" in line and "gs://" in line
    assert storage_problem("/tmp/ckpt", "/tmp/ckpt", "198.18.0.2", reports[:1]) is None


def test_a_sqlite_store_the_nodes_cannot_see():
    uri = "sqlite:////home/ana/mlflow.db"
    assert store_directory(uri) == "/home/ana"
    assert store_directory("http://mlflow:5000") is None
    line = tracking_problem(uri, "198.18.0.2", [report("198.18.0.3", unseen=["/home/ana"])], {})
    assert uri in line and "198.18.0.3" in line and "every node can reach" in line
    assert tracking_problem(uri, "198.18.0.2", [report("198.18.0.3")], {}) is None


# ---- MLflow from the nodes -----------------------------------------------------------------


def test_a_tracking_server_the_workers_cannot_reach():
    uri = "http://127.0.0.1:5000"
    reports = [
        report("198.18.0.2", tracking=ServerAnswer(200)),
        report("198.18.0.3", tracking=ServerAnswer(None, failure="connection refused")),
    ]
    line = tracking_problem(uri, "198.18.0.2", reports, {})
    assert uri in line and "198.18.0.3 (connection refused)" in line
    assert "127.0.0.1 is each node itself" in line and "every node can reach" in line
    assert "198.18.0.2" not in line
    assert tracking_problem(uri, "198.18.0.2", reports[:1], {}) is None


def test_a_refusal_seen_from_a_node_says_which():
    reports = [report("198.18.0.3", tracking=ServerAnswer(403, HOST_REFUSAL))]
    line = tracking_problem("http://mlflow.lan:5000", "198.18.0.2", reports, {})
    assert "--allowed-hosts mlflow.lan:5000" in line and "asked from node 198.18.0.3" in line


# ---- packages and versions -----------------------------------------------------------------


def test_a_node_without_torch_says_what_to_install_there():
    driver = report("198.18.0.2")
    line = packages_problem(driver, [driver, report("198.18.0.3", torch=None, mlflow=None)])
    assert "node 198.18.0.3 (/usr/bin/python3, Python 3.11.7) lacks torch and mlflow" in line
    assert "pip install torch==2.13.0 mlflow==3.17.2" in line
    assert packages_problem(driver, [driver, report("198.18.0.3")]) is None


def test_a_node_with_another_python_or_ray():
    driver = report("198.18.0.2")
    line = packages_problem(driver, [report("198.18.0.3", python="3.12.1", ray="2.59.0")])
    assert "Python 3.12 (driver: 3.11)" in line and "Ray 2.59.0 (driver: 2.60.0)" in line
    # Patch releases of Python mix fine.
    assert packages_problem(driver, [report("198.18.0.3", python="3.11.2")]) is None


def test_laptop_and_cluster_ray_versions():
    line = ray_version_problem("http://198.18.0.2:8265", "2.59.0", "2.60.0")
    assert "runs Ray 2.59.0 and this machine Ray 2.60.0" in line
    assert "pip install 'ray[default,train]==2.59.0'" in line
    assert ray_version_problem("http://h:8265", "2.60.0", "2.60.0") is None
    assert ray_version_problem("http://h:8265", None, "2.60.0") is None  # the cluster did not say


def test_laptop_and_head_python_versions():
    laptop = {"host": "laptop", "python": "3.12.4", "ray": "2.60.0"}
    head = {"host": "head", "python": "3.11.7", "ray": "2.60.0"}
    line = mismatch_problem(laptop, head, "the head node head (/usr/bin/python3)")
    assert "runs Python 3.11.7 with Ray 2.60.0" in line and "laptop runs Python 3.12.4" in line
    assert "install on the cluster Python 3.12" in line
    assert mismatch_problem(laptop, {**head, "python": "3.12.0"}, "the head") is None


def test_a_module_the_head_lacks():
    line = missing_module_problem("yaml", {"pyyaml": "6.0.2"}, "the head node h (/usr/bin/python3)")
    assert "has no module 'yaml'" in line and "pip install pyyaml==6.0.2" in line
    assert "pip install torch" in missing_module_problem("torch.nn", None, "the head node")


def test_the_shipped_package_is_this_rayapp_without_caches(tmp_path: Path):
    import rayapp

    shipped = Path(rayapp_package_copy(tmp_path))
    assert shipped.name == "rayapp" and (shipped / "cli" / "job_entry.py").is_file()
    source = Path(rayapp.__file__).parent
    assert (shipped / "launch" / "node_check.py").read_text() == (
        source / "launch" / "node_check.py"
    ).read_text()
    assert not list(shipped.rglob("__pycache__")) and not list(shipped.rglob("*.pyc"))
