"""Whether a cluster's nodes can ever hold a run's workers. Torch-free, shared.

Ray Train waits for a placement group that cannot be satisfied and, by default, retries
that wait without end (a worker-group start timeout is a retryable controller error), so
a GPU run on a cluster without GPUs would sit in `running` forever. This rule is applied
twice: by the service at validation (app/services/placement.py), against the nodes the
cluster has, and by the job's driver before `fit()` (worker/reporting/placement.py), from inside the
cluster. Each worker is one placement bundle (`worker_demand`, what worker/training/trainer.py asks
Ray Train for) that must fit on a single node, so what matters is each node's shape, not
only the cluster's totals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from contract.run_request import ResourcesSpec

# One node's resources by Ray's names ("CPU", "GPU", ...): its totals, or what is free.
NodeResources = Mapping[str, float]
# Ray accounts resources in units of 1e-4; a float quotient just under a whole number is one.
EPS = 1e-6


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why the nodes cannot hold the run: the request field to change, and the reason."""

    field: str
    message: str


def worker_demand(res: ResourcesSpec) -> dict[str, float]:
    """What one worker reserves on its node, as Ray Train asks for it
    (worker/training/trainer.py)."""
    demand = {"CPU": float(res.cpus_per_worker)}
    if res.use_gpu:
        demand["GPU"] = float(res.gpus_per_worker or 1)
    return demand


def placement_shortfalls(
    res: ResourcesSpec, nodes: Sequence[NodeResources], *, tensor_parallel_size: int = 1
) -> list[Shortfall]:
    """Why `nodes` (each alive node's total resources) can never hold every worker of the
    run, each tensor-parallel group on one node; [] if they can. Pure: the service and
    the job's driver both apply it."""
    demand = worker_demand(res)
    asked = f"the run asks for {workers(res.num_workers)} x {shape(demand)}"
    if "GPU" in demand and not any(n.get("GPU", 0) > 0 for n in nodes):
        return [Shortfall("resources.use_gpu", f"{asked}, but the cluster has no GPUs")]
    shortfalls = []
    for name, need in demand.items():
        largest = max((n.get(name, 0.0) for n in nodes), default=0.0)
        if largest + EPS < need:
            shortfalls.append(
                Shortfall(
                    _FIELDS[name],
                    f"{asked}, but {amount(need, name)} fit on no node: the largest node "
                    f"has {amount(largest, name)}",
                )
            )
    if shortfalls:
        return shortfalls
    room = sum(workers_that_fit(demand, n) for n in nodes)
    if room == 0:
        # Each resource fits somewhere, but no single node has all of them.
        return [
            Shortfall(
                "resources.cpus_per_worker",
                f"{asked}, but no node has all of {shape(demand)}: the nodes have "
                f"{'; '.join(sorted({shape(known(n, demand)) for n in nodes}))}",
            )
        ]
    if room < res.num_workers:
        return [
            Shortfall(
                "resources.num_workers",
                f"{asked}, but they fit {room} at most on the cluster's nodes "
                f"({shape(totals(nodes, demand))})",
            )
        ]
    tp = tensor_parallel_size
    groups = sum(workers_that_fit(demand, n) // tp for n in nodes)
    if tp > 1 and groups * tp < res.num_workers:
        # A tensor-parallel group exchanges activations at every layer: across nodes it
        # would run at network speed, so each group must fit on one node.
        per_node = sorted((workers_that_fit(demand, n) for n in nodes), reverse=True)
        return [
            Shortfall(
                "deepspeed.tensor_parallel_size",
                f"{asked} in tensor-parallel groups of {tp}, each on one node, but the "
                f"cluster's nodes hold {groups} such group{'' if groups == 1 else 's'} "
                f"({res.num_workers // tp} needed; the nodes fit "
                f"{', '.join(map(str, per_node))} workers each)",
            )
        ]
    return []


def tensor_parallel_straddles(
    node_of_rank: Sequence[str], tensor_parallel_size: int
) -> list[tuple[int, ...]]:
    """The tensor-parallel groups (consecutive ranks, as DeepSpeed's AutoTP mesh forms
    them) whose ranks Ray placed on more than one node."""
    tp = tensor_parallel_size
    groups = [tuple(range(i, i + tp)) for i in range(0, len(node_of_rank), tp)]
    return [g for g in groups if len({node_of_rank[r] for r in g}) > 1]


# More workers than any request may ask for (resources.num_workers <= 1024): the answer for
# a demand so small that the quotient overflows, or for a resource asked for not at all.
MOST = 2**31


def workers_that_fit(demand: Mapping[str, float], node: NodeResources) -> int:
    """How many workers of this shape one node holds."""
    return min((_fits(node.get(name, 0.0), need) for name, need in demand.items()), default=MOST)


def _fits(have: float, need: float) -> int:
    if need <= 0:
        return MOST
    quotient = have / need + EPS
    return min(math.floor(quotient), MOST) if math.isfinite(quotient) else MOST


# -- words --------------------------------------------------------------------------------

_FIELDS = {"CPU": "resources.cpus_per_worker", "GPU": "resources.gpus_per_worker"}


def amount(value: float, name: str) -> str:
    return f"{value:g} {name}{'' if value == 1 else 's'}"


def workers(count: int) -> str:
    return f"{count} worker{'' if count == 1 else 's'}"


def shape(resources: Mapping[str, float]) -> str:
    # GPUs first: on a GPU run they are what is scarce.
    ordered = sorted(resources.items(), key=lambda item: item[0] != "GPU")
    return " + ".join(amount(value, name) for name, value in ordered)


def known(node: NodeResources, demand: Mapping[str, float]) -> dict[str, float]:
    return {name: float(node.get(name, 0.0)) for name in demand}


def totals(nodes: Sequence[NodeResources], demand: Mapping[str, float]) -> dict[str, float]:
    return {name: float(sum(n.get(name, 0.0) for n in nodes)) for name in demand}
