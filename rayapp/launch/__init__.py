"""Stage 3, after driver: the embedded cluster, preflight checks, Jobs API client, upload."""
