"""The scheduler's rules: which queued runs start now, why the others wait, and which run
to preempt. Pure: app/services/dispatch.py feeds it the database's runs and the cluster's free
resources inside one locked transaction, and the run views use `queue_order` for positions.

The order (Kueue's and Determined's, for training runs):
1. Higher `priority` first.
2. Within a priority, fair share between API keys: the key with fewer running runs, then
   fewer GPUs in use, goes first; each run taken counts for its key at once, so a key's
   twenty runs interleave with another key's two instead of going first.
3. Then the oldest (`queued_at`, which a new attempt resets), then the id.

Admission walks that order. A run starts when a slot is free (`max_concurrent_runs`), its
key is within `max_running_runs` and `max_gpus`, and its workers fit the cluster's free
resources now, each worker on one node and each tensor-parallel group on one node. A run
kept back by its key's quota keeps no one else back; one that waits for the cluster keeps
back every run of lower priority ("behind higher priority"), so that small runs cannot
starve a large urgent one, while runs of its own priority may still fill what it cannot use.

A reason, and a preemption's, names another run by its id only to that run's own key; to
any other key it is "another key's run" (its ids are how paths into its storage are found).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from contract.placement import EPS, shape

Resources = dict[str, float]


@dataclass(frozen=True, slots=True)
class Ask:
    """What one run asks of the cluster: `workers` workers of `per_worker` each, in groups
    of `group` that must share a node (tensor parallelism)."""

    workers: int
    per_worker: Mapping[str, float]
    group: int = 1

    @property
    def total(self) -> Resources:
        return {name: amount * self.workers for name, amount in self.per_worker.items()}

    @property
    def gpus(self) -> int:
        return math.ceil(self.total.get("GPU", 0.0) - EPS)

    @classmethod
    def of_spec(cls, spec: Mapping[str, Any]) -> Ask:
        """From a stored run spec, read as a dict: the scheduler reads every queued run each
        pass, and the spec's model costs more to build than this whole decision. The stored
        spec is resolved, every field present (contract.placement.worker_demand's rule)."""
        res = spec.get("resources") or {}
        per_worker = {"CPU": float(res.get("cpus_per_worker", 1))}
        if res.get("use_gpu"):
            per_worker["GPU"] = float(res.get("gpus_per_worker") or 1)
        tp = int((spec.get("deepspeed") or {}).get("tensor_parallel_size") or 1)
        return cls(workers=int(res.get("num_workers", 1)), per_worker=per_worker, group=tp)


@dataclass(frozen=True, slots=True)
class Queued:
    id: str
    owner: str
    priority: int
    queued_at: datetime
    ask: Ask


@dataclass(frozen=True, slots=True)
class Live:
    """A run holding (or about to hold) resources: starting, running or cancelling."""

    id: str
    owner: str
    priority: int
    ask: Ask
    preemptible: bool = False
    # When its current attempt began running; None while it has not.
    running_since: datetime | None = None
    # Asked to checkpoint and stop, and not yet stopped.
    preempting: bool = False


@dataclass(frozen=True, slots=True)
class KeyLimits:
    max_running_runs: int | None = None
    max_gpus: int | None = None


@dataclass
class Usage:
    runs: int = 0
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class Preemption:
    victim: str
    for_run: str
    reason: str


@dataclass
class Plan:
    start: list[str] = field(default_factory=list)
    # Why each queued run that does not start waits, in the words users read.
    reasons: dict[str, str] = field(default_factory=dict)
    preempt: list[Preemption] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Policy:
    max_concurrent_runs: int
    preemption: bool = True
    # A run's attempt is never preempted before it has run this long: no thrashing.
    min_run_time: timedelta = timedelta(minutes=10)


def usage_by_key(live: Iterable[Live]) -> dict[str, Usage]:
    usage: dict[str, Usage] = defaultdict(Usage)
    for run in live:
        usage[run.owner].runs += 1
        usage[run.owner].gpus += run.ask.gpus
    return usage


def queue_order(queued: Sequence[Queued], usage: Mapping[str, Usage]) -> list[Queued]:
    """The queue as the scheduler takes it (the module's docstring says the rule)."""
    by_key: dict[tuple[int, str], list[Queued]] = defaultdict(list)
    for run in sorted(queued, key=lambda r: (r.queued_at, r.id)):
        by_key[(run.priority, run.owner)].append(run)
    taken: dict[str, Usage] = {owner: Usage(u.runs, u.gpus) for owner, u in usage.items()}
    heads = {key: 0 for key in by_key}
    order: list[Queued] = []
    priorities = sorted({p for p, _ in by_key}, reverse=True)
    for priority in priorities:
        keys = [key for key in by_key if key[0] == priority]
        while len(keys) > 1:
            # Few keys wait at once; a scan per pick is cheaper than keeping a heap fresh.
            best = min(keys, key=lambda k: _fair_share_rank(by_key[k][heads[k]], taken))
            run = by_key[best][heads[best]]
            order.append(run)
            used = taken.setdefault(run.owner, Usage())
            used.runs += 1
            used.gpus += run.ask.gpus
            heads[best] += 1
            if heads[best] == len(by_key[best]):
                keys.remove(best)
        if keys:
            # One key left at this priority: the rest of its runs in their order, no picks.
            rest = by_key[keys[0]][heads[keys[0]] :]
            order.extend(rest)
            if priority == priorities[-1]:
                break  # nothing after them: what they take counts for no one
            used = taken.setdefault(rest[0].owner, Usage())
            used.runs += len(rest)
            used.gpus += sum(run.ask.gpus for run in rest)
    return order


def _fair_share_rank(run: Queued, taken: Mapping[str, Usage]) -> tuple[int, int, datetime, str]:
    used = taken.get(run.owner) or Usage()
    return used.runs, used.gpus, run.queued_at, run.id


def plan(
    queued: Sequence[Queued],
    live: Sequence[Live],
    *,
    limits: Mapping[str, KeyLimits],
    free_nodes: Sequence[Mapping[str, float]] | None,
    policy: Policy,
    now: datetime,
    releasing: bool = False,
) -> Plan:
    """Which queued runs start, why the rest wait, and whom to preempt.

    `free_nodes`: each node's free resources now, as the dispatcher reckons them (Ray's
    available resources less what runs it started have not taken yet); None when the
    cluster is not judged (it autoscales, or cannot be read), and then only slots and
    quotas hold runs back. `releasing`: a run preempted moments ago may still be handing
    back its resources, so no other is preempted yet."""
    usage = usage_by_key(live)
    result = Plan()
    nodes = [dict(n) for n in free_nodes] if free_nodes is not None else None
    live_count = len(live)
    # The first run kept back by the cluster (or by the slots), and what kept it.
    blocker: tuple[Queued, str] | None = None
    for run in queue_order(queued, usage):
        used = usage.setdefault(run.owner, Usage())
        quota = limits.get(run.owner) or KeyLimits()
        if blocker is not None and run.priority < blocker[0].priority:
            first = blocker[0]
            result.reasons[run.id] = (
                f"behind higher priority ({_named(first, seen_by=run.owner)}, priority "
                f"{first.priority}, is {blocker[1]})"
            )
            continue
        if quota.max_running_runs is not None and used.runs >= quota.max_running_runs:
            result.reasons[run.id] = (
                f"waiting for quota ({used.runs} of {quota.max_running_runs} running, "
                "max_running_runs)"
            )
            continue
        if quota.max_gpus is not None and used.gpus + run.ask.gpus > quota.max_gpus:
            result.reasons[run.id] = (
                f"waiting for quota (needs {_gpus(run.ask.gpus)}, {used.gpus} of "
                f"{quota.max_gpus} in use, max_gpus)"
            )
            continue
        if live_count >= policy.max_concurrent_runs:
            why = (
                f"waiting for a free slot ({live_count} of {policy.max_concurrent_runs} runs "
                "live, max_concurrent_runs)"
            )
            result.reasons[run.id] = why
            blocker = blocker or (run, "waiting for a free slot")
            continue
        if nodes is not None:
            placed = place(run.ask, nodes)
            if placed is None:
                why = (
                    f"waiting for cluster resources (needs {shape(run.ask.total)}, "
                    f"{shape(_free_of(nodes, run.ask.per_worker))} free)"
                )
                result.reasons[run.id] = why
                blocker = blocker or (run, "waiting for cluster resources")
                continue
            nodes = placed
        result.start.append(run.id)
        live_count += 1
        used.runs += 1
        used.gpus += run.ask.gpus
    if blocker is not None and policy.preemption and not releasing:
        waiting = blocker[0]
        result.preempt = _preemptions(waiting, live, nodes, policy=policy, now=now)
        victims = {run.id: run for run in live}
        for p in result.preempt:
            victim = _named(victims[p.victim], seen_by=waiting.owner)
            result.reasons[waiting.id] = f"{result.reasons[waiting.id]}; preempting {victim}"
    return result


def _named(run: Queued | Live, *, seen_by: str) -> str:
    """A run as a reason shown to `seen_by`'s key names it: by its id when it is that key's
    own, else only as another key's. Reasons, preemption requests and their events reach
    the runs' owners (the API, webhooks, the dashboard, the job's log): no key learns
    another's run ids from them."""
    return f"run {run.id}" if run.owner == seen_by else "another key's run"


def place(ask: Ask, nodes: Sequence[Mapping[str, float]]) -> list[Resources] | None:
    """The nodes' free resources once the run's workers are placed on them, first fit, a
    tensor-parallel group to a node; None when they do not all fit now."""
    left = [dict(n) for n in nodes]
    group = {name: amount * ask.group for name, amount in ask.per_worker.items()}
    for _ in range(ask.workers // max(ask.group, 1)):
        for node in left:
            if all(node.get(name, 0.0) + EPS >= need for name, need in group.items()):
                for name, need in group.items():
                    node[name] = node.get(name, 0.0) - need
                break
        else:
            return None
    return left


def _preemptions(
    waiting: Queued,
    live: Sequence[Live],
    nodes: Sequence[Mapping[str, float]] | None,
    *,
    policy: Policy,
    now: datetime,
) -> list[Preemption]:
    """Lower-priority preemptible runs to stop so that `waiting` can start: the fewest,
    lowest priority first and, among equals, the youngest (it has the least to reload).
    Never while an earlier preemption is still under way (its resources are on their way
    back), never of an equal or higher priority, never of an attempt younger than the
    minimum run time. Which node a live run holds is not known here, so what its stop frees
    is counted against the cluster's totals, and at least one run is stopped: `waiting` did
    not fit the nodes as they are, even where the totals would hold it (a tensor-parallel
    group wants one node). If it still does not fit once they are gone, the next pass
    preempts again, each victim having run its minimum time."""
    if any(run.preempting for run in live):
        return []
    candidates = sorted(
        (
            run
            for run in live
            if run.preemptible
            and run.priority < waiting.priority
            and run.running_since is not None
            and now - run.running_since >= policy.min_run_time
        ),
        key=lambda r: (r.priority, -(r.running_since.timestamp() if r.running_since else 0.0)),
    )
    need = waiting.ask.total
    free = _free_of(nodes, need) if nodes is not None else {}
    chosen: list[Preemption] = []
    slots_short = len(live) >= policy.max_concurrent_runs
    for run in candidates:
        fits_cluster = nodes is None or all(
            free.get(name, 0.0) + EPS >= amount for name, amount in need.items()
        )
        if chosen and fits_cluster and not slots_short:
            break
        chosen.append(
            Preemption(
                victim=run.id,
                for_run=waiting.id,
                reason=(
                    f"{_named(waiting, seen_by=run.owner)} (priority {waiting.priority}) "
                    "needs its resources"
                ),
            )
        )
        slots_short = False
        for name, amount in run.ask.total.items():
            free[name] = free.get(name, 0.0) + amount
    else:
        fits_cluster = nodes is None or all(
            free.get(name, 0.0) + EPS >= amount for name, amount in need.items()
        )
        if not (fits_cluster and not slots_short):
            return []  # even every candidate would not make room: stop none of them
    return chosen


def _free_of(nodes: Sequence[Mapping[str, float]], names: Iterable[str]) -> Resources:
    return {name: sum(max(n.get(name, 0.0), 0.0) for n in nodes) for name in names}


def _gpus(count: int) -> str:
    return f"{count} GPU{'' if count == 1 else 's'}"
