"""A logged step's metrics arrive whole, though its reduction completes after the call."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from contract.job_env import CALLBACK_URL_ENV, TOKEN_ENV
from contract.run_request import RunSpec
from tests.worker.one_rank import spawn_ranks
from worker.reporting.metrics import MetricSinks, StepResult


class _Engine:
    def __init__(self) -> None:
        self.lr = 0.1

    def get_lr(self) -> list[float]:
        return [self.lr]

    def get_global_grad_norm(self) -> float:
        return 2.0


def _sinks(rank: int = 1) -> MetricSinks:
    spec = RunSpec.model_validate(
        {
            "run_id": "run_x",
            "attempt": 1,
            "storage_path": "/tmp",
            "model": "m",
            "dataset": {"source": "./d.jsonl"},
            "training": {"max_steps": 3},
        }
    )
    return MetricSinks(spec, rank=rank)  # rank 1: no service client


def _log(sinks: MetricSinks, engine: Any, *, step: int, loss: float) -> None:
    sinks.log_step(
        engine,
        step=step,
        epoch=0.5,
        elapsed=0.5,
        result=StepResult(loss=torch.tensor(loss), tokens=100, samples=4),
        total_steps=3,
    )


def test_latest_holds_the_last_logged_step_in_full() -> None:
    sinks, engine = _sinks(), _Engine()
    _log(sinks, engine, step=1, loss=3.0)
    engine.lr = 0.2  # the scheduler moves on before the step's metrics are delivered
    _log(sinks, engine, step=2, loss=2.0)
    latest = sinks.latest
    assert latest["loss"] == 2.0
    assert latest["learning_rate"] == 0.2
    assert latest["tokens_per_second"] == 200.0
    assert latest["samples_per_second"] == 8.0
    assert latest["tokens"] == 100.0  # this step's, with no unlogged steps before it
    assert latest["grad_norm"] == 2.0
    assert latest["cpu_seconds_per_step"] >= 0.0
    sinks.close()


def test_tokens_count_the_unlogged_steps_since_the_last_logged_one() -> None:
    sinks, engine = _sinks(), _Engine()
    sinks.log_step(
        engine,
        step=3,
        epoch=0.5,
        elapsed=0.5,
        result=StepResult(loss=torch.tensor(1.0), tokens=100, samples=4),
        total_steps=3,
        tokens_since_log=250,
    )
    latest = sinks.latest
    assert latest["tokens"] == 250.0
    assert latest["tokens_per_second"] == 200.0  # still this step's rate
    sinks.close()


def test_eval_metrics_join_the_completed_step() -> None:
    sinks, engine = _sinks(), _Engine()
    _log(sinks, engine, step=1, loss=3.0)
    sinks.log_eval({"eval_loss": 1.5}, step=1)
    assert sinks.latest["loss"] == 3.0
    assert sinks.latest["eval_loss"] == 1.5
    sinks.close()


def test_a_diverging_step_reaches_the_service_and_a_refusal_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 posts a NaN loss like any other (before, the post raised ValueError in the
    training loop and failed the run); a step the service refuses is logged at the flush."""
    from tests.worker.reporting.test_service_client import RecordingService, delivered_points

    caplog.set_level(logging.ERROR, logger="tuneyard.worker")
    service = RecordingService()
    service.serve()
    monkeypatch.setenv(CALLBACK_URL_ENV, service.url)
    monkeypatch.setenv(TOKEN_ENV, "run-token")
    sinks, engine = _sinks(rank=0), _Engine()
    try:
        _log(sinks, engine, step=1, loss=float("nan"))
        sinks.flush()
        losses = [p["value"] for p in delivered_points(service) if p["name"] == "loss"]
        assert losses == ["NaN"]
        assert caplog.text == ""

        service.default_status = 409  # the attempt is over
        _log(sinks, engine, step=2, loss=float("inf"))
        sinks.flush()
        assert "metrics up to step 2 did not all reach the service" in caplog.text
    finally:
        sinks.close()
        service.close()


def _rank_reduces_beside_training(rank: int, port: int, out: str) -> None:
    """Rank 1 has a training collective in flight on the default group when the step's
    metrics are reduced; rank 0 joins that collective only after reading its metrics."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=20),
    )
    try:
        sinks = _sinks()
        gradients = torch.full((1000,), float(rank + 1))
        training = None
        if rank == 1:
            training = dist.all_reduce(gradients, async_op=True)
        # Each rank holds its part of the step's mean loss: 1.0 and 2.0.
        _log(sinks, _Engine(), step=1, loss=1.0 + rank)
        latest = sinks.latest
        if rank == 0:
            dist.all_reduce(gradients)
        else:
            assert training is not None
            training.wait()
        sinks.close()
        result = {"loss": latest["loss"], "tokens_per_second": latest["tokens_per_second"]}
        result["gradient"] = float(gradients[0])
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_metric_reduction_has_its_own_process_group(tmp_path: Any) -> None:
    """On the default group rank 0's metric reduction would meet rank 1's gradient
    reduction (a mismatch: an error or a wrong sum); in its own group both come out right."""
    import json

    from app.ports import free_port

    port = free_port()
    out = str(tmp_path / "rank")
    spawn_ranks(_rank_reduces_beside_training, args=(port, out), nprocs=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank.{rank}").read_text())
        assert result["loss"] == 3.0  # the parts' sum
        assert result["tokens_per_second"] == 400.0  # 2 x 100 tokens in 0.5 s
        assert result["gradient"] == 3.0  # 1 + 2
