"""worker/training/loop.py's cpu_threads: the threads each rank's torch and OpenMP use."""

from __future__ import annotations

from typing import Any

import pytest

from contract.run_request import RunSpec
from worker.training.loop import cpu_threads


def spec(**resources: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "run_id": "run_t",
            "attempt": 1,
            "storage_path": "/s",
            "model": "/m",
            "dataset": {"source": "/d.jsonl"},
            "resources": resources,
        }
    )


@pytest.mark.parametrize(
    ("resources", "node_cpus", "local_ranks", "threads"),
    [
        ({}, 64, 2, 1),  # a CPU run: its own CPUs, as Ray sets OMP_NUM_THREADS
        ({"cpus_per_worker": 4}, 64, 2, 4),
        ({"use_gpu": True}, 64, 8, 8),  # 8 GPUs share 64 cores: not 1 thread each
        ({"use_gpu": True, "cpus_per_worker": 16}, 64, 8, 16),  # never below its CPUs
        ({"use_gpu": True}, 4, 8, 1),
        ({"use_gpu": True, "cpu_threads_per_worker": 3}, 64, 8, 3),  # the setting wins
        ({"cpu_threads_per_worker": 6}, 64, 2, 6),
    ],
)
def test_threads(resources: dict[str, Any], node_cpus: int, local_ranks: int, threads: int) -> None:
    found = cpu_threads(spec(**resources), node_cpus=node_cpus, local_world_size=local_ranks)
    assert found == threads
