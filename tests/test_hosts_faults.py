"""Network faults on the test hosts, injected from outside as a real network has them: a worker
host cut off mid-epoch (its link to the bridge down), the link healed, one host's link slowed,
the MLflow host cut off mid-run.

The hosts and their cluster are those of test_hosts_cluster.py (tests/hosts_fixtures.py): `ray
up` of cluster_configs/onprem.yaml over SSH on three hosts, an `mlflow server` on a fourth, jobs
submitted from this machine through the Jobs API. A cut is `ip link set … down` on the machine's
end of the host's veth pair: nothing reaches the host or leaves it, and its TCP connections stall
rather than close. A slow link is a token bucket (`tc qdisc … tbf rate 50mbit`) on both ends of
that pair: this kernel has no sch_netem (CONFIG_NET_SCH_NETEM is off, as are fq, cake and
taprio), so there is no added delay, only the rate; htb and tbf are what it has.

Verdicts come from the MLflow server's REST API and from the hosts' process tables; `rayapp
doctor` and `rayapp compare` are read where what they print is the thing tested. Every fault is
undone in `finally` (the link up, the qdiscs deleted) and every wait is bounded; the fixture
removes the hosts, and checks that nothing of theirs is left, even when a test fails. The tests
run in file order on one cluster.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections.abc import Iterator

import pytest
from conftest import REPO, run_rayapp
from hosts_fixtures import (
    BIN,
    GCS_RECONNECT_TIMEOUT_S,
    MLFLOW,
    WORKER,
    Cluster,
    assert_trained_across_hosts,
    end_group,
    hosts_cluster,
    last_checkpoint,
    started_run,
    wait_for_checkpoint,
    wait_until,
)

from rayapp.driver.watchdog import TAG_FAILURE, TAG_HUNG_NODES
from rayapp.launch import netns
from rayapp.launch.testhost_setup import PREFIX
from rayapp.launch.testhosts import TestHost
from rayapp.tracking.run import TAG_ATTEMPTS, TAG_NODE_IPS

# Minutes of real hosts: outside the README's test command and `pytest -m hosts` (the hosts'
# suite, kept to a few minutes); in `pytest -m hostfaults` and .ci/run's `pytest -m slow`.
pytestmark = [pytest.mark.hostfaults, pytest.mark.slow]

HANG_TIMEOUT_S = 30
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
SLOW_RATE = "50mbit"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    yield from hosts_cluster(tmp_path_factory)


# -- faults ------------------------------------------------------------------------------------


def bridge_end(host: TestHost) -> str:
    """The machine's end of the host's veth pair (its other end is the host's eth0)."""
    return f"{PREFIX}v{host.address.rsplit('.', 1)[1]}"


def _ip(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, text=True, timeout=10)


def link_is_up(link: str) -> bool:
    """Whether the link is set up (its flags, `<BROADCAST,MULTICAST,UP,...>`, have UP)."""
    shown = subprocess.run(["ip", "-o", "link", "show", link], capture_output=True, text=True)
    flags = shown.stdout.partition("<")[2].partition(">")[0].split(",")
    return "UP" in flags


@contextlib.contextmanager
def cut_off(host: TestHost) -> Iterator[None]:
    """`host` partitioned from every other host and this machine while inside."""
    link = bridge_end(host)
    _ip("ip", "link", "set", link, "down")
    try:
        yield
    finally:
        _ip("ip", "link", "set", link, "up")
        assert link_is_up(link), f"{link} did not come up again"


def _qdiscs(*where: str) -> str:
    return subprocess.run(
        ["tc", *where, "qdisc", "show"], capture_output=True, text=True, timeout=10
    ).stdout


@contextlib.contextmanager
def slowed(host: TestHost, rate: str) -> Iterator[None]:
    """Both directions of `host`'s link held to `rate`: a token bucket on the host's eth0 (what
    it sends) and on the bridge's end of the pair (what it receives)."""
    ends = [(["-n", host.name], "eth0"), ([], bridge_end(host))]
    added = []
    try:
        for namespace, device in ends:
            _ip("tc", *namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
                "burst", "64kb", "latency", "100ms")  # fmt: skip
            added.append((namespace, device))
        yield
    finally:
        for namespace, device in added:
            subprocess.run(
                ["tc", *namespace, "qdisc", "del", "dev", device, "root"], capture_output=True
            )
        for namespace, _ in ends:
            assert "tbf" not in _qdiscs(*namespace), _qdiscs(*namespace)


# -- what the hosts and the server say ---------------------------------------------------------


def rank_processes(host: TestHost) -> set[int]:
    """The Ray Train workers (one per rank) running on `host`."""
    return {pid for pid, cmd in host.processes().items() if "RayTrainWorker" in cmd}


def loss_steps(cluster: Cluster, run) -> list[int]:
    return sorted(p.step for p in cluster.mlflow().get_metric_history(run.info.run_id, "loss"))


def placed_on(run) -> list[str]:
    return run.data.tags[TAG_NODE_IPS].split(",")


def ended(pids: set[int]) -> bool:
    return not any(netns.is_running(pid) for pid in pids)


# -- the tests ---------------------------------------------------------------------------------


def test_a_worker_host_cut_off_mid_epoch_is_left_behind_and_training_goes_on(cluster: Cluster):
    experiment, epochs = "hosts-cut-worker", 30
    submit = cluster.start_submit(
        "--nodes", "1:2", "--hang-timeout", str(HANG_TIMEOUT_S), "--max-failures", "3",
        "--global-batch-size", "16", "--epochs", str(epochs), "--checkpoint-every", "2",
        "--experiment", experiment, "jobs/digits_mlp.yaml",
    )  # fmt: skip
    output = ""
    try:
        run = started_run(cluster, experiment)
        placed = placed_on(run)
        # A worker host with a rank on it (the head holds the job's driver), not rank 0's if
        # there is a choice.
        workers = [h for h in cluster.ray_hosts[1:] if h.address in placed]
        victim = sorted(workers, key=lambda h: h.address == placed[0])[0]
        others = [h for h in cluster.ray_hosts if h.address in placed and h is not victim]
        # Checkpoints come after every second epoch (1, 3, ...): once epoch 3's is written,
        # epoch 4 is training, with no checkpoint of its own to end on.
        wait_for_checkpoint(cluster, run, 3)
        waiting = {pid for host in others for pid in rank_processes(host)}
        stuck = rank_processes(victim)
        assert waiting and stuck, (placed, waiting, stuck)
        with cut_off(victim):
            cut = time.monotonic()
            # The ranks left waiting in a collective for the cut-off one are ended, not left
            # hanging until the 30-minute collective timeout.
            wait_until(
                lambda: ended(waiting),
                HANG_TIMEOUT_S + 30,
                f"the ranks waiting for {victim.address} to end",
            )
            ended_after = time.monotonic() - cut
            # The rest of the run trains on the hosts left, the cut-off one still cut off.
            output, _ = submit.communicate(timeout=300)
            finished_after = time.monotonic() - cut
        # Healed, the cut-off host's Ray hears that it was declared dead, and its rank ends.
        wait_until(lambda: ended(stuck), GCS_RECONNECT_TIMEOUT_S + 50, "the cut-off rank to end")
    finally:
        end_group(submit)
    assert submit.returncode == 0, output[-4000:]
    print(f"ranks ended {ended_after:.0f} s after the cut; the run {finished_after:.0f} s after it")
    run = cluster.only_run(experiment)
    # What rayapp said at the terminal (not the epochs), for when an assertion fails.
    said = "\n".join([str(run.data.tags), *[x for x in output.splitlines() if "rayapp" in x]])
    assert run.info.status == "FINISHED"
    assert loss_steps(cluster, run) == list(range(epochs))  # each epoch once
    assert int(run.data.tags[TAG_ATTEMPTS]) >= 2, said
    assert victim.address not in placed_on(run), said
    # Ray declares a silent host dead only after its health checks have failed five times
    # (about 65 s here), so it is the hang watchdog that ended the wait, naming the host.
    assert run.data.tags[TAG_FAILURE] == "hang", said
    assert run.data.tags[TAG_HUNG_NODES] == victim.address, said


def test_mlflow_host_cut_off_mid_run_gets_every_epoch_after_it_heals(cluster: Cluster):
    experiment, epochs, cut_s = "hosts-cut-mlflow", 40, 10.0
    submit = cluster.start_submit(
        "--nodes", "2", "--global-batch-size", "16", "--epochs", str(epochs),
        "--checkpoint-every", "1", "--experiment", experiment, "jobs/digits_mlp.yaml",
    )  # fmt: skip
    try:
        run = started_run(cluster, experiment)
        wait_for_checkpoint(cluster, run, 2)
        with cut_off(cluster.host(MLFLOW)):
            cut_at = time.time()
            at_cut = last_checkpoint(cluster, run)
            time.sleep(cut_s)
            at_heal = last_checkpoint(cluster, run)
            healed_at = time.time()
        output, _ = submit.communicate(timeout=300)
    finally:
        end_group(submit)
    assert submit.returncode == 0, output[-4000:]
    # Training went on while the server was cut off: it checkpointed later epochs meanwhile ...
    assert at_heal > at_cut, (at_cut, at_heal)
    run = cluster.only_run(experiment)
    assert run.info.status == "FINISHED"
    history = cluster.mlflow().get_metric_history(run.info.run_id, "loss")
    assert sorted(p.step for p in history) == list(range(epochs))  # each epoch once
    # ... and the epochs it logged then (stamped when logged) reached the server after it healed.
    during = [p.step for p in history if cut_at * 1000 <= p.timestamp <= healed_at * 1000]
    print(f"epochs logged while the MLflow server was cut off: {during}")
    assert during, [(p.step, p.timestamp) for p in history]


def test_after_the_link_heals_a_run_uses_every_host_again(cluster: Cluster):
    # The host cut off in the first test is back: Ray's autoscaler restarted Ray there over SSH
    # once it answered again. A run on all three hosts needs it.
    result = cluster.submit(
        "--nodes", "3", "--global-batch-size", "96", "--epochs", "2",
        "--experiment", "hosts-healed", "jobs/digits_mlp.yaml",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = cluster.only_run("hosts-healed")
    assert_trained_across_hosts(cluster, run, nodes=3)


def test_a_slow_link_is_named_by_doctor_and_by_compare(cluster: Cluster):
    slow = cluster.host(WORKER)
    with slowed(slow, SLOW_RATE):
        # As docs/clusters.md has users run rayapp on the cluster: `ray exec` on the head.
        doctor = subprocess.run(
            [BIN / "ray", "exec", str(cluster.config),
             "rayapp doctor --address auto --storage-path $RAYAPP_STORAGE_PATH"],
            cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        result = cluster.submit(
            "--nodes", "3", "--global-batch-size", "96", "--epochs", "4",
            "--experiment", "hosts-slow-link", "jobs/digits_mlp.yaml",
        )  # fmt: skip
    # `ray exec` runs it on a terminal (ssh -tt), so its output comes with colours.
    shown = ANSI_ESCAPE.sub("", doctor.stdout)
    # A slow pair is a warning, not a failure: doctor passes, naming the host.
    assert doctor.returncode == 0, shown[-4000:] + doctor.stderr[-2000:]
    assert f"slow node: {slow.address}" in shown, shown[-4000:]
    assert shown.count("slow node:") == 1, shown[-4000:]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compare = run_rayapp(
        "compare", "--experiment", "hosts-slow-link", "--tracking-uri", cluster.tracking_uri,
        "--format", "json", cwd=REPO, env=cluster.env, inherit_env=False, timeout=120,
    )  # fmt: skip
    assert compare.returncode == 0, compare.stdout[-2000:] + compare.stderr[-2000:]
    (row,) = json.loads(compare.stdout)
    print(f"compare: slowest link {row['link_spread']:.1f}x @ {row['slowest_link_node']}")
    assert row["slowest_link_node"] == slow.address, row
