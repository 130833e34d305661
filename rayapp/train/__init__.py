"""Stage 3, after driver: what each worker runs (TrainContext, loops, strategies, checkpoints)."""
