"""The runtime_env of every Ray job tuneyard submits: the packages it ships and the variables
it sets (a run's attempt, app/services/dispatch.py, or a validation's profile,
app/services/profiles.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.settings import Settings
from contract.job_env import (
    CLUSTER_AUTOSCALES_ENV,
    CONTROL_POLL_ENV,
    PLACEMENT_TIMEOUT_ENV,
    SPEC_ENV,
    SUBMITTED_AT_ENV,
)
from contract.run_request import RunSpec

_ROOT = Path(__file__).resolve().parents[2]
# What ships to the cluster with every job: the worker and the run contract it reads.
JOB_PACKAGES = [str(_ROOT / "worker"), str(_ROOT / "contract")]
ENTRYPOINT = "python -m worker"


def job_runtime_env(spec: RunSpec, *, settings: Settings, env: Mapping[str, str]) -> dict[str, Any]:
    """The runtime_env of every job tuneyard submits, a run's attempt or a validation's
    profile (app/services/profiles.py): the same packages, variables and spec, so that a
    profile measures what the run will train. `env`: the job's own variables, set last."""
    # The operator's variables first (NCCL_*, HF_TOKEN, ...; Settings refuses tuneyard's own
    # names), so what tuneyard sets below always wins. Never logged: they may be secrets.
    env_vars = settings.resolved_job_env()
    env_vars.update(
        {
            SPEC_ENV: spec.model_dump_json(),
            "PYTHONUNBUFFERED": "1",
            # Ray Train's wait for the workers to be placed; worker/training/trainer.py makes its
            # expiry end the run (Ray's default retries it forever).
            PLACEMENT_TIMEOUT_ENV: str(settings.placement_timeout_s),
            CLUSTER_AUTOSCALES_ENV: "1" if settings.cluster_autoscales else "0",
            CONTROL_POLL_ENV: str(settings.preemption_poll_s),
            # Built just before the submit: where the worker's start-up phases begin.
            SUBMITTED_AT_ENV: f"{time.time():.3f}",
            **env,
        }
    )
    if not spec.resources.use_gpu:
        env_vars["DS_ACCELERATOR"] = "cpu"  # skip DeepSpeed's accelerator probing
    return {"py_modules": JOB_PACKAGES, "env_vars": env_vars}
