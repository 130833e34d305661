"""What does rayapp cost over plain torchrun + DDP, for the same workload and world size?

One run trains the job twice at the same world size (default 2 workers, Gloo on CPU):

1. torchrun: `torchrun --nproc-per-node W --master-addr 127.0.0.1 ... benchmarks/torchrun_ddp.py`,
   a plain DDP loop on exactly the same spec, data, model, optimizer, sampler and batches, built
   with rayapp's own builders; no Ray, MLflow or checkpoints.
2. rayapp: `python -m rayapp submit --nodes 1 --workers-per-node W ...` on one embedded Ray node, as
   torchrun's single launch runs on one machine (`--layout node-per-worker`: W nodes of one worker
   each), with MLflow in a SQLite store in a temporary directory; `epoch_time_s` is read back from
   MLflow.

MLflow's cost is read from each rayapp run itself: rank 0 logs what its paced background writes took
(`mlflow_write_s`), which the script sets against the training loop's time (`total_time_s`). Apart
from the runs it also times the `RunLogger.log_epoch` call in the loop and one epoch's 7 metrics in
a write of their own against a SQLite store of the same kind, what an unpaced writer would cost.
Then it prints the comparison. Steady state = median over the epochs after the first (warm-up).
rayapp's `epoch_time_s` covers the step loop only; its wall time per epoch, checkpoint and logging
included, comes from the MLflow timestamps of consecutive epochs. docs/benchmarks.md explains the
figures and what they showed.

    python -m benchmarks.overhead  # jobs/mlp_synthetic.yaml, 2 workers, 6 epochs
    python -m benchmarks.overhead --epochs 20 --json-out bench.json --wait-idle 300

Run from the repository root. Exit codes: 0 when both runs completed (whatever the verdicts), 1 when
a step failed, 2 for bad arguments, 130 on Ctrl-C. Every process a step starts is stopped before the
script exits.

Modules: `processes` (/proc snapshots, CPU of other processes, reaping), `step` (one child command
run, watched and stopped), `runs` (the torchrun and rayapp runs of a pair, MLflow's cost), `report`
(the tables), `cli` (flags and the figures).
"""
