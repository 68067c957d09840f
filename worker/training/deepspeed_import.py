"""DeepSpeed, imported on a rank without the MLflow import it would otherwise make.

`import deepspeed` imports its autotuner (deepspeed/runtime/config.py → deepspeed/autotuning),
which tries `import mlflow` at module level to log autotuning experiments. tuneyard never
autotunes, but MLflow is installed for the runs that track to it (worker/reporting/
tracking.py), and importing it (with its GenAI and gateway modules, FastAPI among them)
costs every rank about 1.4 CPU seconds of its start, twice a run on the default 2 workers.
"""

from __future__ import annotations

import sys


def import_deepspeed() -> None:
    """Import DeepSpeed with MLflow hidden from it, unless either is imported already.

    A module set to None in `sys.modules` makes its import raise ImportError, which the
    autotuner takes as "no MLflow". The entry is removed at once, so the rank 0 of a run
    that asks for MLflow still imports the real one when its tracker starts."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]
