"""worker/profile.py's summary of every rank's measurements."""

from __future__ import annotations

import pytest

from worker.profile import ProfileOptions, summarize

OPTIONS = ProfileOptions(steps=4, warmup_steps=2, result="/storage/profiles/p.json")


def _rank(rank: int, times: list[float], tokens: int) -> dict[str, object]:
    return {
        "rank": rank,
        "node_id": "n",
        "step_times": times,
        "tokens": tokens,
        "samples": 8,
        "peak_device_memory_bytes": None,
        "peak_host_memory_bytes": 600 << 20,
    }


def test_a_step_lasts_as_long_as_its_slowest_rank() -> None:
    ranks = [_rank(1, [0.2, 0.5], 300), _rank(0, [0.4, 0.3], 500)]
    summary = summarize(ranks, tensor_parallel_size=1, startup_seconds=12.0, options=OPTIONS)
    assert summary["step_times_seconds"] == [0.4, 0.5]
    assert summary["step_time_seconds"] == pytest.approx(0.45)
    assert summary["tokens_per_second"] == pytest.approx(800 / 0.9)
    assert summary["samples_per_second"] == pytest.approx(16 / 0.9)
    assert summary["steps_measured"] == 2
    assert [w["rank"] for w in summary["workers"]] == [0, 1]


def test_tensor_parallel_ranks_share_a_batch_and_count_it_once() -> None:
    ranks = [_rank(0, [1.0], 500), _rank(1, [1.0], 500)]
    summary = summarize(ranks, tensor_parallel_size=2, startup_seconds=1.0, options=OPTIONS)
    assert summary["tokens_per_second"] == 500
    assert summary["samples_per_second"] == 8
