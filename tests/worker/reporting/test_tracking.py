"""worker/reporting/tracking.py against a real MLflow tracking server on loopback and W&B offline,
read back with MLflow's own client and from the W&B run's own transaction log."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.ports import free_port
from contract.job_env import CALLBACK_URL_ENV, MLFLOW_TRACKING_URI_ENV, TOKEN_ENV
from contract.run_request import RunSpec
from tests.factories import run_request
from tests.worker.reporting.test_service_client import RecordingService, wait_until
from worker.reporting.metrics import MetricSinks
from worker.reporting.tracking import Trackers


def _spec(root: Path, *, run_id: str, attempt: int = 1, **tracking: Any) -> RunSpec:
    body = run_request(
        root,
        tracking=tracking,
        webhooks=[{"url": "https://hooks.example/in?token=not-for-trackers"}],
    )
    return RunSpec.model_validate(
        {**body, "run_id": run_id, "attempt": attempt, "storage_path": str(root / "storage")}
    )


# -- MLflow ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mlflow server` on a free loopback port, its runs in SQLite; artifacts go through
    the server (as on a cluster, where workers cannot write to the server's disk)."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log_file = (root / "server.log").open("wb")
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "mlflow", "server"),
            *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
            *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
            *("--artifacts-destination", str(root / "artifacts")),
        ],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the MLflow server did not start in 60 s"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log_file.close()


@pytest.fixture
def mlflow_uri(mlflow_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The job's environment as the service sets it."""
    monkeypatch.setenv(MLFLOW_TRACKING_URI_ENV, mlflow_server)
    return mlflow_server


def _mlflow_runs(uri: str, experiment: str, run_id: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r}"
    return list(
        client.search_runs(
            [found.experiment_id], filter_string=f"tags.`tuneyard.run_id` = '{run_id}'"
        )
    )


def _history(uri: str, mlflow_run_id: str, name: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri=uri).get_metric_history(mlflow_run_id, name)
    return sorted((m.step, m.value) for m in history)


class TestMlflow:
    def test_a_run_logs_its_definition_metrics_and_model_and_a_resume_continues_it(
        self, mlflow_uri: str, tmp_path: Path
    ) -> None:
        from mlflow.tracking import MlflowClient

        experiment, run_id = f"exp-{uuid.uuid4().hex[:8]}", f"run_{uuid.uuid4().hex[:12]}"
        failures: list[str] = []
        spec = _spec(tmp_path, run_id=run_id, mlflow={"experiment": experiment})
        trackers = Trackers(spec, on_failure=failures.append)
        trackers.log({"loss": 2.5, "learning_rate": 0.001}, step=1)
        trackers.log({"loss": 2.0, "learning_rate": 0.001}, step=2)
        trackers.log({"eval_loss": 1.75, "eval_perplexity": 5.75}, step=2)
        model = str(tmp_path / "storage" / run_id / "export")
        trackers.exported(model, "hf")
        trackers.close()

        [run] = _mlflow_runs(mlflow_uri, experiment, run_id)
        assert run.info.status == "FINISHED"
        assert run.info.run_name == run_id  # the default name: the tuneyard run's id
        params, tags = run.data.params, run.data.tags
        assert params["training.learning_rate"] == "0.001"
        assert params["training.max_steps"] == "5"
        assert params["deepspeed.zero_stage"] == "2"
        assert params["model"] == spec.model
        assert params["tracking.mlflow.experiment"] == experiment
        # Neither the attempt's fields nor the webhooks (a URL may carry a token).
        assert not [key for key in params if key.startswith(("webhooks", "run_id", "attempt"))]
        assert "not-for-trackers" not in json.dumps(params)
        assert tags["tuneyard.attempt"] == "1"
        assert _history(mlflow_uri, run.info.run_id, "loss") == [(1, 2.5), (2, 2.0)]
        assert _history(mlflow_uri, run.info.run_id, "eval_loss") == [(2, 1.75)]
        # The model by reference: a tag and a small JSON artifact, not the weights.
        assert tags["tuneyard.model_path"] == model
        assert tags["tuneyard.export.hf"] == model
        client = MlflowClient(tracking_uri=mlflow_uri)
        assert [f.path for f in client.list_artifacts(run.info.run_id, "tuneyard")] == [
            "tuneyard/model.json"
        ]
        reference = json.loads(
            Path(
                client.download_artifacts(run.info.run_id, "tuneyard/model.json", str(tmp_path))
            ).read_text()
        )
        assert reference["model_path"] == model
        assert reference["exports"] == [{"kind": "hf", "path": model}]
        assert failures == []

        # Attempt 2 (a resume): the same MLflow run goes on, and ends FAILED with the run.
        again = Trackers(
            _spec(tmp_path, run_id=run_id, attempt=2, mlflow={"experiment": experiment}),
            on_failure=failures.append,
        )
        again.log({"loss": 1.5}, step=3)
        again.close(failed=True)
        [continued] = _mlflow_runs(mlflow_uri, experiment, run_id)
        assert continued.info.run_id == run.info.run_id
        assert continued.info.status == "FAILED"
        assert continued.data.tags["tuneyard.attempt"] == "2"
        assert _history(mlflow_uri, run.info.run_id, "loss") == [(1, 2.5), (2, 2.0), (3, 1.5)]
        assert failures == []

    def test_a_tracker_that_raises_is_reported_once_and_the_run_goes_on(
        self, mlflow_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """MLflow refuses a metric name it does not allow, at every call: one warning and
        one report, however many calls fail, and the close still ends the run."""
        experiment, run_id = f"exp-{uuid.uuid4().hex[:8]}", f"run_{uuid.uuid4().hex[:12]}"
        failures: list[str] = []
        trackers = Trackers(
            _spec(tmp_path, run_id=run_id, mlflow={"experiment": experiment}),
            on_failure=failures.append,
        )
        caplog.set_level(logging.WARNING, logger="tuneyard.worker")
        for step in range(1, 6):
            trackers.log({"bad name!?": 1.0}, step=step)
            time.sleep(0.05)  # separate calls, not one batch
        trackers.close()
        assert len(failures) == 1, failures
        assert failures[0].startswith("mlflow tracking failed, the run goes on without it")
        warnings = [r for r in caplog.records if "mlflow tracking failed" in r.getMessage()]
        assert len(warnings) == 1
        [run] = _mlflow_runs(mlflow_uri, experiment, run_id)
        assert run.info.status == "FINISHED"


def test_a_tracker_that_is_down_never_blocks_or_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Through MetricSinks, as rank 0 trains: MLflow's address refuses connections (a
    bound port that does not listen). Logging returns at once, the service hears of it
    once, as a `tracking_failed` event, and the end of the run waits seconds, not minutes."""
    service, down = RecordingService(), RecordingService()
    service.serve()
    monkeypatch.setenv(CALLBACK_URL_ENV, service.url)
    monkeypatch.setenv(TOKEN_ENV, "run-token")
    monkeypatch.setenv(MLFLOW_TRACKING_URI_ENV, down.url)
    caplog.set_level(logging.WARNING, logger="tuneyard.worker")
    spec = _spec(tmp_path, run_id="run_down", mlflow={})
    try:
        sinks = MetricSinks(spec, rank=0)
        assert sinks.trackers is not None
        started = time.perf_counter()
        for step in range(1, 201):
            sinks.log_eval({"eval_loss": 1.0 / step}, step=step)
        sinks.exported(str(tmp_path / "export"), "hf")
        assert time.perf_counter() - started < 1.0  # 200 steps' metrics, 201 tracker calls
        assert wait_until(
            lambda: any(r.path.endswith("/events") for r in service.requests()), timeout_s=30
        )
        started = time.perf_counter()
        sinks.close()
        assert time.perf_counter() - started < 20
    finally:
        service.close()
        down.close()
    events = [r.body for r in service.requests() if r.path.endswith("/events")]
    assert [e["type"] for e in events] == ["tracking_failed"]
    assert "mlflow tracking failed, the run goes on without it" in events[0]["message"]
    # The service still got every metric point.
    points = [
        p for r in service.requests() if r.path.endswith("/metrics") for p in r.body["points"]
    ]
    assert len(points) == 200
    assert len([r for r in caplog.records if "tracking failed" in r.getMessage()]) == 1


def test_a_hung_tracker_drops_what_does_not_fit_and_the_end_waits_only_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow's address accepts connections and never answers: the thread is stuck in its
    first call, the queue fills and then drops (counted), and close gives up on time."""
    hung = RecordingService()
    hung.listen()
    monkeypatch.setenv(MLFLOW_TRACKING_URI_ENV, hung.url)
    caplog.set_level(logging.WARNING, logger="tuneyard.worker")
    try:
        trackers = Trackers(_spec(tmp_path, run_id="run_hung", mlflow={}), queue_items=3)
        started = time.perf_counter()
        for step in range(1, 11):
            trackers.log({"loss": 1.0}, step=step)
        assert time.perf_counter() - started < 0.5
        assert trackers.dropped == 7
        started = time.perf_counter()
        trackers.close(timeout_s=1.0)
        assert time.perf_counter() - started < 3
    finally:
        hung.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("did not finish within 1 s" in m for m in messages), messages
    assert any("7 logged steps were not sent" in m for m in messages), messages


def test_only_rank_0_of_a_tracked_run_has_trackers(tmp_path: Path) -> None:
    tracked = _spec(tmp_path, run_id="run_t", wandb={"mode": "offline"})
    assert Trackers.for_rank(tracked, rank=1) is None
    assert Trackers.for_rank(_spec(tmp_path, run_id="run_u"), rank=0) is None


# -- W&B offline ------------------------------------------------------------------------


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run's transaction log (`run-<id>.wandb`, what `wandb sync`
    uploads), parsed with W&B's own protobuf schema. The installed wandb has no reader of
    its own: the file is LevelDB's log format (32 KiB blocks of checksummed chunks) after a
    7-byte W&B header."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B"
    position, parts = 7, []
    while position + 7 <= len(data):
        left = block - position % block
        checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (length, kind) == (0, 0):  # the rest of a block is padding
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == checksum
        position += 7 + length
        parts.append(chunk)
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _wandb_run(records: list[Any]) -> dict[str, Any]:
    """What a W&B run's log holds, as the UI would show it."""
    run: dict[str, Any] = {"history": {}, "summary": {}, "artifacts": [], "config": {}}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"], run["project"] = record.run.run_id, record.run.project
            run["name"] = record.run.display_name
            for item in record.run.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {
                (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                for item in record.history.item
            }
            step = record.history.step.num
            run["history"][step] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            for item in record.summary.update:
                run["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "artifact":
            refs = [entry.ref for entry in record.artifact.manifest.contents]
            run["artifacts"].append((record.artifact.type, record.artifact.name, refs))
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def test_wandb_offline_logs_the_run_and_a_resume_continues_its_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-files"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline needs no key
    run_id = f"run_{uuid.uuid4().hex[:12]}"
    failures: list[str] = []
    spec = _spec(tmp_path, run_id=run_id, wandb={"mode": "offline", "project": "yard"})
    trackers = Trackers(spec, on_failure=failures.append)
    trackers.log({"loss": 2.5}, step=1)
    trackers.log({"loss": 2.0}, step=2)
    trackers.log({"eval_loss": 1.75}, step=2)
    model = tmp_path / "export"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_text("{}")
    trackers.exported(str(model), "hf")
    trackers.close()
    assert failures == []

    again = Trackers(
        _spec(tmp_path, run_id=run_id, attempt=2, wandb={"mode": "offline", "project": "yard"}),
        on_failure=failures.append,
    )
    again.log({"loss": 1.5}, step=3)
    again.close(failed=True)
    assert failures == []

    # offline-run-<time>-<id>, with "-1" added when two start within a second.
    logs = sorted((tmp_path / "wandb-files" / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(logs) == 2  # one per attempt, both of the same W&B run id
    first, second = (_wandb_run(list(wandb_records(d / f"run-{run_id}.wandb"))) for d in logs)
    assert (first["id"], first["project"], first["name"]) == (run_id, "yard", run_id)
    assert first["config"]["training"]["learning_rate"] == 0.001
    assert first["config"]["deepspeed"]["zero_stage"] == 2
    assert "webhooks" not in first["config"]
    assert first["history"][1] == {"loss": 2.5}
    assert first["history"][2] == {"loss": 2.0, "eval_loss": 1.75}
    assert first["summary"]["tuneyard.model_path"] == str(model)
    # A reference to each file of the export, none of them uploaded.
    [(kind, name, refs)] = first["artifacts"]
    assert (kind, name) == ("model", f"{run_id}-hf")
    assert sorted(refs) == [f"{model.as_uri()}/config.json", f"{model.as_uri()}/model.safetensors"]
    assert first["exit_code"] == 0
    assert second["id"] == run_id
    assert second["history"] == {3: {"loss": 1.5}}
    assert second["exit_code"] == 1
