"""The scheduler's rules (app/services/scheduling.py), pure: no database, no Ray.

Each case builds the queue, the live runs and the cluster's free resources as the
dispatcher would hand them over, and asserts on what a user sees: the order, which runs
start, the reason each other run gives for waiting, and whom the scheduler preempts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import ClassVar

import pytest

from app.services.scheduling import (
    Ask,
    KeyLimits,
    Live,
    Plan,
    Policy,
    Queued,
    Usage,
    place,
    plan,
    queue_order,
    usage_by_key,
)

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
# Old enough for the default minimum run time (10 minutes): preemptible by age.
LONG_AGO = NOW - timedelta(hours=1)


def ask(gpus: int = 0, *, workers: int = 1, cpus: float = 1, group: int = 1) -> Ask:
    """`workers` workers of `cpus` CPUs and `gpus` GPUs each."""
    per_worker = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}
    return Ask(workers=workers, per_worker=per_worker, group=group)


def queued(
    run_id: str, owner: str = "a", *, priority: int = 50, age_s: int = 0, need: Ask | None = None
) -> Queued:
    """A queued run; the larger `age_s`, the longer it has waited."""
    return Queued(
        id=run_id,
        owner=owner,
        priority=priority,
        queued_at=NOW - timedelta(seconds=age_s),
        ask=need or ask(),
    )


def live(
    run_id: str,
    owner: str = "z",
    *,
    priority: int = 10,
    need: Ask | None = None,
    preemptible: bool = True,
    since: datetime | None = LONG_AGO,
    preempting: bool = False,
) -> Live:
    return Live(
        id=run_id,
        owner=owner,
        priority=priority,
        ask=need or ask(),
        preemptible=preemptible,
        running_since=since,
        preempting=preempting,
    )


def decide(
    queue: Sequence[Queued],
    running: Sequence[Live] = (),
    *,
    free: Sequence[Mapping[str, float]] | None = None,
    limits: Mapping[str, KeyLimits] | None = None,
    slots: int = 100,
    preemption: bool = True,
    min_run_time: timedelta = timedelta(minutes=10),
    releasing: bool = False,
) -> Plan:
    return plan(
        queue,
        running,
        limits=limits or {},
        free_nodes=free,
        policy=Policy(max_concurrent_runs=slots, preemption=preemption, min_run_time=min_run_time),
        now=NOW,
        releasing=releasing,
    )


def order(queue: Sequence[Queued], usage: Mapping[str, Usage] | None = None) -> list[str]:
    return [run.id for run in queue_order(queue, usage or {})]


class TestAsk:
    def test_read_from_a_stored_spec(self) -> None:
        spec = {
            "resources": {
                "num_workers": 4,
                "use_gpu": True,
                "gpus_per_worker": 2,
                "cpus_per_worker": 3,
            },
            "deepspeed": {"tensor_parallel_size": 2},
        }
        read = Ask.of_spec(spec)
        assert (read.workers, dict(read.per_worker), read.group) == (
            4,
            {"CPU": 3.0, "GPU": 2.0},
            2,
        )
        assert read.total == {"CPU": 12.0, "GPU": 8.0}
        assert read.gpus == 8

    def test_a_cpu_run_asks_no_gpus(self) -> None:
        read = Ask.of_spec({"resources": {"num_workers": 2, "use_gpu": False}})
        assert read.total == {"CPU": 2.0}
        assert read.gpus == 0

    def test_usage_counts_runs_and_gpus_per_key(self) -> None:
        usage = usage_by_key([live("x", "a", need=ask(2, workers=2)), live("y", "a"), live("z")])
        assert (usage["a"].runs, usage["a"].gpus) == (2, 4)
        assert (usage["z"].runs, usage["z"].gpus) == (1, 0)


class TestQueueOrder:
    def test_higher_priority_first_whatever_the_age(self) -> None:
        queue = [
            queued("old-low", priority=10, age_s=900),
            queued("new-high", priority=90, age_s=1),
            queued("mid", priority=50, age_s=500),
        ]
        assert order(queue) == ["new-high", "mid", "old-low"]

    def test_oldest_first_within_a_key_and_priority(self) -> None:
        queue = [queued("b", age_s=20), queued("c", age_s=10), queued("a", age_s=30)]
        assert order(queue) == ["a", "b", "c"]

    def test_a_tie_in_age_goes_by_id(self) -> None:
        assert order([queued("run-2"), queued("run-1")]) == ["run-1", "run-2"]

    def test_two_keys_interleave_instead_of_the_older_sweep_going_first(self) -> None:
        # Key a queued a sweep of four before key b queued two: each run taken counts
        # for its key at once, so b's runs do not wait for a's whole sweep.
        sweep = [queued(f"a{i}", "a", age_s=100 - i) for i in range(4)]
        mine = [queued(f"b{i}", "b", age_s=10 - i) for i in range(2)]
        assert order(sweep + mine) == ["a0", "b0", "a1", "b1", "a2", "a3"]

    def test_the_key_with_fewer_running_runs_goes_first(self) -> None:
        queue = [queued("a-old", "a", age_s=100), queued("b-new", "b", age_s=1)]
        busy_a = {"a": Usage(runs=2, gpus=0), "b": Usage(runs=1, gpus=0)}
        assert order(queue, busy_a) == ["b-new", "a-old"]

    def test_equal_running_runs_then_the_key_with_fewer_gpus_goes_first(self) -> None:
        queue = [queued("a-old", "a", age_s=100), queued("b-new", "b", age_s=1)]
        assert order(queue, {"a": Usage(1, 4), "b": Usage(1, 1)}) == ["b-new", "a-old"]
        assert order(queue, {"a": Usage(1, 1), "b": Usage(1, 4)}) == ["a-old", "b-new"]

    def test_runs_taken_count_their_gpus_for_fair_share(self) -> None:
        # a's first run takes 4 GPUs, b's first 1: with a run each, b (fewer GPUs) is next.
        queue = [
            queued("a0", "a", age_s=100, need=ask(4)),
            queued("a1", "a", age_s=90),
            queued("b0", "b", age_s=50, need=ask(1)),
            queued("b1", "b", age_s=40),
        ]
        assert order(queue) == ["a0", "b0", "b1", "a1"]

    def test_fair_share_only_within_a_priority(self) -> None:
        queue = [
            queued("a-high", "a", priority=90, age_s=1),
            queued("a-high-2", "a", priority=90, age_s=0),
            queued("b-low", "b", priority=50, age_s=100),
        ]
        assert order(queue, {"a": Usage(5, 10)}) == ["a-high", "a-high-2", "b-low"]


class TestQuotas:
    def test_max_running_runs_keeps_the_run_waiting_with_the_reason(self) -> None:
        decided = decide(
            [queued("q", "a")],
            [live("r1", "a"), live("r2", "a")],
            limits={"a": KeyLimits(max_running_runs=2)},
        )
        assert decided.start == []
        assert decided.reasons == {"q": "waiting for quota (2 of 2 running, max_running_runs)"}

    def test_runs_started_in_the_pass_count_for_max_running_runs(self) -> None:
        queue = [queued(f"q{i}", "a", age_s=10 - i) for i in range(3)]
        decided = decide(queue, [live("r1", "a")], limits={"a": KeyLimits(max_running_runs=2)})
        assert decided.start == ["q0"]
        assert decided.reasons == {
            "q1": "waiting for quota (2 of 2 running, max_running_runs)",
            "q2": "waiting for quota (2 of 2 running, max_running_runs)",
        }

    def test_max_gpus_keeps_the_run_waiting_with_the_reason(self) -> None:
        decided = decide(
            [queued("big", "a", need=ask(4)), queued("one", "a", age_s=-1, need=ask(1))],
            [live("r", "a", need=ask(2))],
            limits={"a": KeyLimits(max_gpus=4)},
        )
        # 2 in use + 4 is over 4, 2 + 1 is not: the small run starts.
        assert decided.start == ["one"]
        assert decided.reasons == {
            "big": "waiting for quota (needs 4 GPUs, 2 of 4 in use, max_gpus)",
        }

    def test_a_quota_blocked_run_keeps_no_one_back(self) -> None:
        decided = decide(
            [
                queued("a-urgent", "a", priority=90, need=ask(1)),
                queued("b-low", "b", priority=10, need=ask(1)),
            ],
            [live("a-running", "a", priority=90, need=ask(1), preemptible=False)],
            free=[{"CPU": 8, "GPU": 2}],
            limits={"a": KeyLimits(max_running_runs=1)},
        )
        assert decided.start == ["b-low"]
        assert decided.reasons == {
            "a-urgent": "waiting for quota (1 of 1 running, max_running_runs)"
        }
        assert decided.preempt == []  # a quota is not the cluster: nothing to make room for

    def test_a_key_without_limits_is_not_limited(self) -> None:
        queue = [queued(f"q{i}", "a", need=ask(8)) for i in range(3)]
        assert len(decide(queue, [live(f"r{i}", "a", need=ask(8)) for i in range(5)]).start) == 3


class TestSlots:
    def test_max_concurrent_runs_is_an_upper_bound(self) -> None:
        decided = decide(
            [queued("q1", age_s=2), queued("q2", age_s=1)],
            [live("r1", preemptible=False)],
            slots=2,
        )
        assert decided.start == ["q1"]
        assert decided.reasons == {
            "q2": "waiting for a free slot (2 of 2 runs live, max_concurrent_runs)"
        }

    def test_lower_priorities_wait_behind_a_run_that_waits_for_a_slot(self) -> None:
        decided = decide(
            [queued("high", priority=90), queued("low", "b", priority=10)],
            [live("r", priority=90, preemptible=False)],
            slots=1,
        )
        assert decided.start == []
        assert decided.reasons["low"] == (
            "behind higher priority (another key's run, priority 90, is waiting for a free slot)"
        )


class TestCluster:
    def test_the_reason_says_what_the_run_needs_and_what_is_free(self) -> None:
        decided = decide([queued("big", need=ask(1, workers=4))], free=[{"CPU": 8, "GPU": 2}])
        assert decided.start == []
        assert decided.reasons == {
            "big": "waiting for cluster resources (needs 4 GPUs + 4 CPUs, 2 GPUs + 8 CPUs free)"
        }

    def test_free_counts_what_earlier_runs_of_the_pass_took(self) -> None:
        decided = decide(
            [queued("first", age_s=2, need=ask(2)), queued("second", age_s=1, need=ask(2))],
            free=[{"CPU": 8, "GPU": 3}],
        )
        assert decided.start == ["first"]
        assert decided.reasons == {
            "second": "waiting for cluster resources (needs 2 GPUs + 1 CPU, 1 GPU + 7 CPUs free)"
        }

    def test_a_cluster_blocked_run_holds_back_lower_priorities_but_not_its_equals(
        self,
    ) -> None:
        decided = decide(
            [
                queued("urgent", "a", priority=90, age_s=30, need=ask(1, workers=4)),
                queued("peer", "b", priority=90, age_s=20, need=ask(1)),
                queued("small", "c", priority=50, age_s=90, need=ask(1)),
                queued("cpu", "c", priority=10, age_s=90),
            ],
            free=[{"CPU": 8, "GPU": 2}],
        )
        # The peer of equal priority fills what the urgent run cannot use; the small and
        # the CPU-only run would fit too, but would take what the urgent run waits for.
        assert decided.start == ["peer"]
        behind = (
            "behind higher priority (another key's run, priority 90, is waiting for cluster "
            "resources)"
        )
        assert decided.reasons == {
            # What was free when its turn came, before the peer took a GPU.
            "urgent": "waiting for cluster resources (needs 4 GPUs + 4 CPUs, 2 GPUs + 8 CPUs free)",
            "small": behind,
            "cpu": behind,
        }

    def test_without_a_reading_of_the_cluster_only_slots_and_quotas_hold_runs(self) -> None:
        decided = decide([queued("huge", need=ask(8, workers=64))], free=None)
        assert decided.start == ["huge"]

    def test_a_cluster_with_no_free_node_starts_nothing(self) -> None:
        decided = decide([queued("cpu")], free=[])
        assert decided.reasons == {
            "cpu": "waiting for cluster resources (needs 1 CPU, 0 CPUs free)"
        }


class TestPlace:
    def test_each_worker_fits_on_one_node(self) -> None:
        # 4 GPUs are free in all, but no node has the 4 one worker asks for.
        two_nodes = [{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}]
        assert place(ask(4), two_nodes) is None
        assert place(ask(2, workers=2), two_nodes) == [
            {"CPU": 7.0, "GPU": 0.0},
            {"CPU": 7.0, "GPU": 0.0},
        ]

    def test_first_fit_leaves_the_rest_of_the_nodes_free(self) -> None:
        left = place(ask(1, workers=2, cpus=2), [{"CPU": 4, "GPU": 4}, {"CPU": 4, "GPU": 4}])
        assert left == [{"CPU": 0.0, "GPU": 2.0}, {"CPU": 4.0, "GPU": 4.0}]

    def test_the_nodes_given_are_not_changed(self) -> None:
        nodes = [{"CPU": 4.0}]
        place(ask(workers=2), nodes)
        assert nodes == [{"CPU": 4.0}]

    def test_a_worker_needs_every_resource_on_the_same_node(self) -> None:
        assert place(ask(1, cpus=4), [{"CPU": 8}, {"CPU": 2, "GPU": 4}]) is None

    @pytest.mark.parametrize(
        ("nodes", "fits"),
        [
            # Two groups of 2 GPUs, each group on one node.
            ([{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}], True),
            ([{"CPU": 8, "GPU": 4}], True),
            # 4 GPUs free in all, but one group would straddle two nodes.
            ([{"CPU": 8, "GPU": 3}, {"CPU": 8, "GPU": 1}], False),
            ([{"CPU": 8, "GPU": 1}] * 4, False),
        ],
    )
    def test_a_tensor_parallel_group_shares_one_node(
        self, nodes: list[dict[str, float]], fits: bool
    ) -> None:
        assert (place(ask(1, workers=4, group=2), nodes) is not None) is fits

    def test_a_tensor_parallel_run_waits_with_the_reason(self) -> None:
        decided = decide(
            [queued("tp", need=ask(1, workers=4, group=2))],
            free=[{"CPU": 8, "GPU": 3}, {"CPU": 8, "GPU": 1}],
        )
        assert decided.reasons == {
            "tp": "waiting for cluster resources (needs 4 GPUs + 4 CPUs, 4 GPUs + 16 CPUs free)"
        }

    def test_fractional_cpus_within_rays_accounting(self) -> None:
        # Ray counts in units of 1e-4: three workers of 1/3 CPU fit one CPU.
        assert place(ask(workers=3, cpus=1 / 3), [{"CPU": 1.0}]) is not None


class TestPreemption:
    """A queued run that cannot be placed stops lower-priority preemptible runs."""

    # A cluster whose GPUs are all taken by the live runs.
    FULL: ClassVar[list[dict[str, float]]] = [{"CPU": 8.0, "GPU": 0.0}]

    def urgent(self, gpus: int = 1, priority: int = 90) -> Queued:
        return queued("urgent", "b", priority=priority, need=ask(gpus))

    def test_the_lowest_priority_then_the_youngest_is_chosen(self) -> None:
        running = [
            live("old-10", priority=10, need=ask(1), since=NOW - timedelta(hours=3)),
            live("young-10", priority=10, need=ask(1), since=NOW - timedelta(hours=1)),
            live("young-20", priority=20, need=ask(1), since=NOW - timedelta(minutes=11)),
        ]
        decided = decide([self.urgent()], running, free=self.FULL)
        assert [(p.victim, p.for_run) for p in decided.preempt] == [("young-10", "urgent")]
        assert decided.preempt[0].reason == "another key's run (priority 90) needs its resources"
        assert decided.reasons["urgent"] == (
            "waiting for cluster resources (needs 1 GPU + 1 CPU, 0 GPUs + 8 CPUs free); "
            "preempting another key's run"
        )

    def test_a_keys_own_runs_are_named_to_it(self) -> None:
        # Another key's run is never named (the case above); a key's own run is.
        running = [live("mine", "b", priority=10, need=ask(1))]
        decided = decide([self.urgent()], running, free=self.FULL)
        assert decided.preempt[0].reason == "run urgent (priority 90) needs its resources"
        assert decided.reasons["urgent"].endswith("; preempting run mine")

    def test_as_many_as_make_room_and_no_more(self) -> None:
        running = [
            live(f"r{i}", priority=10 + i, need=ask(1), since=LONG_AGO - timedelta(minutes=i))
            for i in range(4)
        ]
        decided = decide([self.urgent(gpus=2)], running, free=[{"CPU": 8.0, "GPU": 0.0}])
        assert [p.victim for p in decided.preempt] == ["r0", "r1"]

    def test_what_is_free_already_counts(self) -> None:
        running = [live(f"r{i}", priority=10, need=ask(1)) for i in range(3)]
        decided = decide([self.urgent(gpus=2)], running, free=[{"CPU": 8.0, "GPU": 1.0}])
        assert len(decided.preempt) == 1

    @pytest.mark.parametrize("priority", [90, 95])
    def test_never_a_run_of_equal_or_higher_priority(self, priority: int) -> None:
        decided = decide(
            [self.urgent()], [live("peer", priority=priority, need=ask(1))], free=self.FULL
        )
        assert decided.preempt == []
        assert "preempting" not in decided.reasons["urgent"]

    def test_never_a_run_that_is_not_preemptible(self) -> None:
        running = [
            live("keep", priority=1, need=ask(1), preemptible=False),
            live("ok", priority=40, need=ask(1)),
        ]
        decided = decide([self.urgent()], running, free=self.FULL)
        assert [p.victim for p in decided.preempt] == ["ok"]

    def test_never_before_the_minimum_run_time(self) -> None:
        running = [
            live("fresh", priority=10, need=ask(1), since=NOW - timedelta(minutes=9)),
            live("starting", priority=10, need=ask(1), since=None),
        ]
        assert decide([self.urgent()], running, free=self.FULL).preempt == []
        # Once it has run its minimum time, it may be preempted.
        later = decide([self.urgent()], running, free=self.FULL, min_run_time=timedelta(minutes=9))
        assert [p.victim for p in later.preempt] == ["fresh"]

    def test_none_while_another_preemption_is_under_way(self) -> None:
        running = [
            live("stopping", priority=10, need=ask(1), preempting=True),
            live("next", priority=10, need=ask(1)),
        ]
        decided = decide([self.urgent(gpus=2)], running, free=self.FULL)
        assert decided.preempt == []

    def test_none_while_a_run_preempted_moments_ago_may_still_be_releasing(self) -> None:
        # The victim is back in the queue, but Ray's report may not show its room yet: a
        # second victim would be stopped for room that is on its way.
        running = [live("next", priority=10, need=ask(1))]
        assert decide([self.urgent()], running, free=self.FULL).preempt != []
        assert decide([self.urgent()], running, free=self.FULL, releasing=True).preempt == []

    def test_one_is_stopped_when_the_totals_hold_the_run_but_no_node_does(self) -> None:
        # 2 GPUs free in all, one on each node: a tensor-parallel pair fits neither. The
        # totals alone would say no preemption is needed, and the run would wait for good.
        running = [live(f"r{i}", priority=10, need=ask(1), since=LONG_AGO) for i in range(2)]
        pair = queued("tp", "b", priority=90, need=ask(1, workers=2, group=2))
        decided = decide([pair], running, free=[{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}])
        assert len(decided.preempt) == 1

    def test_none_if_every_candidate_together_would_not_make_room(self) -> None:
        running = [live(f"r{i}", priority=10, need=ask(1)) for i in range(3)]
        decided = decide([self.urgent(gpus=8)], running, free=self.FULL)
        assert decided.preempt == []
        assert decided.reasons["urgent"] == (
            "waiting for cluster resources (needs 8 GPUs + 1 CPU, 0 GPUs + 8 CPUs free)"
        )

    def test_a_free_slot_is_made_for_a_higher_priority_run(self) -> None:
        running = [live("low", priority=10), live("high", priority=90, preemptible=False)]
        decided = decide([self.urgent()], running, free=None, slots=2)
        assert [p.victim for p in decided.preempt] == ["low"]
        assert decided.reasons["urgent"] == (
            "waiting for a free slot (2 of 2 runs live, max_concurrent_runs); preempting "
            "another key's run"
        )

    def test_not_when_preemption_is_off(self) -> None:
        decided = decide(
            [self.urgent()], [live("low", need=ask(1))], free=self.FULL, preemption=False
        )
        assert decided.preempt == []

    def test_only_for_the_first_run_that_waits_for_the_cluster(self) -> None:
        # The highest run that waits is the one preempted for; the next pass, with that
        # preemption under way, preempts nothing more for the run behind it.
        queue = [
            queued("top", "b", priority=90, need=ask(1)),
            queued("second", "b", priority=80, need=ask(1)),
        ]
        running = [
            live("r-old", priority=10, need=ask(1), since=LONG_AGO),
            live("r-young", priority=10, need=ask(1), since=LONG_AGO + timedelta(minutes=1)),
        ]
        decided = decide(queue, running, free=self.FULL)
        assert [(p.victim, p.for_run) for p in decided.preempt] == [("r-young", "top")]
        assert decided.reasons["second"].startswith("behind higher priority (run top,")

        stopping = [running[0], live("r-young", priority=10, need=ask(1), preempting=True)]
        assert decide(queue, stopping, free=self.FULL).preempt == []
