"""The environment variables through which the dispatcher hands one attempt to its worker,
and the PATH every process tuneyard starts for a run finds its tools on."""

import os
import sys
from pathlib import Path

# The attempt's RunSpec as JSON (contract/run_request.py).
SPEC_ENV = "TUNEYARD_RUN_SPEC"
# The attempt's own callback token. It sits in the job's runtime_env, which anyone with the
# Ray dashboard can read, so it is good for this run's one attempt only, and only while that
# attempt lasts: the service forgets its hash when the attempt ends (app/services/lifecycle.py).
TOKEN_ENV = "TUNEYARD_RUN_TOKEN"
# Where the service listens for the worker's callbacks, as the cluster reaches it.
CALLBACK_URL_ENV = "TUNEYARD_CALLBACK_URL"
# "1" when the service is configured with TUNEYARD_CLUSTER_AUTOSCALES: the cluster may grow,
# so a run its current nodes cannot hold waits for new ones instead of failing at once.
CLUSTER_AUTOSCALES_ENV = "TUNEYARD_CLUSTER_AUTOSCALES"
# Ray Train's own name for how long a worker group may wait to be placed; the service sets
# it to TUNEYARD_PLACEMENT_TIMEOUT_S (Ray's default is 60 s, retried without end).
PLACEMENT_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
# A profile's job only (`POST /v1/runs/validate` with `profile: true`, run by
# `python -m worker.profile`): JSON {"steps", "warmup_steps", "result"}, where `result` is the
# storage location the profile's measurements go to, for the service to read back.
PROFILE_ENV = "TUNEYARD_PROFILE"
# Seconds between the worker's reads of GET /v1/internal/runs/{id}/control (whether the
# scheduler asks the attempt to checkpoint now and stop: preemption); the service sets it
# to TUNEYARD_PREEMPTION_POLL_S.
CONTROL_POLL_ENV = "TUNEYARD_CONTROL_POLL_S"
# When the service handed the job to Ray, in seconds since the epoch on the service's clock:
# the worker's first start-up phase ("job", contract/callbacks.py StartupPhase) is measured
# from it, so a service and a head on different machines need their clocks in step (NTP).
SUBMITTED_AT_ENV = "TUNEYARD_SUBMITTED_AT"
# What the dispatcher sets in every job: no configured job variable may replace these, and
# nothing named TUNEYARD_* at all.
RESERVED_PREFIX = "TUNEYARD_"
RESERVED_NAMES = frozenset(
    {
        SPEC_ENV,
        TOKEN_ENV,
        CALLBACK_URL_ENV,
        CLUSTER_AUTOSCALES_ENV,
        PLACEMENT_TIMEOUT_ENV,
        PROFILE_ENV,
        CONTROL_POLL_ENV,
        SUBMITTED_AT_ENV,
    }
)


def is_reserved(name: str) -> bool:
    """Whether `name` is one of tuneyard's own job variables."""
    return name in RESERVED_NAMES or name.startswith(RESERVED_PREFIX)


# Experiment tracking (worker/reporting/tracking.py). The MLflow server a run that asks for MLflow
# logs to: the service's TUNEYARD_MLFLOW_TRACKING_URI, under MLflow's own name for it.
MLFLOW_TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
# The trackers' credentials: a run that asks for a tracker gets the service's own values of
# its variables, when set (as every job gets contract/storage.py's CREDENTIAL_VARIABLES with
# object storage); a run that does not ask gets none of them.
TRACKER_VARIABLES = {
    "mlflow": ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
    "wandb": ("WANDB_API_KEY", "WANDB_BASE_URL"),
}


def path_with_this_environment(path: str | None) -> str:
    """`path` with this Python environment's bin folder first: the `python` a job's entrypoint
    (`python -m worker`) runs, the `ray` a node starts with, and the `ninja` DeepSpeed's JIT
    builds use. Every process that builds or loads those ops must find the same ninja: the
    venv's and the system's hash the build commands in .ninja_log differently, and each
    switch between them rebuilt both ops from scratch (about 75 s) instead of loading them."""
    return f"{Path(sys.executable).parent}{os.pathsep}{path or ''}"
