"""Reliability on a real embedded cluster: a worker killed mid-run, Ctrl-C, and impossible
requests."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from conftest import (
    JOBS,
    alive,
    cmdline,
    descendants,
    kill_one_training_worker,
    mlflow_client,
    only_run,
    run_rayapp,
    start_rayapp,
    wait_for_line,
)

from rayapp.launch.cluster import EmbeddedCluster
from rayapp.tracking.backfill import newest_history
from rayapp.tracking.goodput import MEASURED_PARTS, PARTS
from rayapp.tracking.run import EPOCH_METRICS, TAG_ATTEMPTS

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_killed_worker_resumes_from_checkpoint_in_the_same_run(workdir, warm_cluster):
    """With async checkpoints (DCP's async_save): the kill may land while a checkpoint is still
    being written, and the run resumes from one that was whole. The restart shows in goodput."""
    epochs = 6
    job = workdir / "seed_linear_async.yaml"
    job.write_text((JOBS / "seed_linear.yaml").read_text() + "checkpoint:\n  async: true\n")
    started = time.monotonic()
    process = start_rayapp(
        "submit",
        "--nodes",
        "2",
        "--epochs",
        str(epochs),
        "--max-failures",
        "1",
        str(job),
        cwd=workdir,
        env=warm_cluster,
    )
    try:
        wait_for_line(process, f"epoch 2/{epochs}")
        kill_one_training_worker(warm_cluster.leaders)
        output, _ = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            process.kill()
    took = time.monotonic() - started
    assert process.returncode == 0, output[-3000:]

    client = mlflow_client(workdir)
    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert run.data.tags[TAG_ATTEMPTS] == "2"
    for key in EPOCH_METRICS:
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(epochs)), f"{key} logged at {steps}"

    # Goodput: the parts add up to the wall time, which the submit's own lifetime bounds; the
    # measured parts alone stay within it (other, the remainder, is not a large negative), and
    # the restart cost time.
    metrics = run.data.metrics
    wall = metrics["run_wall_s"]
    assert 0 < wall < took
    assert sum(metrics[name] for name in PARTS) == pytest.approx(wall, rel=0.02)
    measured = sum(metrics[name] for name in MEASURED_PARTS)
    assert measured <= 1.02 * wall, {name: metrics[name] for name in PARTS}
    assert metrics["goodput_restart_lost_s"] > 0
    # Start-up runs to the first step: past the cluster's and the workers' own start-up figures.
    started_up = metrics["startup_cluster_s"] + metrics["startup_workers_s"]
    assert started_up < metrics["goodput_startup_s"] < wall
    # ...and is in the run even when the killed attempt's writer never sent it
    assert metrics["time_to_first_step_s"] == pytest.approx(metrics["goodput_startup_s"])
    assert metrics["goodput_compute_s"] > 0 and metrics["goodput_checkpoint_s"] > 0
    assert metrics["goodput"] == pytest.approx(metrics["goodput_compute_s"] / wall)


def stop_and_check(workdir, process, signum: int, exit_code: int, said: str) -> None:
    """Send signum to a running submit: it exits with exit_code, says so in one line, and leaves
    the run KILLED with every epoch the job checkpointed in it."""
    process.send_signal(signum)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == exit_code, output[-3000:]
    assert said in output and "Traceback" not in output
    assert "SIGTERM received" not in output  # Ray's own handler did not take over
    client = mlflow_client(workdir)
    run = only_run(client)
    assert run.info.status == "KILLED"
    # Every epoch the job checkpointed is in the run, sent by rank 0 or filled in by the driver
    # from the newest checkpoint after the cluster stopped.
    (trial_dir,) = (workdir / "rayapp_results").iterdir()
    saved = newest_history(str(trial_dir))
    assert saved is not None and saved["run_id"] == run.info.run_id
    logged = {m.step for m in client.get_metric_history(run.info.run_id, "loss")}
    assert set(range(saved["epoch"] + 1)) <= logged, (saved["epoch"], sorted(logged))


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after waiting up to seconds for them to exit."""
    deadline = time.monotonic() + seconds
    while [pid for pid in pids if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def test_ctrl_c_stops_the_embedded_cluster_and_marks_the_run_killed(workdir):
    process = start_rayapp(
        "submit", "--nodes", "2", "--epochs", "200", str(JOBS / "seed_linear.yaml"), cwd=workdir
    )
    try:
        wait_for_line(process, "  1/200  loss")
        started = descendants(process.pid)
        assert any("raylet" in cmdline(pid) for pid in started)
        stop_and_check(workdir, process, signal.SIGINT, 130, "interrupted;")
    finally:
        if process.poll() is None:
            process.kill()
    assert not gone_within(started, 5), "processes of the embedded cluster outlived rayapp"


def test_sigterm_stops_a_job_on_the_warm_cluster_and_marks_the_run_killed(workdir, warm_cluster):
    """kill, a scheduler's stop, systemd: as Ctrl-C, and the job's workers go with it while the
    warm cluster's nodes stay up."""
    process = start_rayapp(
        "submit",
        "--nodes",
        "2",
        "--epochs",
        "200",
        str(JOBS / "seed_linear.yaml"),
        cwd=workdir,
        env=warm_cluster,
    )
    try:
        wait_for_line(process, "  1/200  loss")
        workers = warm_cluster.training_workers()
        assert len(workers) >= 2, workers  # the job's two (and any of a job still ending)
        stop_and_check(workdir, process, signal.SIGTERM, 143, "terminated by SIGTERM;")
    finally:
        if process.poll() is None:
            process.kill()
    assert not gone_within(workers, 15), "the job's workers outlived it"
    assert all(alive(pid) for pid in warm_cluster.leaders)


@pytest.fixture
def two_node_cluster(warm_cluster):
    """A running 2-node cluster that is not the command's own: the session's warm cluster, named
    by its address (as a user names theirs), not found through its record."""
    return warm_cluster.record


def test_more_nodes_than_the_cluster_has_fails_fast(workdir, two_node_cluster):
    started = time.monotonic()
    result = run_rayapp(
        "submit",
        "--address",
        two_node_cluster.address,
        "--nodes",
        "5",
        "--epochs",
        "1",
        str(JOBS / "seed_linear.yaml"),
        cwd=workdir,
        env=two_node_cluster.auth_env,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert elapsed < 30, f"took {elapsed:.0f}s"
    message = result.stderr.strip().splitlines()[-1]
    assert "--nodes 5" in message and "the cluster has 2 alive node(s)" in message, message
    assert "Traceback" not in result.stderr


def test_existing_cluster_runs_a_job(workdir, two_node_cluster):
    result = run_rayapp(
        "submit",
        "--address",
        two_node_cluster.address,
        "--nodes",
        "2",
        "--epochs",
        "1",
        str(JOBS / "seed_linear.yaml"),
        cwd=workdir,
        env=two_node_cluster.auth_env,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    run = only_run(mlflow_client(workdir))
    assert run.data.tags["rayapp.cluster"] == two_node_cluster.address
    assert len(set(run.data.tags["rayapp.node_ids"].split(","))) == 2


def kill_node(rayapp_pid: int, ip: str) -> None:
    """Every process of one embedded node at once (its `ray start`, raylet and the workers on it),
    as when a machine of a real cluster goes away."""
    leaders = [
        pid
        for pid in descendants(rayapp_pid)
        if f"--node-ip-address={ip}" in cmdline(pid) and " start " in cmdline(pid)
    ]
    assert leaders, f"no `ray start` process for node {ip} under rayapp"
    for pid in [*leaders, *(child for leader in leaders for child in descendants(leader))]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_losing_a_node_with_no_restarts_left_fails_fast_naming_it(workdir):
    epochs = 300
    process = start_rayapp(
        "submit",
        "--nodes",
        "2",
        "--epochs",
        str(epochs),
        str(JOBS / "seed_linear.yaml"),
        cwd=workdir,
    )
    try:
        wait_for_line(process, f" 2/{epochs}  loss")
        kill_node(process.pid, "127.0.0.3")
        killed_at = time.monotonic()
        output, _ = process.communicate(timeout=120)
        took = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, output[-3000:]
    assert took < 60, f"the run took {took:.0f}s to fail after the node was lost"
    message = output.strip().splitlines()[-1]
    assert "node 127.0.0.3 was lost" in message and "marked FAILED" in message, message
    run = only_run(mlflow_client(workdir))
    assert run.info.status == "FAILED"
    (trial_dir,) = (workdir / "rayapp_results").iterdir()
    saved = newest_history(str(trial_dir))
    logged = {m.step for m in mlflow_client(workdir).get_metric_history(run.info.run_id, "loss")}
    assert set(range(saved["epoch"] + 1)) <= logged, (saved["epoch"], sorted(logged))


def test_a_lost_node_comes_back_and_training_resumes_in_the_same_run(workdir):
    epochs = 10
    process = start_rayapp(
        "submit",
        "--nodes",
        "2",
        "--epochs",
        str(epochs),
        "--max-failures",
        "1",
        str(JOBS / "seed_linear.yaml"),
        cwd=workdir,
    )
    try:
        wait_for_line(process, f" 2/{epochs}  loss")
        kill_node(process.pid, "127.0.0.3")
        output, _ = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    assert "node 127.0.0.3 was lost" in output and "starting it again" in output
    client = mlflow_client(workdir)
    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert run.data.tags[TAG_ATTEMPTS] == "2"
    assert sorted(run.data.tags["rayapp.node_ips"].split(",")) == ["127.0.0.2", "127.0.0.3"]
    for key in EPOCH_METRICS:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(
            range(epochs)
        ), key


def test_progress_lives_on_the_driver_node_and_its_loss_never_fails_training(two_node_cluster):
    """The terminal's progress queue is an actor: on the driver's node, a lost worker node cannot
    take it along; and a rank that cannot reach it (driver gone) trains on, the line lost."""
    import ray

    from rayapp.driver.session import progress_pump
    from rayapp.spec.loader import load_spec
    from rayapp.train.config import WorkerConfig

    two_node_cluster.prepare_client()
    ray.init(
        address=two_node_cluster.address,
        _node_ip_address=two_node_cluster.head_ip,
        log_to_driver=False,
    )
    try:
        shown: list = []
        with progress_pump(shown.append) as queue:
            queue.size()  # placed and running
            # The GCS's own record (the state API needs the dashboard, which this cluster runs
            # without).
            placed = ray._private.state.actors(queue.actor._actor_id.hex())["Address"]["NodeID"]
            assert placed == ray.get_runtime_context().get_node_id()
            config = WorkerConfig(
                spec=load_spec(JOBS / "seed_linear.yaml"),
                run_id="r",
                tracking_uri="",
                submitted_at=0.0,
                progress=queue,
            )
            config.tell("first")
            deadline = time.monotonic() + 30  # the driver's thread drains the queue on its own time
            while {"message": "first"} not in shown and time.monotonic() < deadline:
                time.sleep(0.1)
            assert {"message": "first"} in shown
            ray.kill(queue.actor)
            time.sleep(1)
            config.tell("second")  # raises nothing
            config.echo("third")
        assert {"message": "second"} not in shown
    finally:
        ray.shutdown()


def test_an_elastic_run_shrinks_when_a_node_is_lost_and_grows_back_when_it_returns(workdir):
    """--nodes 1:2 on a 2-node cluster that is not rayapp's own (as a user's, under an autoscaler):
    losing a node, training goes on at world size 1; the node back (the test starts it, where an
    autoscaler would), training grows to world size 2 again; every epoch in the run once, each
    with the world size it ran at."""
    import yaml

    job = workdir / "elastic.yaml"  # seed_linear, checking every 5 s for a node to grow onto
    document = yaml.safe_load((JOBS / "seed_linear.yaml").read_text())
    document["cluster"]["resize_interval_s"] = 5
    job.write_text(yaml.safe_dump(document))
    epochs = 5000  # more than the test waits for: it ends the run itself, by SIGTERM
    with EmbeddedCluster(nodes=2, cpus_per_node=1) as cluster:
        # what rayapp sets for its embedded cluster: Ray Train, restarting after the loss, may first
        # try the old size on a stale view of the cluster and wait this long before trying fewer
        env = {**cluster.auth_env, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}
        process = start_rayapp(
            "submit",
            "--address",
            cluster.address,
            "--nodes",
            "1:2",
            "--epochs",
            str(epochs),
            str(job),
            cwd=workdir,
            env=env,
        )
        try:
            wait_for_line(process, "training on 2 node(s), world size 2")
            wait_for_line(process, f" 3/{epochs}  loss")
            kill_node(os.getpid(), "127.0.0.3")
            wait_for_line(process, "training on 1 node(s), world size 1", timeout=180)
            wait_for_line(process, "loss")  # an epoch done with one node
            cluster.restart_node(1)
            wait_for_line(process, "training on 2 node(s), world size 2", timeout=180)
            for _ in range(3):  # and a few epochs on both again
                wait_for_line(process, "loss")
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 143, output[-3000:]

    client = mlflow_client(workdir)
    run = only_run(client)
    assert run.info.status == "KILLED"
    assert run.data.params["nodes"] == "1:2" and run.data.params["world_size"] == "1:2"
    steps = {
        key: sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        for key in EPOCH_METRICS
    }
    logged = steps["loss"]
    assert logged == list(range(len(logged))), f"epochs missing or logged twice: {logged}"
    for key, key_steps in steps.items():
        assert key_steps == logged, f"{key} logged at {key_steps}, loss at {logged}"
    sizes = [
        int(m.value)
        for m in sorted(
            client.get_metric_history(run.info.run_id, "world_size"), key=lambda m: m.step
        )
    ]
    # 2, then 1 while the node was away, then 2 again: runs of the same size collapsed
    phases = [size for index, size in enumerate(sizes) if index == 0 or sizes[index - 1] != size]
    assert phases == [2, 1, 2], sizes
