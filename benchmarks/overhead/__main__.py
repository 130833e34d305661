"""`python -m benchmarks.overhead [flags]`, from the repository root."""

import sys

from benchmarks.overhead.cli import main

if __name__ == "__main__":
    sys.exit(main())
