"""The Ray side of a submission: the cluster the job runs on and the queue its progress comes back
by."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator

from rayapp.driver.signals import raise_on_termination
from rayapp.driver.trainer import local_gpus
from rayapp.errors import RayappError, cause_line
from rayapp.launch import warm
from rayapp.launch.cluster import EmbeddedCluster
from rayapp.spec import JobSpec

ProgressCallback = Callable[[dict], None]
WARM_LABEL = "local-warm"
ELASTIC_REPLACE_AFTER_S = 60.0
"""How long the embedded cluster leaves a lost node out of an elastic run before starting it
again: long enough that training goes on with the nodes left, as it does on a real cluster while
the autoscaler brings a machine up (minutes there)."""
ELASTIC_START_TIMEOUT_S = "30"
"""Ray Train's worker-group start timeout (default 60 s) for elastic runs on the embedded cluster.
Right after a node is lost, Ray Train's view of the cluster (refreshed every 20 s) still counts
it, so the first restart asks for every node and waits for the lost one until this timeout; the
next asks for the nodes left. Workers on this machine start in seconds."""


LOCAL_RAY_TRAIN_SETTINGS = {
    # Ray Train's preemption watcher (one more actor process per job) follows nodes that a cloud
    # drains before taking them away; nodes on this machine are never drained.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # Ray Train's Prometheus metrics: nothing scrapes them on this machine (rayapp's own go to
    # MLflow).
    "RAY_TRAIN_METRICS_ENABLED": "0",
}
"""Ray Train settings for jobs on the embedded or warm cluster, where they cut start-up work that
serves only real clusters (docs/benchmarks.md, "Warm cluster"). A value set by the user wins."""


@dataclasses.dataclass
class ClusterSession:
    """The cluster a job runs on, while the driver is connected to it."""

    label: str
    """`local`, `local-warm`, or the address given: tagged on the run."""
    embedded: EmbeddedCluster | None = None

    def lost_nodes(self) -> list[str]:
        """IPs of nodes that died during the job. An embedded node's processes tell at once; Ray's
        own view (a missed health check) comes seconds after the collectives have already failed."""
        import ray

        lost = set(self.embedded.exited_nodes()) if self.embedded is not None else set()
        try:
            lost |= {node["NodeManagerAddress"] for node in ray.nodes() if not node["Alive"]}
        except Exception:  # the head itself is gone: nothing more to say than the error
            pass
        return sorted(lost)


@contextlib.contextmanager
def ray_cluster(
    spec: JobSpec,
    *,
    verbose: bool,
    status: Callable[[str], None],
    runtime_env: dict | None = None,
    state_api: bool = False,
) -> Iterator[ClusterSession]:
    """Connect to spec.cluster.address, else to the warm cluster (`rayapp cluster up`) when one
    runs, else start and finally stop an embedded cluster.

    runtime_env is the job's (the user's code as working_dir): Ray uploads it once, here, and every
    worker of the job runs in it. state_api: an embedded cluster serves Ray's State API (its
    dashboard), which Ray Train's placement-group cleaner needs to free the CPUs of a training
    whose controller was killed (a trial Ray Tune stopped early)."""
    import ray

    def connect(address: str, node_ip: str | None, where: str) -> None:
        try:
            ray.init(
                address=address,
                _node_ip_address=node_ip,
                log_to_driver=verbose,
                logging_level=logging.INFO if verbose else logging.ERROR,
                runtime_env=runtime_env,
            )
        except Exception as exc:  # ConnectionError, timeouts, bad scheme
            raise RayappError(f"cannot connect to {where}: {cause_line(exc)}") from None
        raise_on_termination()  # ray.init put its own SIGTERM handler in place of ours

    address = spec.cluster.address
    try:
        if address:
            status(f"connecting to Ray cluster at {address}")
            connect(address, None, f"Ray cluster at {address!r}")
            yield ClusterSession(address)
            return
        for name, value in LOCAL_RAY_TRAIN_SETTINGS.items():
            os.environ.setdefault(name, value)
        running = warm.find(status)
        if running is not None:
            running.check_fits(spec.cluster.nodes)
            driver = ", from its preloaded driver" if warm.PRELOADED_DRIVER else ""
            status(
                f"using the warm cluster: {running.describe()}{driver} "
                "(`rayapp cluster down` stops it)"
            )
            running.prepare_client()
            connect(
                running.address,
                running.head_ip,
                f"the warm cluster at {running.address} (node logs: {running.log_dir})",
            )
            yield ClusterSession(WARM_LABEL)
            return
        cpus_per_node = spec.cluster.workers_per_node * spec.cluster.cpus_per_worker
        status(
            f"starting embedded Ray cluster: {spec.cluster.nodes} node(s) x {cpus_per_node} CPU(s)"
        )
        with EmbeddedCluster(
            nodes=spec.cluster.nodes,
            cpus_per_node=cpus_per_node,
            gpus_per_node=local_gpus() // spec.cluster.nodes,
            include_dashboard=state_api,
        ) as cluster:
            cluster.prepare_client()
            connect(
                cluster.address,
                cluster.head_ip,
                f"the embedded Ray cluster at {cluster.address} (node logs: {cluster.log_dir})",
            )
            cluster.wait_for_nodes()
            if spec.cluster.failures_allowed > 0:
                # A lost node comes back, as an autoscaler would bring one; for an elastic run,
                # after a while, as a real replacement takes: training goes on meanwhile with fewer.
                cluster.keep_nodes_up(
                    status, replace_after_s=ELASTIC_REPLACE_AFTER_S if spec.cluster.elastic else 0.0
                )
            if spec.cluster.elastic:
                os.environ.setdefault(
                    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", ELASTIC_START_TIMEOUT_S
                )
            try:
                yield ClusterSession("local", embedded=cluster)
            finally:
                ray.shutdown()
    finally:
        ray.shutdown()


@contextlib.contextmanager
def progress_pump(on_progress: ProgressCallback | None) -> Iterator[object]:
    """A Ray queue that rank 0 fills; a driver thread drains it into on_progress."""
    if on_progress is None:
        yield None
        return
    import ray
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # num_cpus=0: the queue must never compete with training workers for a CPU slot. On the
    # driver's own node, as Ray Train's controller is: a worker node lost mid-run (and recovered
    # from) must not take the queue along. Not a soft preference: Ray spreads those.
    queue = Queue(
        actor_options={
            "num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            ),
        }
    )
    done = "rayapp-progress-done"

    def drain() -> None:
        # One blocking get at a time rather than polling with a timeout: on a small machine
        # every needless call into the queue actor takes CPU from the training workers.
        while True:
            try:
                item = queue.get(block=True)
            except Exception:  # the queue actor is gone (cluster shutting down)
                return
            if item == done:
                return
            on_progress(item)

    thread = threading.Thread(target=drain, name="rayapp-progress", daemon=True)
    thread.start()
    try:
        yield queue
    finally:
        # Put after everything rank 0 put, so the drain shows every epoch before it stops.
        with contextlib.suppress(Exception):
            queue.put(done, timeout=5)
        thread.join(timeout=5)
        with contextlib.suppress(Exception):
            queue.shutdown()
