"""rayapp's benchmarks. Run the overhead comparison as `python -m benchmarks.overhead` from the
repository root."""
