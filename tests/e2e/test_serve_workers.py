"""`tuneyard serve --workers 2`: several HTTP processes share one embedded Ray head, every
one of them answers and dispatches, and a clean stop takes the head down with them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from app.cli.tiny_assets import write_jsonl_dataset
from tests.e2e.conftest import make_service

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]


def test_two_http_workers_share_the_head_and_dispatch(
    tmp_path: Path, tiny_models_root: Path, tiny_model_dir: Path
) -> None:
    service = make_service(tmp_path / "home", tmp_path / "data", [tiny_models_root])
    (tmp_path / "data").mkdir()
    service.env["TUNEYARD_WORKERS"] = "2"
    try:
        service.start()
        assert service.proc is not None
        parent = psutil.Process(service.proc.pid)
        workers = [c for c in parent.children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 2
        head = json.loads((service.home / "ray" / "head.json").read_text())
        assert psutil.pid_exists(head["pid"])

        data = write_jsonl_dataset(service.data_dir / "news.jsonl", rows=200)
        body = {
            "model": str(tiny_model_dir),
            "dataset": {"source": str(data), "text_field": "text"},
            "training": {"max_steps": 3, "batch_size_per_worker": 4, "seq_length": 32},
            "deepspeed": {"zero_stage": 1},
            "resources": {"num_workers": 2},
            "checkpointing": {"export_hf": False},
        }
        run = service.wait_terminal(service.submit(body)["id"])
        assert run["status"] == "succeeded", (run["error"], service.log_path.read_text()[-3000:])
        assert run["ray_submission_id"] == f"{run['id']}-1"  # one job, though two dispatchers
        # Both processes answer on the one port (the kernel spreads the connections).
        for _ in range(20):
            assert service.http.get(f"/v1/runs/{run['id']}").json()["status"] == "succeeded"
    finally:
        service.http.close()
        service.stop()
    assert service.proc is not None and service.proc.returncode is not None
    assert not psutil.pid_exists(head["pid"]) or psutil.Process(head["pid"]).status() == "zombie"
    assert not (service.home / "ray" / "head.json").exists()
    assert all(not psutil.pid_exists(w.pid) for w in workers), os.getpid()
