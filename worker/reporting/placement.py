"""The job's driver checks placement before `fit()`, and says why a run could not be
placed. The rule itself is contract/placement.py's, which the service applies too."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from contract.callbacks import EventType
from contract.job_env import CLUSTER_AUTOSCALES_ENV, PLACEMENT_TIMEOUT_ENV
from contract.placement import (
    EPS,
    NodeResources,
    known,
    placement_shortfalls,
    shape,
    worker_demand,
    workers,
)
from contract.run_request import ResourcesSpec, RunSpec

log = logging.getLogger("tuneyard.worker")

WAITING_EVENT = EventType.WAITING_FOR_RESOURCES


class Unplaceable(Exception):
    """The cluster's nodes can never hold the run's workers, and the cluster does not grow."""


# -- in the job's driver ------------------------------------------------------------------


def check_before_fit(spec: RunSpec, *, post_event: Callable[[EventType, str], Any]) -> None:
    """Raise Unplaceable when the cluster can never hold the run; post a waiting event when
    it cannot hold it now (its resources are busy, or it has to grow). Ray Train then waits
    up to the placement timeout. A cluster that cannot be read is left to Ray Train."""
    import ray

    try:
        if not ray.is_initialized():
            ray.init()
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        free = ray.available_resources()
    except Exception as exc:  # not a reason to fail the run: Ray Train reads it again
        log.warning("could not read the cluster's resources before placing workers: %s", exc)
        return
    if not nodes:  # this driver runs on a node: an empty list is a view that is not ready
        return
    decision = placement_decision(
        spec.resources,
        nodes,
        free,
        autoscales=_autoscales(),
        tensor_parallel_size=spec.deepspeed.tensor_parallel_size,
    )
    if decision is not None:
        post_event(WAITING_EVENT, decision)


def placement_decision(
    res: ResourcesSpec,
    nodes: Sequence[NodeResources],
    free: NodeResources,
    *,
    autoscales: bool,
    timeout_s: float | None = None,
    tensor_parallel_size: int = 1,
) -> str | None:
    """None: the workers can be placed now. A message: they must wait for resources.
    Raises Unplaceable when they never can and the cluster does not grow.

    `free` is the cluster's free resources in total (Ray gives no per-node view to a
    driver); a cluster whose free resources are split across nodes may still make the
    workers wait, which Ray Train's timeout bounds."""
    timeout_s = placement_timeout_s() if timeout_s is None else timeout_s
    never = placement_shortfalls(res, nodes, tensor_parallel_size=tensor_parallel_size)
    wait = f"waiting up to {timeout_s:g} s for the workers to be placed"
    if never:
        reasons = "; ".join(s.message for s in never)
        if not autoscales:
            raise Unplaceable(f"{reasons}; the cluster does not autoscale")
        return f"{reasons}; the cluster may grow (autoscaling): {wait}"
    demand = worker_demand(res)
    needed = {name: need * res.num_workers for name, need in demand.items()}
    if all(free.get(name, 0.0) + EPS >= total for name, total in needed.items()):
        return None
    return (
        f"the run needs {shape(needed)} for {workers(res.num_workers)}, the cluster has "
        f"{shape(known(free, demand))} free now (other runs hold the rest): {wait}"
    )


def placement_timeout_s() -> float:
    """The service's TUNEYARD_PLACEMENT_TIMEOUT_S, as it reached the job (Ray's default
    when the job was started without it)."""
    try:
        return float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "60"))
    except ValueError:
        return 60.0


def _autoscales() -> bool:
    return os.environ.get(CLUSTER_AUTOSCALES_ENV) == "1"


# -- how a placement failure reads --------------------------------------------------------


def placement_failure(exc: BaseException) -> str | None:
    """The message for a run that failed because its workers could not be placed (this
    module's own refusal, or Ray Train giving up after the placement timeout); None for
    any other failure. Such a failure is not retried: another attempt would wait the same."""
    if isinstance(exc, Unplaceable):
        return str(exc)
    from ray.train.v2._internal.exceptions import (
        InsufficientClusterResourcesError,
        WorkerGroupStartupTimeoutError,
    )

    failure = getattr(exc, "controller_failure", None)
    if isinstance(failure, WorkerGroupStartupTimeoutError):
        return (
            f"the run's {workers(failure.num_workers)} could not be placed within the "
            f"placement timeout ({placement_timeout_s():g} s, TUNEYARD_PLACEMENT_TIMEOUT_S): "
            "the cluster did not have or add the resources they ask for; see the run's "
            f"{WAITING_EVENT} event"
        )
    if isinstance(failure, InsufficientClusterResourcesError):
        lines = [line for line in str(failure).splitlines() if line.strip()]
        return f"the cluster cannot hold the run's workers: {' '.join(lines[:2])}"
    return None
