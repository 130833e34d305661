"""The CLI's contract for people: help with examples, one-line errors, exit code 2 for bad input."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner
from conftest import JOBS, has_cuda

from rayapp.cli import main


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_help_has_examples():
    for args in ([], ["submit"], ["runs"], ["ui"]):
        result = invoke(*args, "-h")
        assert result.exit_code == 0
        assert "Example" in result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nodes", "0"], "cluster.nodes: 0 is not accepted; use a whole number >= 1"),
        (["--nodes", "-3"], "cluster.nodes: -3"),
        (
            ["--nodes", "2:1"],
            "cluster.min_nodes: 2 is more than cluster.nodes 1; "
            "use --nodes MIN:MAX with MIN <= MAX",
        ),
        (
            ["--nodes", "one"],
            "cluster.nodes: 'one' is not accepted; use a whole number >= 1, or MIN:MAX",
        ),
        (
            ["--backend", "tcp"],
            "cluster.backend: 'tcp' is not accepted; use one of: auto, nccl, gloo, mpi",
        ),
        (["--strategy", "pipeline"], "train.strategy: 'pipeline' is not accepted"),
        (["--epochs", "0"], "train.epochs: 0"),
        (["--lr", "0"], "train.lr: 0.0"),
        (
            ["--precision", "fp8"],
            "train.precision: 'fp8' is not accepted; use one of: fp32, bf16, fp16",
        ),
        (["--checkpoint-every", "0"], "checkpoint.every_epochs: 0 is not accepted"),
        (["--log-every-steps", "-1"], "tracking.log_every_steps: -1 is not accepted"),
        (["--system-metrics-interval", "-2"], "tracking.system_metrics_s: -2.0 is not accepted"),
        (["--precision", "fp16"], "fp16"),  # on a machine with no GPU: names what CPUs accept
    ],
)
def test_bad_flags_exit_2_with_one_line(args, message):
    result = invoke("submit", str(JOBS / "seed_linear.yaml"), *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_missing_job_file_exit_2(tmp_path):
    result = invoke("submit", str(tmp_path / "missing.yaml"))
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_malformed_yaml_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {epochs: 3\n")
    result = invoke("submit", str(path))
    assert result.exit_code == 2
    assert "not valid YAML" in result.output


def test_unknown_yaml_key_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  learning_rate: 0.1\n")
    result = invoke("submit", str(path))
    assert result.exit_code == 2
    assert "train.learning_rate: unknown key" in result.output


@pytest.mark.skipif(has_cuda(), reason="checks the no-GPU error")
def test_nccl_without_gpu_exit_2():
    result = invoke("submit", str(JOBS / "seed_linear.yaml"), "--backend", "nccl")
    assert result.exit_code == 2
    assert "'nccl' is not accepted on this machine (no CUDA GPU)" in result.output


def test_runs_on_missing_experiment_is_one_line(tmp_path):
    result = invoke(
        "runs", "--tracking-uri", f"sqlite:///{tmp_path / 'empty.db'}", "--experiment", "nothing"
    )
    assert result.exit_code == 1
    assert "experiment 'nothing' does not exist" in result.output


def test_mpi_without_mpi_build_says_how_to_get_one():
    import torch.distributed as dist

    if dist.is_mpi_available():
        pytest.skip("this torch build has MPI")
    result = invoke("submit", str(JOBS / "seed_linear.yaml"), "--backend", "mpi")
    assert result.exit_code == 2
    assert (
        "'mpi' is not available in this torch build" in result.output
        and "USE_MPI=1" in result.output
    )


@pytest.mark.skipif(has_cuda(), reason="checks the no-GPU error")
@pytest.mark.parametrize("strategy", ["dp", "mp"])
def test_multi_gpu_strategies_without_gpus_exit_2(strategy):
    result = invoke("submit", str(JOBS / "digits_mlp.yaml"), "--strategy", strategy)
    assert result.exit_code == 2
    assert (
        f"'{strategy}' needs at least 2 CUDA GPUs on one node and this machine has 0"
        in result.output
    )


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGHUP, 129), (signal.SIGTERM, 143)])
def test_a_hangup_or_terminate_ends_a_command_like_ctrl_c_with_128_plus_the_signal(
    signum, exit_code
):
    """A closed terminal (SIGHUP) or a `kill` (SIGTERM) runs the same clean-up as Ctrl-C: the
    signal becomes an exception in the main thread, and the CLI exits 128 + its number."""
    program = textwrap.dedent(f"""
        import os, signal, time
        from rayapp.cli.common import friendly_errors
        from rayapp.driver.signals import raise_on_termination

        @friendly_errors
        def command():
            raise_on_termination()
            try:
                os.kill(os.getpid(), {int(signum)})
                time.sleep(30)
            finally:
                print("clean-up ran", flush=True)

        command()
    """)
    # As from a terminal: under nohup (SIGHUP ignored, inherited) rayapp rightly leaves SIGHUP
    # alone.
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL),
    )
    assert result.returncode == exit_code, result.stderr
    assert "clean-up ran" in result.stdout
    assert (
        f"terminated by {signal.Signals(signum).name}" in result.stderr
        and "Traceback" not in result.stderr
    )


def test_cluster_up_checks_its_node_count_before_starting_anything():
    result = invoke("cluster", "up", "--nodes", "0")
    assert result.exit_code == 2
    assert (
        result.output.strip()
        == "rayapp: error: --nodes: 0 is not accepted; use a whole number >= 1"
    )
