"""The old command, kept working: `python benchmarks/rayapp_vs_torchrun.py [flags]` runs
`python -m benchmarks.overhead [flags]` (benchmarks/overhead/), the same flags and figures."""

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # the repository root, for `benchmarks`
from benchmarks.overhead.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
