"""worker/training/deepspeed_import.py: DeepSpeed on a rank without MLflow, MLflow still there
for the runs that track to it."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from worker.training.deepspeed_import import import_deepspeed
import_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
print("mlflow imported with deepspeed:", "mlflow" in sys.modules, autotuner.has_mlflow)
import mlflow
print("mlflow later:", mlflow.__name__)
"""


def test_deepspeed_comes_without_mlflow_and_mlflow_still_imports_after() -> None:
    # A fresh interpreter: this process may hold either module already.
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert "mlflow imported with deepspeed: False False" in out, out
    assert "mlflow later: mlflow" in out, out
