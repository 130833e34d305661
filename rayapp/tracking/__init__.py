"""Stage 4, after launch/train/reports: MLflow run set-up, rank 0's logger, outbox, backfill."""
