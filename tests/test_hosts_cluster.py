"""rayapp on separate hosts, as a user runs it: `ray up` of cluster_configs/onprem.yaml over SSH,
`rayapp submit` through the Ray Jobs API from this machine (the "laptop"), a real `mlflow server` on
another host, checkpoints on a directory shared by every host.

The hosts come from rayapp.launch.testhosts: network namespaces on one bridge (198.18.0.0/25),
each with a private /tmp, /dev/shm and home and its own sshd. Host 1 (a worker) has a second
interface that routes nowhere. They keep this machine's host name, which resolves to loopback
(as on stock Debian), so Gloo rendezvous only works over the interface rayapp pins it to.

Every verdict comes from the MLflow server's REST API and from the hosts (process lists, files
in their namespaces), not from rayapp's printout. The tests run in file order on one cluster: the
lost-node test takes a worker down, and the last one is `ray down`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest
from conftest import REPO, run_rayapp
from hosts_fixtures import (
    BIN,
    GCS_RECONNECT_TIMEOUT_S,
    HEAD,
    MLFLOW,
    STORAGE,
    TWO_INTERFACES,
    WORKER,
    Cluster,
    assert_trained_across_hosts,
    checkpoint_dirs,
    end_group,
    hosts_cluster,
    last_checkpoint,
    ray_processes,
    started_run,
    wait_for_checkpoint,
    wait_until,
)

from rayapp.tracking.run import TAG_ATTEMPTS, TAG_NODE_IPS, TAG_RESUMED_FROM_EPOCH

AGENT_REPORT_TIMEOUT_S = 60
"""The fixed timeout of a Ray agent's report, to the GCS, that its raylet has ended."""

pytestmark = pytest.mark.hosts

EPOCHS = 8
"""Of the lost-host run (batches of 16, an epoch in about a second across the hosts): the loss
comes once epoch 1 is checkpointed, and the resumed run trains several more."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    yield from hosts_cluster(tmp_path_factory)


def test_ray_up_starts_a_head_and_two_workers_over_ssh(cluster: Cluster):
    head = ray_processes(cluster.host(HEAD))
    assert any("gcs_server" in cmd for cmd in head.values()), head
    for index in (TWO_INTERFACES, WORKER):
        worker = ray_processes(cluster.host(index))
        assert any("raylet" in cmd for cmd in worker.values()), worker
        assert not any("gcs_server" in cmd for cmd in worker.values()), worker
    assert ray_processes(cluster.host(MLFLOW)) == {}
    # Node-local state stays on its node: the cluster's one session name, but each host has its
    # own /tmp/ray with its own session directory (the same path on every host, other directories).
    directories = []
    for host in cluster.ray_hosts:
        session = host.path("/tmp/ray") / os.readlink(
            host.path("/tmp/ray/session_latest")
        ).removeprefix("/tmp/ray/")
        status = session.stat()
        directories.append((status.st_dev, status.st_ino))
        assert (session / "logs").is_dir(), session
    assert len(set(directories)) == 3, directories
    # `ray up` ran the setup commands on every host: the environment file and the token.
    for host in cluster.ray_hosts:
        assert (
            "MLFLOW_TRACKING_URI=http://198.18.0.5:5000"
            in host.path("/root/.rayapp_env").read_text()
        )
        assert host.path("/root/.ray/auth_token").stat().st_mode & 0o777 == 0o600
    print(f"ray up until every raylet ran: {cluster.ray_up_s:.1f} s")


def test_users_code_directory_reaches_hosts_without_the_laptops_files(cluster: Cluster):
    # All three Ray hosts, so the one with two interfaces trains too.
    result = cluster.submit(
        "--nodes", "3", "--global-batch-size", "96", "--epochs", "2",  # 64 does not split in 3
        "--experiment", "hosts-cnn", "examples/cnn_digits/job.yaml",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = cluster.only_run("hosts-cnn")
    ips = assert_trained_across_hosts(cluster, run, nodes=3)
    assert cluster.host(TWO_INTERFACES).address in ips
    assert "test_accuracy" in run.data.metrics
    # Every rank imported the user's model factory on its own host (the run trained on all three),
    # from the job's upload that Ray unpacked into that host's private /tmp (and removes again once
    # the job has ended: the directory it unpacks into stays).
    for host in cluster.ray_hosts:
        session = host.path("/tmp/ray") / os.readlink(
            host.path("/tmp/ray/session_latest")
        ).removeprefix("/tmp/ray/")
        unpacked_into = session / "runtime_resources" / "working_dir_files"
        assert unpacked_into.is_dir(), f"no working_dir was unpacked on {host.address}"


def test_a_node_local_storage_path_is_one_line_naming_the_nodes_before_training(cluster: Cluster):
    # /tmp is private to each host: the driver (on the head) writes its marker into its own /tmp.
    local = "/tmp/rayapp-local-checkpoints"
    experiment = "hosts-local-storage"
    result = run_rayapp(
        "submit", "--address", cluster.dashboard, "--tracking-uri", cluster.tracking_uri,
        "--storage-path", local, "--nodes", "2", "--epochs", "1", "--experiment", experiment,
        "jobs/digits_mlp.yaml", cwd=REPO, env=cluster.env, inherit_env=False, timeout=240,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    (line,) = [line for line in output.splitlines() if "is not shared storage" in line]
    head, others = cluster.host(HEAD).address, [cluster.host(i) for i in (TWO_INTERFACES, WORKER)]
    assert f"--storage-path '{local}'" in line and f"driver on {head}" in line, line
    for host in others:
        assert host.address in line, line
        assert not host.path(local).exists(), f"{host.address} got {local} before the check"
    # Nothing trained: no run on the server, and the driver took its marker away again.
    found = cluster.mlflow().get_experiment_by_name(experiment)
    assert found is None or cluster.mlflow().search_runs([found.experiment_id]) == []
    assert list(cluster.host(HEAD).path(local).glob(".rayapp-shared-check-*")) == []


def test_submit_trains_across_hosts_into_the_remote_server_and_survives_a_lost_worker_host(
    cluster: Cluster,
):
    """`rayapp submit --nodes 2 jobs/digits_mlp.yaml` from the laptop, and one worker host's
    processes killed mid-run: one run on the remote MLflow server, ranks on two hosts, test
    accuracy of at least 0.9, checkpoints on the shared directory, and after the loss the run
    resumed from its last checkpoint there and trained the epochs left, each logged once. (One
    run for both: each submission across the hosts costs about a minute of start-up here.)"""
    experiment = "hosts-digits"
    submit = cluster.start_submit(
        "--nodes", "2", "--global-batch-size", "16", "--epochs", str(EPOCHS),
        "--max-failures", "2", "--checkpoint-every", "1", "--experiment", experiment,
        "jobs/digits_mlp.yaml",
    )  # fmt: skip
    try:
        run = started_run(cluster, experiment, timeout=180)
        # Mid-run by the shared storage, not by the server: rank 0 logs epochs to the server
        # paced, seconds behind, by when a short run may be over.
        wait_for_checkpoint(cluster, run, epoch=1)
        victim = next(
            cluster.host(i)
            for i in (TWO_INTERFACES, WORKER)
            if cluster.host(i).address in run.data.tags[TAG_NODE_IPS].split(",")
        )
        killed = ray_processes(victim)
        assert killed
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        checkpointed_before_loss = last_checkpoint(cluster, run)
        output, _ = submit.communicate(timeout=240)
    finally:
        end_group(submit)
    assert submit.returncode == 0, output[-4000:]
    run = cluster.only_run(experiment)
    assert run.data.tags[TAG_ATTEMPTS] == "2", run.data.tags
    assert_trained_across_hosts(cluster, run, nodes=2)
    history = cluster.mlflow().get_metric_history(run.info.run_id, "loss")
    assert sorted(point.step for point in history) == list(range(EPOCHS)), history
    # It went on from a checkpoint in the shared storage (the tag is set only when one was
    # restored), not from scratch: the newest that Ray Train had registered when the host was
    # lost. That is the newest directory on the storage then, or the one before it (a checkpoint
    # is written before it is registered, and the loss may cut the registration short), or one
    # written as the loss came. And epochs were left to train after it.
    resumed_from = int(run.data.tags[TAG_RESUMED_FROM_EPOCH])
    assert checkpointed_before_loss - 1 <= resumed_from <= checkpointed_before_loss + 1, (
        resumed_from,
        checkpointed_before_loss,
    )
    assert resumed_from < EPOCHS - 1, f"the loss came after the last epoch: {resumed_from}"
    assert run.data.metrics["test_accuracy"] >= 0.9, run.data.metrics
    checkpoints = checkpoint_dirs(cluster, run)
    assert checkpoints, f"no checkpoint of run {run.info.run_id} under {STORAGE}"
    assert any(path.is_file() for path in checkpoints[-1].rglob("*"))


def test_ray_down_leaves_no_ray_process_on_any_host(cluster: Cluster):
    down = subprocess.run(
        [BIN / "ray", "down", "-y", str(cluster.config)],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    # `ray down` stops Ray on the head; a local provider's workers it only marks as terminated,
    # and their raylets exit once they have lost the head for Ray's GCS reconnect timeout (Ray's
    # 60 s; GCS_RECONNECT_TIMEOUT_S on the test hosts). The raylet's agents (dashboard, runtime
    # env) follow a minute later: they report the raylet's end to the GCS, which is gone, and wait
    # out that call's fixed 60 s. Ray's log monitor on a worker outlives them (measured: over 2
    # minutes); it holds no port or resource, and the `ray stop` that begins
    # worker_start_ray_commands ends it at the next `ray up` (onprem.yaml says so).
    wait_until(lambda: ray_processes(cluster.host(HEAD)) == {}, 30, "Ray to stop on the head")
    for host in cluster.hosts.hosts:
        wait_until(
            lambda h=host: not [c for c in ray_processes(h).values() if "log_monitor" not in c],
            GCS_RECONNECT_TIMEOUT_S + AGENT_REPORT_TIMEOUT_S + 20,
            f"Ray to stop on {host.address}",
        )
