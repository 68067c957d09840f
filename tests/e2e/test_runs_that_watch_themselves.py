"""A run that watches itself, end to end on real Ray and DeepSpeed: it stops early, keeps
and marks its best checkpoint, exports the best weights rather than the last, and tells a
webhook receiver on loopback what happened, signed. A grpo run does the same by its
`eval_reward`, across a cancel and a resume. (The export of the best checkpoint under
AutoTP is proven by tests/e2e/test_training_modes.py's AutoTP run at ZeRO-1.)"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cli.tiny_assets import write_jsonl_dataset
from tests.app.test_webhooks import Receiver, receiving
from tests.e2e.conftest import Service
from tests.e2e.helpers import (
    assert_succeeded,
    checkpoints,
    metric_series,
    prompt_records,
    run_events,
    small_grpo_request,
    write_jsonl,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def hooks() -> Iterator[Receiver]:
    with receiving() as receiver:
        # Its first answer fails: the service retries, with the same idempotency key.
        receiver.script = [503]
        yield receiver


@pytest.fixture(scope="module")
def watched_run(service: Service, tiny_model_dir: Path, hooks: Receiver) -> dict[str, Any]:
    data = write_jsonl_dataset(service.data_dir / "watched.jsonl", rows=160, seed=11)
    body = {
        "model": str(tiny_model_dir),
        "dataset": {"source": str(data), "split": "train[:90%]", "eval_split": "train[90%:]"},
        "training": {
            "max_steps": 20,
            "learning_rate": 1e-3,
            "batch_size_per_worker": 4,
            "seq_length": 32,
            "eval_every_n_steps": 1,
        },
        # ZeRO-3: the best checkpoint's partitions are loaded back before the export.
        "deepspeed": {"zero_stage": 3},
        "resources": {"num_workers": 2},
        # No evaluation can beat the first by more than min_delta: the run stops at its
        # third evaluation, whatever the losses are.
        "early_stopping": {"metric": "eval_loss", "patience": 2, "min_delta": 1000},
        # Ranked by the largest loss, the best is an early step (the loss falls from a
        # random start), so an export of the best is told apart from the last weights.
        "checkpointing": {"keep_last": 1, "best_metric": "eval_loss", "best_mode": "max"},
        "export": {"from": "best"},
        "tracking": {"mlflow": {"experiment": "e2e"}, "wandb": {"mode": "offline"}},
        "webhooks": [
            {"url": hooks.url, "events": ["run.succeeded", "run.checkpoint", "run.early_stopped"]}
        ],
    }
    run = service.wait_terminal(service.submit(body)["id"])
    assert_succeeded(service, run)
    return run


def test_stops_early_with_the_reason(service: Service, watched_run: dict[str, Any]) -> None:
    assert watched_run["progress"]["step"] == 3
    assert watched_run["result"]["stop_reason"] == "early_stopping"
    assert "step 3" in watched_run["result"]["stop_message"]
    events = service.http.get(f"/v1/runs/{watched_run['id']}/events").json()["data"]
    stops = [e for e in events if e["type"] == "early_stopped"]
    assert len(stops) == 1 and "eval_loss did not improve" in stops[0]["message"]


def test_best_checkpoint_is_marked_and_kept(service: Service, watched_run: dict[str, Any]) -> None:
    run_id = watched_run["id"]
    losses = metric_series(service, run_id, "eval_loss")
    assert sorted(losses) == [1, 2, 3]
    best = max(sorted(losses), key=lambda step: (losses[step], step))
    assert best != 3, "the best must not be the last step for this test to tell them apart"
    result = watched_run["result"]
    assert (result["best_step"], result["best_value"]) == (best, losses[best])

    listed = checkpoints(service, run_id, "deepspeed")
    assert [c["step"] for c in listed] == [1, 2, 3]
    assert [c["step"] for c in listed if c["best"]] == [best]
    # keep_last 1: Ray Train kept the best and the latest, and deleted the other; the
    # flags say what storage holds.
    on_disk = {p.name for p in (service.home / "storage" / run_id).glob("checkpoint_step_*")}
    for c in listed:
        assert (Path(c["path"]).name in on_disk) == (not c["pruned"]), (c, on_disk)
    assert {c["step"] for c in listed if not c["pruned"]} == {best, 3}


def test_export_holds_the_best_weights(service: Service, watched_run: dict[str, Any]) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    run_id = watched_run["id"]
    best = watched_run["result"]["best_step"]
    (export,) = checkpoints(service, run_id, "hf")
    assert export["step"] == best
    exported = load_file(Path(watched_run["output"]["model_path"]) / "model.safetensors")
    folder = service.home / "storage" / run_id

    def weights_at(step: int) -> dict[str, torch.Tensor]:
        return get_fp32_state_dict_from_zero_checkpoint(folder / f"checkpoint_step_{step:08d}")

    at_best, at_last = weights_at(best), weights_at(3)
    shared = sorted(set(exported) & set(at_best))
    assert len(shared) > 10
    # fp32 on CPU: the export is the best checkpoint's weights exactly, not the last ones.
    for name in shared:
        assert torch.equal(exported[name], at_best[name]), name
    assert any(not torch.equal(exported[n], at_last[n]) for n in shared)


def test_webhooks_arrive_signed_once_each(
    service: Service, watched_run: dict[str, Any], hooks: Receiver
) -> None:
    run_id = watched_run["id"]
    deadline = time.monotonic() + 60
    while True:
        listed = service.http.get(f"/v1/runs/{run_id}/webhooks").json()["data"]
        if listed and all(d["status"] == "delivered" for d in listed):
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.5)
    # Three DeepSpeed checkpoints and the export, the early stop, then success.
    assert sorted(d["event"] for d in listed) == sorted(
        ["run.checkpoint"] * 4 + ["run.early_stopped", "run.succeeded"]
    )
    # Signed with the secret of the key that made the run.
    secret = service.webhook_secret.encode()
    delivered = {}
    for received in hooks.received:
        fields = dict(
            part.split("=", 1) for part in received.headers["tuneyard-signature"].split(",")
        )
        expected = hmac.new(secret, f"{fields['t']}.".encode() + received.body, hashlib.sha256)
        assert hmac.compare_digest(fields["v1"], expected.hexdigest())
        if received.answered == 200:
            assert received.key not in delivered, "an event delivered twice"
            delivered[received.key] = received.payload
    assert set(delivered) == {d["id"] for d in listed}
    # The first answer failed and was retried under the same key.
    assert hooks.received[0].answered == 503 and hooks.received[0].key in delivered
    done = next(p for p in delivered.values() if p["type"] == "run.succeeded")
    assert done["data"]["run"]["result"]["stop_reason"] == "early_stopping"
    stop = next(p for p in delivered.values() if p["type"] == "run.early_stopped")
    assert "step 3" in stop["data"]["message"]


def test_tracked_to_mlflow_and_wandb(service: Service, watched_run: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    from tests.worker.reporting.test_tracking import _wandb_run, wandb_records

    run_id = watched_run["id"]
    client = MlflowClient(tracking_uri=service.env["TUNEYARD_MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("e2e")
    (tracked,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`tuneyard.run_id` = '{run_id}'"
    )
    assert tracked.info.status == "FINISHED"
    assert tracked.data.params["training.learning_rate"] == "0.001"
    assert tracked.data.params["early_stopping.patience"] == "2"
    history = client.get_metric_history(tracked.info.run_id, "eval_loss")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert tracked.data.tags["tuneyard.model_path"] == watched_run["output"]["model_path"]

    (log,) = (service.home / "wandb").rglob(f"run-{run_id}.wandb")
    logged = _wandb_run(list(wandb_records(log)))
    assert logged["id"] == run_id and logged["exit_code"] == 0
    assert {step for step, row in logged["history"].items() if "eval_loss" in row} == {1, 2, 3}


GRPO_STEPS = 6


@pytest.fixture(scope="module")
def grpo_resumed(service: Service, tiny_models_root: Path) -> dict[str, Any]:
    """A grpo run that evaluates and checkpoints every 2 steps and keeps its best by
    eval_reward (the default metric of a run with a grader, and mode max), cancelled after
    step 3 (its checkpoint at 2 recorded), then resumed to its end."""
    data = write_jsonl(service.data_dir / "grpo-watched.jsonl", prompt_records(24, seed=5))
    body = {
        **small_grpo_request(tiny_models_root, data),
        "training": {"max_steps": GRPO_STEPS, "eval_every_n_steps": 2},
        "resources": {"num_workers": 2},
        "checkpointing": {"every_n_steps": 2, "keep_last": 1},
        "export": {"from": "best"},
    }
    run_id = service.submit(body)["id"]
    service.wait_held(service.hold_at(run_id, 3), run_id, checkpoint=2)
    assert service.http.post(f"/v1/runs/{run_id}/cancel").status_code == 200
    assert service.wait_terminal(run_id, timeout_s=120)["status"] == "cancelled"
    resumed = service.http.post(f"/v1/runs/{run_id}/resume")
    assert resumed.status_code == 200, resumed.text
    run = service.wait_terminal(run_id)
    assert_succeeded(service, run)
    return run


def test_a_resumed_grpo_run_continues_from_its_checkpoint(
    service: Service, grpo_resumed: dict[str, Any]
) -> None:
    run_id = grpo_resumed["id"]
    assert grpo_resumed["attempt"] == 2
    resumed = [e for e in run_events(service, run_id) if e["type"] == "resumed"]
    assert len(resumed) == 1 and "step 2" in resumed[0]["message"], resumed
    page = service.http.get(
        f"/v1/runs/{run_id}/metrics", params={"name": "reward", "limit": 1000}
    ).json()["data"]
    steps = {n: sorted(m["step"] for m in page if m["attempt"] == n) for n in (1, 2)}
    # Attempt 1 held after step 3 (whose metrics may still have been on their way when the
    # cancel stopped it); attempt 2 restarted after the checkpoint at 2.
    assert steps[1] in ([1, 2], [1, 2, 3]) and steps[2] == [3, 4, 5, 6], steps
    assert all(0.0 <= m["value"] <= 1.0 for m in page), page


def test_a_grpo_run_keeps_and_exports_its_best_by_eval_reward(
    service: Service, grpo_resumed: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM

    run_id = grpo_resumed["id"]
    rewards = metric_series(service, run_id, "eval_reward")
    assert sorted(rewards) == [2, 4, 6], rewards
    result = grpo_resumed["result"]
    assert result["best_metric"] == "eval_reward"
    assert result["best_value"] == max(rewards.values())
    assert rewards[result["best_step"]] == result["best_value"]
    listed = checkpoints(service, run_id, "deepspeed")
    assert [c["step"] for c in listed if c["best"]] == [result["best_step"]]
    (export,) = checkpoints(service, run_id, "hf")
    assert export["step"] == result["best_step"]
    AutoModelForCausalLM.from_pretrained(grpo_resumed["output"]["model_path"])
