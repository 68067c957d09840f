"""Reading each node's free resources from the usage lines Ray's dashboard sends.

The lines are what Ray itself writes: literal examples as `ray status -v` prints them, and
lines made by the installed Ray's own `parse_usage` from a node's raw usage, so that a Ray
upgrade that changes the format fails here rather than holding every run in the queue.
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from app.cluster.ray_jobs import RayJobs, RayUnavailable
from app.cluster.usage import free, free_by_node

PG = "4b2d0a7c56e1f3e8a9b0c1d2e3f40100"
OTHER_PG = "9e8d7c6b5a4f3e2d1c0b0a0908070100"


def rays_lines(usage: dict[str, tuple[float, float]]) -> str:
    """A node's usage lines as the dashboard's node summary carries them."""
    from ray.autoscaler._private.util import parse_usage

    # Ray types the amounts as numbers.Number, which mypy does not take a float for.
    return "\n".join(parse_usage(cast(Any, usage), verbose=True))


class TestFree:
    def test_placement_group_and_gpu_lines_as_ray_prints_them(self) -> None:
        text = (
            "0.0/3.0 CPU (0.0 used of 2.0 reserved in placement groups)\n"
            "0B/15.56GiB memory\n"
            "1.0/2.0 GPU (1.0 used of 1.0 reserved in placement groups)"
        )
        # 2 CPUs are reserved by a placement group (nothing runs in it yet): 1 is free.
        # The GPU reserved is the one in use: 1 of 2 is free. Memory is not counted.
        assert free(text) == {"CPU": 1.0, "GPU": 1.0}

    def test_lines_without_placement_groups(self) -> None:
        assert free("1.0/8.0 CPU\n2.0/2.0 GPU") == {"CPU": 7.0, "GPU": 0.0}

    def test_work_inside_a_placement_group_is_not_counted_twice(self) -> None:
        # 3 CPUs taken in all: 1 by a task outside, 2 reserved by the group (1.5 in use).
        assert free("2.5/8.0 CPU (1.5 used of 2.0 reserved in placement groups)") == {"CPU": 5.0}

    def test_memory_lines_and_unknown_lines_are_skipped(self) -> None:
        text = (
            "0B/15.56GiB memory (0B used of 1.00GiB reserved in placement groups)\n"
            "44.00MiB/7.45GiB object_store_memory\n"
            "Usage:\n"
            " 4.0/4.0 CPU\n"
        )
        assert free(text) == {"CPU": 0.0}

    def test_custom_and_accelerator_resources_are_kept(self) -> None:
        text = "0.0/1.0 accelerator_type:A100\n0.0/4.0 TPU\n1.0/1.0 special_disk"
        assert free(text) == {"accelerator_type:A100": 1.0, "TPU": 4.0, "special_disk": 0.0}

    def test_never_below_zero(self) -> None:
        assert free("5.0/4.0 CPU") == {"CPU": 0.0}


class TestRaysOwnLines:
    """The round trip through the installed Ray's `parse_usage` (what the monitor runs)."""

    def test_a_node_with_a_placement_group_and_a_gpu_in_use(self) -> None:
        usage = {
            # The node's totals count the group's reservation as used.
            "CPU": (2.0, 3.0),
            "GPU": (1.0, 2.0),
            "memory": (0.0, 16.7e9),
            "object_store_memory": (1e9, 8e9),
            f"CPU_group_{PG}": (0.0, 2.0),
            f"CPU_group_0_{PG}": (0.0, 1.0),
            f"CPU_group_1_{PG}": (0.0, 1.0),
            f"GPU_group_{PG}": (1.0, 1.0),
            f"GPU_group_0_{PG}": (1.0, 1.0),
            "node:10.0.0.1": (0.0, 1.0),
            "node:__internal_head__": (0.0, 1.0),
        }
        text = rays_lines(usage)
        assert "reserved in placement groups" in text  # the format this parser reads
        assert free(text) == {"CPU": 1.0, "GPU": 1.0}

    def test_an_idle_node(self) -> None:
        usage = {"CPU": (0.0, 16.0), "GPU": (0.0, 4.0), "memory": (0.0, 6.4e10)}
        assert free(rays_lines(usage)) == {"CPU": 16.0, "GPU": 4.0}

    def test_fractional_reservations_that_ray_sums_inexactly(self) -> None:
        # Two groups of 0.1 and 0.2 CPUs: Ray prints the node's use as 0.3 - (0.1 + 0.2),
        # "-5.551115123125783e-17". Unread, the node would look as if it had no CPU at all.
        usage = {
            "CPU": (0.3, 3.0),
            f"CPU_group_{PG}": (0.0, 0.1),
            f"CPU_group_{OTHER_PG}": (0.0, 0.2),
        }
        text = rays_lines(usage)
        assert "e-17/3.0 CPU" in text
        assert free(text) == {"CPU": pytest.approx(2.7)}


class TestFreeByNode:
    def test_each_node_from_the_dashboards_summary(self) -> None:
        summary = {
            "summary": [],
            "nodeLogicalResources": {
                "node-b": "0.0/4.0 CPU\n2.0/2.0 GPU",
                "node-a": "1.0/8.0 CPU (1.0 used of 1.0 reserved in placement groups)",
            },
        }
        assert free_by_node(summary) == [{"CPU": 7.0}, {"CPU": 4.0, "GPU": 0.0}]

    @pytest.mark.parametrize("summary", [{}, {"nodeLogicalResources": {}}])
    def test_no_usage_reported_is_not_known_rather_than_a_full_cluster(
        self, summary: dict[str, Any]
    ) -> None:
        # The dashboard sends no usage until the monitor reports, and none while the
        # autoscaler reports an error: read as "no free resources" it would hold every run.
        with pytest.raises(ValueError, match="no node's usage"):
            free_by_node(summary)

    def test_the_ray_client_reports_it_as_ray_unavailable(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The dispatcher then judges slots and quotas only (app/services/dispatch.py)."""

        class Answer:
            def raise_for_status(self) -> None:
                pass

            def json(self) -> dict[str, Any]:
                return {"data": {"summary": [], "nodeLogicalResources": {}}}

        class Client:
            def _do_request(self, method: str, path: str, **_: Any) -> Answer:
                assert (method, path) == ("GET", "/nodes?view=summary")
                return Answer()

        jobs = RayJobs("http://ray.invalid:8265")
        monkeypatch.setattr(jobs, "_get_client", Client)
        with pytest.raises(RayUnavailable, match="no node's usage"):
            jobs.free_resources()
