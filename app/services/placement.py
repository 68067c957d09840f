"""Refuse, at validation, a run the cluster can never place.

Ray would accept the job and Ray Train would wait for workers that can never start (a GPU
run on a cluster without GPUs, a worker larger than any node). The rule is the one the
job's driver applies again from inside the cluster (worker/reporting/placement.py); here it is
applied to the nodes the cluster has, read through the dashboard and cached for a few
seconds. A cluster that may grow (TUNEYARD_CLUSTER_AUTOSCALES) is not judged by its
current nodes, and a cluster that cannot be read refuses nothing: the dispatcher deals
with an unreachable Ray as it always has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from app.cluster.ray_jobs import RayUnavailable
from app.errors import field_problem
from contract.placement import NodeResources, placement_shortfalls
from contract.run_request import ResourcesSpec

log = logging.getLogger("tuneyard")

# Nodes come and go rarely; validating a burst of requests reads them once.
CLUSTER_VIEW_TTL_S = 5.0
# A service's first seconds: a request waits this long at most for the cluster's nodes to
# be known (Ray answering, its head's node registered), read again every FIRST_READ_POLL_S,
# rather than accept unjudged a run the cluster may never hold (a GPU run on CPU nodes).
FIRST_READ_WAIT_S = 5.0
FIRST_READ_POLL_S = 0.25

Problem = dict[str, str]


def placement_problems(
    res: ResourcesSpec, nodes: Sequence[NodeResources], *, tensor_parallel_size: int = 1
) -> list[Problem]:
    """Why `nodes` (each alive node's total resources) can never hold the run's workers,
    as field problems naming what was asked and what the cluster has; [] when they can."""
    return [
        field_problem(s.field, f"{s.message}; change the request or add nodes")
        for s in placement_shortfalls(res, nodes, tensor_parallel_size=tensor_parallel_size)
    ]


class ClusterView:
    """The cluster's nodes as validation sees them: None when they must not be judged (the
    cluster autoscales) or are not known (Ray cannot be read, or has no node yet).

    Requests never wait on Ray, except in the view's first `first_read_wait_s`: until the
    nodes are known then, a request waits for them (read again and again, an answer without
    nodes counting for nothing), so that a run posted just after start-up is judged like
    any other. After that a stale or unknown view is answered at once and read again in the
    background, at most every `ttl_s`."""

    def __init__(
        self,
        read_nodes: Callable[[], list[dict[str, float]]],
        *,
        autoscales: bool,
        ttl_s: float = CLUSTER_VIEW_TTL_S,
        first_read_wait_s: float = FIRST_READ_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read_nodes = read_nodes
        self.autoscales = autoscales
        self._ttl_s = ttl_s
        self._clock = clock
        # Real time, whatever `clock` (the TTL's) says: requests wait on it.
        self._starting_until = time.monotonic() + first_read_wait_s
        self._lock = threading.Lock()
        self._nodes: list[dict[str, float]] | None = None
        self._read_at: float | None = None
        self._reading: threading.Thread | None = None

    def refresh(self) -> threading.Thread | None:
        """Read the nodes again in the background, unless a read is under way or the view
        is fresh; the read's thread (None when nothing was started)."""
        if self.autoscales:
            return None
        with self._lock:
            fresh = self._read_at is not None and self._clock() - self._read_at < self._ttl_s
            if self._reading is None and not fresh:
                self._reading = threading.Thread(
                    target=self._read_in_background, name="tuneyard-cluster-view", daemon=True
                )
                self._reading.start()
            return self._reading

    def nodes(self) -> list[dict[str, float]] | None:
        if self.autoscales:
            return None
        reading = self.refresh()
        while self._nodes is None and (left := self._starting_until - time.monotonic()) > 0:
            # Nothing known yet, in the view's first seconds: wait for a read that knows.
            if reading is not None:
                reading.join(left)
            else:
                time.sleep(min(FIRST_READ_POLL_S, left))
            reading = self.refresh()
        return self._nodes

    def _starting(self) -> bool:
        return time.monotonic() < self._starting_until

    def _read_in_background(self) -> None:
        nodes, settled = self._read()
        if nodes is None and self._starting():
            # Not known yet, and requests wait for it: read again soon, not after the TTL.
            settled = False
            time.sleep(FIRST_READ_POLL_S)
        with self._lock:
            self._nodes, self._reading = nodes, None
            # A cluster still starting is asked again at once, not after the TTL: the
            # dispatcher judges runs by it, and a head's first seconds are when a burst of
            # runs would otherwise all be started unjudged.
            self._read_at = self._clock() if settled else None

    def _read(self) -> tuple[list[dict[str, float]] | None, bool]:
        """The nodes (None: not to be judged), and whether that answer holds for the TTL."""
        try:
            nodes = self._read_nodes()
        except RayUnavailable as exc:
            log.warning("placement not checked: %s", exc)
            return None, True
        except Exception:  # validation must never fail because the cluster view did
            log.exception("placement not checked: reading the cluster's nodes failed")
            return None, True
        # A cluster with no alive node at all is one still starting: judge nothing by it.
        return nodes or None, bool(nodes)

    def problems(self, res: ResourcesSpec, *, tensor_parallel_size: int = 1) -> list[Problem]:
        """`placement_problems` against the cluster's current nodes, or [] when they are
        not to be judged."""
        nodes = self.nodes()
        if nodes is None:
            return []
        return placement_problems(res, nodes, tensor_parallel_size=tensor_parallel_size)
