"""Which Ray nodes a run's workers landed on, and which of the cluster's nodes it lost.

The workers' layout is posted as a `workers_placed` event (users ask where their ranks run,
and tests assert it), and checked: DeepSpeed's AutoTP forms tensor-parallel groups of
consecutive ranks, and Ray Train numbers ranks node by node, so a group straddles two
nodes exactly when a node holds a number of workers that is not a multiple of the group
size. The service refuses requests the cluster's node shapes cannot place that way
(contract/placement.py); a placement that still straddles (nodes partly busy with other
work when the workers were placed) fails here, before any collective runs at network speed.

The job's driver keeps the nodes alive when training started: a run that fails after one
of them died says so, whatever error Ray Train raised about it afterwards.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from contract.callbacks import EventType
from contract.placement import tensor_parallel_straddles
from contract.run_request import RunSpec

log = logging.getLogger("tuneyard.worker")

PLACED_EVENT = EventType.WORKERS_PLACED
SHORT_ID = 12


class TensorParallelStraddles(ValueError):
    """Ray placed a tensor-parallel group's ranks on more than one node."""


# -- in every worker ----------------------------------------------------------------------


def check_worker_nodes(
    spec: RunSpec, *, rank: int, post_event: Callable[[EventType, str], Any]
) -> None:
    """Gather each rank's node; rank 0 posts the layout. Raises TensorParallelStraddles on
    every rank when a tensor-parallel group spans nodes. A collective: every rank calls it."""
    import ray
    import torch.distributed as dist

    node = ray.get_runtime_context().get_node_id()
    nodes: list[Any] = [node]
    if dist.is_initialized():
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node)
    node_of_rank = [str(n) for n in nodes]
    if rank == 0:
        post_event(PLACED_EVENT, layout_message(node_of_rank))
    tp = spec.deepspeed.tensor_parallel_size
    straddling = tensor_parallel_straddles(node_of_rank, tp)
    if straddling:
        groups = "; ".join(
            f"ranks {', '.join(map(str, g))} on nodes "
            f"{', '.join(sorted({node_of_rank[r][:SHORT_ID] for r in g}))}"
            for g in straddling[:3]
        )
        raise TensorParallelStraddles(
            f"tensor-parallel groups of {tp} span nodes ({groups}): Ray placed "
            f"{layout_message(node_of_rank)}; each node must hold a multiple of {tp} of the "
            "run's workers. Free whole nodes for the run, or use tensor_parallel_size 1"
        )


def layout_message(node_of_rank: Sequence[str]) -> str:
    ranks: dict[str, list[int]] = defaultdict(list)
    for rank, node in enumerate(node_of_rank):
        ranks[node].append(rank)
    parts = [
        f"node {node[:SHORT_ID]}: rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for node, rs in ranks.items()
    ]
    count = len(node_of_rank)
    return (
        f"{count} worker{'s' if count != 1 else ''} on {len(ranks)} "
        f"node{'s' if len(ranks) != 1 else ''} ({'; '.join(parts)})"
    )


# -- in the job's driver ------------------------------------------------------------------


def alive_nodes() -> dict[str, str]:
    """The cluster's alive nodes now, id → address; {} when Ray cannot be read."""
    import ray

    try:
        if not ray.is_initialized():
            ray.init()
        return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes() if n["Alive"]}
    except Exception as exc:  # only a note on a failure's message depends on it
        log.warning("could not read the cluster's nodes: %s", exc)
        return {}


def lost_nodes_note(before: dict[str, str]) -> str | None:
    """Which of the nodes alive at the start have died since, in words; None if none."""
    if not before:
        return None
    now = alive_nodes()
    if not now:
        return None
    lost = {node: address for node, address in before.items() if node not in now}
    if not lost:
        return None
    names = ", ".join(f"{node[:SHORT_ID]} at {address}" for node, address in lost.items())
    plural = "s" if len(lost) > 1 else ""
    return (
        f"the cluster lost node{plural} {names} during the run; training stopped because "
        "what was left could not hold or restart it"
    )
