"""A logged step's metrics arrive whole, though its reduction completes after the call."""

from __future__ import annotations

from typing import Any

import torch

from worker.spec import RunSpec
from worker.train_loop import _MetricSinks


class _Engine:
    def __init__(self) -> None:
        self.lr = 0.1

    def get_lr(self) -> list[float]:
        return [self.lr]

    def get_global_grad_norm(self) -> float:
        return 2.0


def _sinks() -> _MetricSinks:
    spec = RunSpec.from_dict(
        {
            "run_id": "run_x",
            "attempt": 1,
            "storage_path": "/tmp",
            "model": "m",
            "dataset": {"source": "./d.jsonl"},
            "training": {"max_steps": 3},
        }
    )
    return _MetricSinks(spec, rank=1)  # rank 1: no service client


def _log(sinks: _MetricSinks, engine: Any, *, step: int, loss: float) -> None:
    sinks.log_step(
        engine,
        step=step,
        epoch=0.5,
        elapsed=0.5,
        loss_sum=torch.tensor(loss),
        tokens=100,
        samples=4,
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
    assert latest["grad_norm"] == 2.0
    assert latest["cpu_seconds_per_step"] >= 0.0
    sinks.close()


def test_eval_metrics_join_the_completed_step() -> None:
    sinks, engine = _sinks(), _Engine()
    _log(sinks, engine, step=1, loss=3.0)
    sinks.log_eval({"eval_loss": 1.5}, step=1)
    assert sinks.latest["loss"] == 3.0
    assert sinks.latest["eval_loss"] == 1.5
    sinks.close()
