"""Benchmark configuration."""

import sys
from pathlib import Path

# Under ``--import-mode=importlib`` pytest puts no test folder on ``sys.path``: this one
# goes there so that the benchmark files can import ``bench_common`` beside them.
sys.path.insert(0, str(Path(__file__).resolve().parent))
