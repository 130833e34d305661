"""Stage 3, after driver: comparison tables and scaling plots of MLflow runs."""
