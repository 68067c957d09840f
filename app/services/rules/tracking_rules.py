"""Experiment tracking on the service's side: what a request's `tracking` needs from the
service (checked before any compute), and what a tracked run's job gets from it.

A tracker the service cannot serve is refused with a 422 rather than left to fail quietly
on the cluster, where worker/reporting/tracking.py would only report it as an event: the client
package missing, no MLflow server configured, W&B online without an API key.

Runs track under the service's credentials, so where a key's runs may write is the
operator's to say (`tuneyard keys create/update`): with the key's `tracking_prefix`, the
MLflow experiment and W&B project must start with it (another name is refused, naming the
field; an unset one becomes the prefix followed by the default name); with its
`wandb_entity`, that W&B entity and no other (unset: it).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from app.errors import field_problem
from app.storage.models import ApiKey
from contract.job_env import MLFLOW_TRACKING_URI_ENV, TRACKER_VARIABLES
from contract.run_request import MlflowTracking, RunDefinition, RunSpec, WandbTracking

WANDB_API_KEY = "WANDB_API_KEY"


@dataclass(frozen=True, slots=True)
class TrackingConfig:
    """What tracking needs of the service's settings (`Settings.tracking_config`): its MLflow
    server, and the variables every job gets (`TUNEYARD_JOB_ENV`), which may hold a W&B key.
    The default is a service with neither."""

    mlflow_tracking_uri: str | None = None
    job_env: Mapping[str, str] = field(default_factory=dict)


def tracking_problems(request: RunDefinition, config: TrackingConfig) -> list[dict[str, str]]:
    """What the request's trackers need that this service lacks, naming each field."""
    uri, job_env = config.mlflow_tracking_uri, config.job_env
    problems = []
    if request.tracking.mlflow is not None:
        if not _installed("mlflow"):
            problems.append(_extra_missing("mlflow"))
        elif not uri:
            problems.append(
                field_problem(
                    "tracking.mlflow",
                    "this service has no MLflow tracking server (TUNEYARD_MLFLOW_TRACKING_URI) "
                    "to log to: ask its operator to set one, or leave tracking.mlflow out",
                )
            )
    wandb = request.tracking.wandb
    if wandb is not None:
        if not _installed("wandb"):
            problems.append(_extra_missing("wandb"))
        elif wandb.mode == "online" and not (
            os.environ.get(WANDB_API_KEY) or job_env.get(WANDB_API_KEY)
        ):
            problems.append(
                field_problem(
                    "tracking.wandb",
                    "mode 'online' needs a W&B API key, and this service has none "
                    f"({WANDB_API_KEY} in its environment): use mode 'offline', which writes "
                    "the run to files on the worker for `wandb sync` to upload later, or ask "
                    "the service's operator to set one",
                )
            )
    return problems


def key_tracking_problems(
    session: Session,
    request: RunDefinition,
    *,
    owner_id: str,
    spec: dict[str, Any] | None = None,
) -> list[dict[str, str]]:
    """Where the caller's API key lets its runs track (see the module's doc): each name
    outside it, naming its field. A name the request left unset becomes the key's, written
    into `spec` (the run's definition as it will be stored), so that the run, its
    validation's `resolved` and the worker all see it. A caller without a key is not held."""
    key = session.get(ApiKey, owner_id)
    if key is None or (key.tracking_prefix is None and key.wandb_entity is None):
        return []
    problems = []
    tracking = (spec or {}).get("tracking") or {}
    mlflow, wandb = request.tracking.mlflow, request.tracking.wandb
    prefix = key.tracking_prefix
    for tracker, name, asked in (
        ("mlflow", "experiment", mlflow),
        ("wandb", "project", wandb),
    ):
        if asked is None or prefix is None:
            continue
        if name not in asked.model_fields_set:
            default = _DEFAULT_NAMES[tracker]
            if isinstance(tracking.get(tracker), dict):
                tracking[tracker][name] = f"{prefix}{default}"
        elif not getattr(asked, name).startswith(prefix):
            problems.append(
                field_problem(
                    f"tracking.{tracker}.{name}",
                    f"{getattr(asked, name)!r} does not start with {prefix!r}, this API key's "
                    f"tracking_prefix: runs of this key track only under it (leave {name} "
                    f"unset for {prefix + _DEFAULT_NAMES[tracker]!r})",
                )
            )
    entity = key.wandb_entity
    if wandb is not None and entity is not None:
        if wandb.entity is None:
            if isinstance(tracking.get("wandb"), dict):
                tracking["wandb"]["entity"] = entity
        elif wandb.entity != entity:
            problems.append(
                field_problem(
                    "tracking.wandb.entity",
                    f"this API key's runs log to the W&B entity {entity!r} only (its "
                    f"wandb_entity), not {wandb.entity!r}: leave entity unset, or set it so",
                )
            )
    return problems


# The names a request that leaves them unset tracks under (contract/run_request.py).
_DEFAULT_NAMES = {
    "mlflow": str(MlflowTracking.model_fields["experiment"].default),
    "wandb": str(WandbTracking.model_fields["project"].default),
}


def tracking_job_env(
    spec: RunSpec, *, config: TrackingConfig, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What an attempt's trackers need in its job's environment: the MLflow server, and the
    service's own values (from `environ`, default this process's) of the credential
    variables of each tracker the run asks for. Only those: the job's environment can be
    read by anyone with the Ray dashboard."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    asked = {"mlflow": spec.tracking.mlflow, "wandb": spec.tracking.wandb}
    for tracker, names in TRACKER_VARIABLES.items():
        if asked[tracker] is not None:
            env.update({name: environ[name] for name in names if environ.get(name)})
    if spec.tracking.mlflow is not None and config.mlflow_tracking_uri:
        env[MLFLOW_TRACKING_URI_ENV] = config.mlflow_tracking_uri
    return env


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _extra_missing(tracker: str) -> dict[str, str]:
    return field_problem(
        f"tracking.{tracker}",
        f"tracking.{tracker} needs tuneyard's {tracker} extra, which this service lacks: "
        f"pip install 'tuneyard[{tracker}]'",
    )
