"""One real fine-tuning run through the whole stack: HTTP → SQLite → Ray job → Ray Train
workers → DeepSpeed ZeRO-2 → callbacks → what a client reads back."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import torch

from app.cli.tiny_assets import write_jsonl_dataset
from contract.callbacks import StartupPhase
from tests.e2e.conftest import Service

pytestmark = pytest.mark.e2e

STEPS = 12


def _zero2_request(model: Path, data: Path, **training: object) -> dict[str, object]:
    return {
        "model": str(model),
        "dataset": {"source": str(data), "text_field": "text"},
        "training": {
            "max_steps": STEPS,
            "learning_rate": 3e-3,
            "batch_size_per_worker": 8,
            "seq_length": 64,
            **training,
        },
        "deepspeed": {"zero_stage": 2},
        "resources": {"num_workers": 2},
        "checkpointing": {"every_n_steps": 6, "export_hf": True},
        "fault_tolerance": {"max_failures": 0},
        "metadata": {"test": "walking-skeleton"},
    }


def test_zero2_run_trains_reports_and_checkpoints(service: Service, tiny_model_dir: Path) -> None:
    data = write_jsonl_dataset(service.data_dir / "news.jsonl", rows=800)
    spec = service.data_dir / "zero2.json"
    spec.write_text(json.dumps(_zero2_request(tiny_model_dir, data)))
    submitted = service.cli("submit", str(spec), "--json")
    assert submitted.returncode == 0, submitted.stderr
    run = json.loads(submitted.stdout)
    assert run["status"] == "queued"

    # `tuneyard watch` follows it to the end and exits 0 because it succeeded.
    watched = service.cli("watch", run["id"], "--interval", "0.5")
    run = service.http.get(f"/v1/runs/{run['id']}").json()
    assert run["status"] == "succeeded", (run["error"], service.log_path.read_text()[-3000:])
    assert watched.returncode == 0, watched.stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in watched.stderr
    assert "succeeded" in watched.stdout
    assert run["started_at"] and run["finished_at"]
    assert run["progress"]["step"] == STEPS
    assert run["progress"]["total_steps"] == STEPS
    assert run["ray_submission_id"] == f"{run['id']}-1"

    # A loss for every logged step, and the loss fell.
    metrics = service.http.get(f"/v1/runs/{run['id']}/metrics", params={"name": "loss"}).json()
    losses = {m["step"]: m["value"] for m in metrics["data"]}
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = losses[1], sum(losses[s] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert last < first - 0.3, losses
    latest = run["latest_metrics"]
    for name in ("loss", "learning_rate", "tokens_per_second", "samples_per_second", "epoch"):
        assert name in latest, latest
    assert latest["tokens_per_second"] > 0

    # Where its start went: each phase once, in order, from the submit to the first step's
    # end (worker/reporting/startup.py), inside the time from creation to the end.
    events = service.http.get(f"/v1/runs/{run['id']}/events").json()["data"]
    phases = [e for e in events if e["type"] == "startup_phase"]
    assert [e["phase"] for e in phases] == [p.value for p in StartupPhase], phases
    assert all(e["duration_seconds"] >= 0 and e["attempt"] == 1 for e in phases)
    assert all(e["message"].startswith(f"{e['phase']}: ") for e in phases)
    took = datetime.fromisoformat(run["finished_at"]) - datetime.fromisoformat(run["created_at"])
    assert 0 < sum(e["duration_seconds"] for e in phases) < took.total_seconds()

    # DeepSpeed checkpoints at step 6 and at the end, on disk, with every rank's shards.
    checkpoints = service.http.get(f"/v1/runs/{run['id']}/checkpoints").json()["data"]
    deepspeed = [c for c in checkpoints if c["kind"] == "deepspeed"]
    assert [c["step"] for c in deepspeed] == [6, STEPS]
    final = Path(deepspeed[-1]["path"])
    assert final.is_dir()
    assert (final / "latest").read_text().strip() == f"step_{STEPS}"
    shards = {p.name for p in (final / f"step_{STEPS}").iterdir()}
    assert "mp_rank_00_model_states.pt" in shards
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= shards
    assert json.loads((final / "tuneyard_checkpoint.json").read_text())["zero_stage"] == 2
    assert run["output"]["latest_checkpoint"] == str(final)

    # The exported model loads with from_pretrained and holds the trained weights.
    from transformers import AutoModelForCausalLM

    (hf,) = [c for c in checkpoints if c["kind"] == "hf"]
    assert run["output"]["model_path"] == hf["path"]
    exported = AutoModelForCausalLM.from_pretrained(hf["path"])
    trained = torch.load(
        final / f"step_{STEPS}" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )["module"]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    state = exported.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    assert not torch.equal(
        state["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"]
    )

    # What operators see: Prometheus counts, and the run id on the service's log lines.
    scrape = httpx.get(f"{service.base_url}/metrics", timeout=60).text
    assert re.search(r'^tuneyard_runs\{status="succeeded"\} [1-9]', scrape, re.M), scrape
    assert re.search(r"^tuneyard_dispatch_latency_seconds_count [1-9]", scrape, re.M)
    assert re.search(r'^tuneyard_callbacks_total\{kind="metrics"\} [1-9]', scrape, re.M)
    assert f"run_id={run['id']}" in service.log_path.read_text()


def test_a_dataset_without_the_text_field_is_refused_naming_the_field(
    service: Service, tiny_model_dir: Path
) -> None:
    """Before any compute: a local file's records are read at create (a hub dataset's
    fields are the worker's to find: tests/worker/data/test_examples.py)."""
    data = write_jsonl_dataset(service.data_dir / "wrong-field.jsonl", rows=50, field="body")
    runs_before = service.http.get("/v1/runs", params={"limit": 100}).json()["data"]
    response = service.http.post(
        "/v1/runs",
        json=_zero2_request(tiny_model_dir, data) | {"resources": {"num_workers": 1}},
    )
    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["field"] == "dataset.source"
    assert "no field 'text' (dataset.text_field names it)" in problem["message"]
    assert "['body']" in problem["message"]  # the fields it does have
    assert service.http.get("/v1/runs", params={"limit": 100}).json()["data"] == runs_before


def test_a_model_that_cannot_be_loaded_fails_naming_it(
    service: Service, tiny_model_dir: Path
) -> None:
    data = write_jsonl_dataset(service.data_dir / "news-small.jsonl", rows=50)
    body = _zero2_request(tiny_model_dir, data)
    body["model"] = "no-such-org/no-such-model"
    body["resources"] = {"num_workers": 1}  # every rank loads the model itself
    run = service.wait_terminal(service.submit(body)["id"])

    assert run["status"] == "failed"
    assert "cannot load model 'no-such-org/no-such-model'" in run["error"]["message"]
    assert run["finished_at"] is not None
