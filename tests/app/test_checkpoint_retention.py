"""Which DeepSpeed checkpoints the service marks `pruned` (app/services/run_data.py) against
what Ray Train's own checkpoint manager deletes from storage, for checkpoints as the worker
reports them: its ranking metric at an evaluation's step, NaN between evaluations
(worker/training/eval_watch.py `ranked`). The service is real (on a loopback port, a real database)
and hears of each checkpoint from the worker's CheckpointRecorder; Ray's manager is the
class Ray Train's controller runs, on the run's real storage folder, without a cluster.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.settings import Settings
from contract.job_env import CALLBACK_URL_ENV, SPEC_ENV, TOKEN_ENV
from contract.run_request import RunSpec
from tests.app.conftest import served
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.worker_calls import job_token
from tests.factories import run_request
from worker.model.checkpoints import checkpoint_dir_name
from worker.reporting.logs import LOGGER
from worker.training.eval_watch import EvalWatch
from worker.training.preemption import Preemption
from worker.training.trainer import CheckpointRecorder, checkpoint_config


@dataclass(frozen=True)
class Saved:
    """A checkpoint the loop saves: at an evaluation (with its value of the metric) or at a
    preemption. A periodic one falls on an evaluation's step when a metric ranks them
    (contract/run_request.py refuses other periods)."""

    step: int
    kind: str
    value: float | None = None


def evaluated(step: int, value: float) -> Saved:
    return Saved(step, "eval", value)


def preempted(step: int) -> Saved:
    return Saved(step, "preempt")


SCENARIOS = {
    # One preemption between evaluations, keep_last 1: the checkpoint at step 4 is the best
    # and must outlive the preemption's and the worse evaluation after it.
    "preempted-keep-1": (
        1,
        [evaluated(2, 1.0), evaluated(4, 0.5), preempted(5), evaluated(6, 0.7), preempted(7)],
    ),
    # Two preemptions in a row at the default keep_last 2.
    "preempted-twice-keep-2": (
        2,
        [evaluated(2, 1.0), evaluated(4, 0.5), preempted(5), preempted(6), evaluated(8, 0.9)],
    ),
}


def request_of(root: Path, keep_last: int) -> dict[str, Any]:
    return run_request(
        root,
        dataset={"split": "train[:90%]", "eval_split": "train[90%:]"},
        training={"max_steps": 10, "eval_every_n_steps": 2},
        checkpointing={"keep_last": keep_last},
        export={"from": "best"},
    )


@pytest.fixture
def worker_logger() -> Iterator[None]:
    """The recorder configures the worker's logger for its process: undone after the test."""
    logger = logging.getLogger(LOGGER)
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


@dataclass
class Retention:
    kept_by_ray: set[str]  # the checkpoint folders left in the run's storage
    kept_by_service: set[str]  # those the service's list does not mark pruned
    best_by_service: int | None  # the step of the checkpoint the list marks best
    best_by_worker: int | None  # the step `export.from: best` loads (worker/training/eval_watch.py)


def run_checkpoints(
    client: TestClient,
    auth: dict[str, str],
    root: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    *,
    keep_last: int,
    saved: list[Saved],
    ranked: bool = True,
) -> Retention:
    """Report `saved` as the training loop does to Ray Train's checkpoint manager and, by
    the CheckpointRecorder, to the service; what each then keeps. `ranked=False`: as
    workers reported before every checkpoint carried the ranking metric."""
    from ray.train import Checkpoint, CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        CheckpointManager,
    )
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    r = client.post("/v1/runs", json=request_of(root, keep_last), headers=auth)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    (job,) = dispatch_to(ScriptedRay(), settings, session_factory).submitted
    spec = RunSpec.model_validate(json.loads(job["runtime_env"]["env_vars"][SPEC_ENV]))
    watches = [EvalWatch(spec)]
    marker = Preemption(attempt=spec.attempt, client=None, group=None).marker()
    storage = StorageContext(storage_path=spec.storage_path, experiment_dir_name=spec.run_id)

    async def report_all() -> None:
        # The controller's manager, as Ray Train's RunConfig(checkpoint_config) builds it;
        # it needs a running event loop, as in the controller. One recorder and attempt 1
        # throughout: the service orders checkpoints as reported, whichever attempt.
        ray = CheckpointManager(checkpoint_config(spec, CheckpointConfig), storage)
        recorder = CheckpointRecorder(spec)
        watch = watches[0]
        # The loop's latest metrics (worker/reporting/metrics.py `latest`).
        latest: dict[str, Any] = {"loss": 1.0}
        for s in saved:
            if s.kind == "eval":
                assert s.value is not None
                watch.observe({"eval_loss": s.value}, step=s.step)
                latest["eval_loss"] = s.value
            # A preemption's step is logged: its metrics are that step's alone.
            metrics = {"loss": 1.0, **marker} if s.kind == "preempt" else latest
            metrics = watch.ranked(metrics, step=s.step) if ranked else metrics
            # As worker/model/checkpoints.py `save_and_report_checkpoint` reports them.
            metrics = {**metrics, "step": s.step, "epoch": s.step / 10}
            path = Path(storage.build_checkpoint_path_from_name(checkpoint_dir_name(s.step)))
            path.mkdir(parents=True)
            (path / "mp_rank_00_model_states.pt").write_bytes(b"weights")
            checkpoint = Checkpoint(path=str(path), filesystem=storage.storage_filesystem)
            ray.register_checkpoint(_TrainingReport(checkpoint, metrics, validation=False))
            recorder.after_report(None, [metrics], checkpoint)
            if s.kind == "preempt":
                # The next attempt: fresh metrics, the watch restored from the checkpoint.
                latest = {"loss": 1.0}
                resumed = EvalWatch(spec)
                resumed.load_state_dict(watch.state_dict())
                watch = resumed
                watches.append(watch)

    with served(create_app(settings, start_background=False)) as url:
        monkeypatch.setenv(CALLBACK_URL_ENV, url)
        monkeypatch.setenv(TOKEN_ENV, job_token(job))
        asyncio.run(report_all())

    listed = client.get(f"/v1/runs/{run_id}/checkpoints", headers=auth).json()["data"]
    assert [c["step"] for c in listed] == [s.step for s in saved]
    folder = Path(spec.storage_path, spec.run_id)
    best = [c["step"] for c in listed if c["best"]]
    return Retention(
        kept_by_ray={p.name for p in folder.iterdir() if p.name.startswith("checkpoint_step_")},
        kept_by_service={Path(c["path"]).name for c in listed if not c["pruned"]},
        best_by_service=best[0] if best else None,
        best_by_worker=watches[-1].state.best_step,
    )


@pytest.fixture
def report(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[..., Retention]:
    """`run_checkpoints` on this test's service: takes keep_last, saved and ranked."""
    return functools.partial(
        run_checkpoints, client, auth, tmp_path, settings, session_factory, monkeypatch
    )


@pytest.mark.usefixtures("worker_logger")
class TestPrunedAgreesWithRay:
    @pytest.mark.parametrize(("keep_last", "saved"), SCENARIOS.values(), ids=SCENARIOS.keys())
    def test_the_best_checkpoint_outlives_those_between_evaluations(
        self, report: Callable[..., Retention], keep_last: int, saved: list[Saved]
    ) -> None:
        retention = report(
            keep_last=keep_last,
            saved=saved,
        )

        best = retention.best_by_worker
        assert best is not None
        # What `export.from: best` loads is still in storage, and the list says so.
        assert checkpoint_dir_name(best) in retention.kept_by_ray
        assert retention.best_by_service == best
        assert retention.kept_by_service == retention.kept_by_ray
        # Ray kept the best keep_last and the latest, no more.
        assert len(retention.kept_by_ray) <= keep_last + 1

    @pytest.mark.parametrize(("keep_last", "saved"), SCENARIOS.values(), ids=SCENARIOS.keys())
    def test_checkpoints_reported_without_the_metric_as_ray_ranked_them(
        self, report: Callable[..., Retention], keep_last: int, saved: list[Saved]
    ) -> None:
        """A run a worker reported before the fix: Ray scored a checkpoint without the
        metric as the best of all (and deleted the best evaluated one); the list says what
        Ray did, not what it should have done."""
        retention = report(
            keep_last=keep_last,
            saved=saved,
            ranked=False,
        )

        assert retention.kept_by_service == retention.kept_by_ray
        # The bug these runs had: the checkpoint `export.from: best` loads was deleted.
        assert retention.best_by_worker is not None
        assert checkpoint_dir_name(retention.best_by_worker) not in retention.kept_by_ray
