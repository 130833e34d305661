"""Stage 2, after cli: one job end to end (cluster, MLflow run, TorchTrainer.fit); sweeps."""
