"""`tuneyard validate --profile`: a few real ZeRO-2 steps on the real Ray cluster, measured
and reported beside the static estimate, with nothing left behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from app.cli.tiny_assets import write_jsonl_dataset
from tests.e2e.conftest import Service
from tests.e2e.test_lifecycle import ray_jobs_client

pytestmark = pytest.mark.e2e

MAX_STEPS = 40
WORKERS = 2
BATCH = 8
SEQ_LENGTH = 64
MIB = 1 << 20


def test_profile_measures_real_steps_and_leaves_the_cluster_as_it_was(
    service: Service, tiny_model_dir: Path
) -> None:
    data = write_jsonl_dataset(service.data_dir / "profile.jsonl", rows=400)
    spec = service.data_dir / "profile.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(tiny_model_dir),
                "dataset": {"source": str(data), "text_field": "text"},
                "training": {
                    "max_steps": MAX_STEPS,
                    "batch_size_per_worker": BATCH,
                    "seq_length": SEQ_LENGTH,
                },
                "deepspeed": {"zero_stage": 2},
                "resources": {"num_workers": WORKERS},
            }
        )
    )
    runs_before = service.http.get("/v1/runs", params={"limit": 100}).json()["data"]

    started = time.monotonic()
    validated = service.cli("validate", str(spec), "--profile", "--json", timeout_s=300)
    took = time.monotonic() - started
    assert validated.returncode == 0, (validated.stdout, validated.stderr[-3000:])
    report = json.loads(validated.stdout)
    assert report["valid"] is True
    profile = report["profile"]
    assert profile["error"] is None, (profile["error"], service.log_path.read_text()[-3000:])

    # The default: 4 steps, the first 2 warm-up.
    assert (profile["steps"], profile["warmup_steps"], profile["steps_measured"]) == (4, 2, 2)
    step_time = profile["step_time_seconds"]
    assert 0 < step_time < took
    # Every measured step trained the global batch: samples/s is that batch per step time,
    # and tokens/s at most its padded tokens per step time.
    global_batch = WORKERS * BATCH
    assert profile["samples_per_second"] == pytest.approx(global_batch / step_time, rel=1e-6)
    assert 0 < profile["tokens_per_second"] <= global_batch * SEQ_LENGTH / step_time
    assert report["estimate"]["tokens_per_step"] == global_batch * SEQ_LENGTH

    workers = profile["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    for worker in workers:
        assert worker["node_id"]
        assert worker["peak_device_memory_bytes"] is None  # CPU: no device memory
        # A rank's process holds torch, DeepSpeed and Ray (about 600 MiB, BENCHMARKS.md).
        assert 100 * MIB < worker["peak_host_memory_bytes"] < 16 * 1024 * MIB

    # The whole run: its measured start-up, then every step at the measured pace.
    assert report["resolved"]["total_steps"] == profile["total_steps"] == MAX_STEPS
    assert 0 < profile["startup_seconds"] < took
    assert profile["estimated_total_seconds"] == pytest.approx(
        profile["startup_seconds"] + step_time * MAX_STEPS, rel=1e-9
    )
    # No price is configured for this service: no cost. A CPU run holds no GPU.
    assert profile["gpus"] == 0
    assert profile["estimated_cost"] is None and profile["currency"] is None

    # Nothing stored, nothing left on the cluster or in storage.
    assert service.http.get("/v1/runs", params={"limit": 100}).json()["data"] == runs_before
    jobs = ray_jobs_client(service).list_jobs()
    assert not [j for j in jobs if (j.submission_id or "").startswith("profile-")]
    storage = service.home / "storage"
    assert not list(storage.glob("profiles/*"))  # the result the job wrote
    assert not list(storage.glob("profile-*"))  # Ray Train's folder for the profile's name
