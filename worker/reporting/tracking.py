"""Experiment tracking: rank 0 logs its run to MLflow and/or Weights & Biases.

What each tracker gets: the run's definition as parameters (MLflow) or config (W&B), every
metric rank 0 sends the service, with its step, and a reference to each exported model.
The model is referenced, never uploaded: exports are gigabytes that already sit in
tuneyard's storage, where `from_pretrained` reads them.

A tracker is an extra, not the run: a tracker that is down, misconfigured or raising must
neither fail the run nor slow it. So every call to a tracker happens on one background
thread fed by a bounded queue (full: the point is dropped and counted, like the service's
MetricsSender), every call is wrapped, and a tracker's first failure is logged once and
posted as one `tracking_failed` event; later failures of the same tracker stay quiet.

A resumed attempt, or Ray Train restarting the worker group, continues the same tracker
run: MLflow's run is found again by its `tuneyard.run_id` tag (MLflow makes its own run
ids), W&B's run id is the tuneyard run id with resume="allow".
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.job_env import MLFLOW_TRACKING_URI_ENV
from contract.run_request import RunDefinition, RunSpec

log = logging.getLogger("tuneyard.worker")

# Items (a step's metrics, an export, the end) waiting for the thread: hours of steps at
# one item per logged step; a tracker slower than that loses the newest points, counted.
QUEUE_ITEMS = 10_000
# How long the end of a run waits for the trackers to take what is queued and close their
# runs: long enough for a healthy server, short enough that a dead one delays little.
CLOSE_TIMEOUT_S = 30.0
# Where W&B writes its files (offline runs: what `wandb sync` uploads later) when the job
# has no WANDB_DIR: a folder on the node that outlives the job, unlike Ray's working dir.
DEFAULT_WANDB_DIR = Path("~/.cache/tuneyard/wandb")
# The request's webhooks are left out of what trackers record: a receiver's URL may carry
# a token in its query, and a tracker's parameters are shown to everyone who can read it.
NOT_RECORDED = frozenset({"webhooks"})
# MLflow's limits (mlflow/utils/validation.py): longer values are refused, not truncated.
MLFLOW_PARAM_VALUE_MAX = 6000
MLFLOW_PARAMS_PER_BATCH = 100
MLFLOW_METRICS_PER_BATCH = 1000
# MLflow's HTTP client retries a refused connection 7 times with doubling waits (minutes)
# and waits 120 s for an answer; a tracker that is down should cost seconds per call. Only
# where the job does not set them itself.
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}
RUN_ID_TAG = "tuneyard.run_id"
ATTEMPT_TAG = "tuneyard.attempt"
MODEL_PATH_KEY = "tuneyard.model_path"
FAILURE_MESSAGE_CHARS = 500


def recorded_definition(spec: RunSpec) -> dict[str, Any]:
    """The run's definition as a tracker records it: the request's own field names (by
    alias), without the attempt's fields (they change between attempts) or webhooks."""
    fields = set(RunDefinition.model_fields) - NOT_RECORDED
    return spec.model_dump(mode="json", by_alias=True, include=fields)


def flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested fields as `training.learning_rate`-style keys with string values (MLflow's
    parameters are strings); lists as JSON, since their items have no names of their own."""
    flat: dict[str, str] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping) and item:
            flat.update(flatten(item, f"{name}."))
        elif isinstance(item, str):
            flat[name] = item
        else:
            flat[name] = json.dumps(item)
    return flat


@dataclass(slots=True)
class _Backend:
    """One tracker, as the thread drives it. Subclasses do the calls; failures are the
    thread's business (see Trackers._guarded)."""

    name: str
    spec: RunSpec
    started: bool = False
    failed: bool = False

    def start(self) -> None:
        raise NotImplementedError

    def log_metrics(self, points: list[tuple[int, dict[str, float]]]) -> None:
        raise NotImplementedError

    def log_export(self, path: str, kind: str) -> None:
        raise NotImplementedError

    def finish(self, *, failed: bool) -> None:
        raise NotImplementedError


@dataclass(slots=True)
class _Mlflow(_Backend):
    client: Any = None
    run_id: str = ""
    exports: list[dict[str, str]] = field(default_factory=list)

    def start(self) -> None:
        uri = os.environ.get(MLFLOW_TRACKING_URI_ENV)
        if not uri:
            raise RuntimeError(
                f"{MLFLOW_TRACKING_URI_ENV} is not set in the job's environment (the service "
                "sets it from TUNEYARD_MLFLOW_TRACKING_URI)"
            )
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        tracking = self.spec.tracking.mlflow
        assert tracking is not None
        self.client = client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment_id(tracking.experiment)
        run = self._existing_run(experiment_id)
        if run is None:
            run = client.create_run(
                experiment_id,
                run_name=tracking.run_name or self.spec.run_id,
                tags={RUN_ID_TAG: self.spec.run_id},
            )
        else:
            # An earlier attempt ended it (FAILED, or FINISHED before a resume): running again.
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        client.set_tag(self.run_id, ATTEMPT_TAG, str(self.spec.attempt))
        # Parameters cannot change once logged: a continued run logs only those it lacks.
        logged = run.data.params
        params = [
            Param(key, value[:MLFLOW_PARAM_VALUE_MAX])
            for key, value in flatten(recorded_definition(self.spec)).items()
            if key not in logged
        ]
        for batch in _chunks(params, MLFLOW_PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=batch)

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return str(self.client.create_experiment(name))
            except MlflowException:
                # Another run created it meanwhile.
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            raise RuntimeError(
                f"MLflow experiment {name!r} is deleted: restore it, or choose another in "
                "tracking.mlflow.experiment"
            )
        return str(experiment.experiment_id)

    def _existing_run(self, experiment_id: str) -> Any:
        run_id = self.spec.run_id.replace("'", "")  # tuneyard's ids have no quotes
        runs = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return runs[0] if runs else None

    def log_metrics(self, points: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(name, float(value), now, step)
            for step, values in points
            for name, value in values.items()
        ]
        for batch in _chunks(metrics, MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch)

    def log_export(self, path: str, kind: str) -> None:
        # Tags, searchable and shown with the run; the last export posted is the run's
        # model, as on the service (the adapter first, then the merged model).
        self.client.set_tag(self.run_id, f"tuneyard.export.{kind}", path)
        self.client.set_tag(self.run_id, MODEL_PATH_KEY, path)
        # And a small JSON among the run's artifacts, where MLflow users look for a model.
        self.exports.append({"kind": kind, "path": path})
        self.client.log_dict(
            self.run_id,
            {"tuneyard_run_id": self.spec.run_id, "model_path": path, "exports": self.exports},
            "tuneyard/model.json",
        )

    def finish(self, *, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


@dataclass(slots=True)
class _Wandb(_Backend):
    run: Any = None

    def start(self) -> None:
        import wandb

        tracking = self.spec.tracking.wandb
        assert tracking is not None
        folder = Path(os.environ.get("WANDB_DIR") or DEFAULT_WANDB_DIR).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=tracking.project,
            entity=tracking.entity,
            name=tracking.run_name or self.spec.run_id,
            # One W&B run per tuneyard run: a resumed attempt continues it.
            id=self.spec.run_id,
            resume="allow",
            mode=tracking.mode,
            config=recorded_definition(self.spec),
            dir=str(folder),
            # Ray already collects the job's output; W&B wrapping stdout would capture
            # every rank's interleaved log lines a second time.
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.summary[ATTEMPT_TAG] = self.spec.attempt
        if tracking.mode == "offline":
            log.info("W&B offline run files in %s (upload with `wandb sync`)", self.run.dir)

    def log_metrics(self, points: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in points:
            # W&B drops a step below its last one: a restart from a checkpoint re-trains
            # steps already logged, and W&B keeps the first attempt's values for them.
            self.run.log(dict(values), step=step)

    def log_export(self, path: str, kind: str) -> None:
        import wandb

        self.run.summary[f"tuneyard.export.{kind}"] = path
        self.run.summary[MODEL_PATH_KEY] = path
        artifact = wandb.Artifact(
            f"{self.spec.run_id}-{kind}",
            type="model",
            metadata={"tuneyard_run_id": self.spec.run_id, "kind": kind, "path": path},
        )
        # Without checksums W&B reads none of the export's bytes: it lists a folder's files
        # and records where each is (an object store URI: just the URI, no listing).
        uri = path if "://" in path else Path(path).absolute().as_uri()
        artifact.add_reference(uri, checksum=False)
        self.run.log_artifact(artifact)

    def finish(self, *, failed: bool) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() returns before W&B's service process has written the run out (offline:
        # its only copy); teardown waits for that. Ray may end this process without running
        # the atexit hook that would otherwise do it.
        wandb.teardown()


@dataclass(slots=True)
class _Item:
    kind: str  # "metrics", "export" or "close"
    step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    path: str = ""
    export_kind: str = ""
    failed: bool = False


class Trackers:
    """The run's trackers, for rank 0. No method blocks on a tracker or raises."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        on_failure: Callable[[str], None] | None = None,
        queue_items: int = QUEUE_ITEMS,
    ) -> None:
        self.spec = spec
        self._on_failure = on_failure
        self.backends: list[_Backend] = []
        if spec.tracking.mlflow is not None:
            self.backends.append(_Mlflow("mlflow", spec))
        if spec.tracking.wandb is not None:
            self.backends.append(_Wandb("wandb", spec))
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=queue_items)
        # Logged steps (and exports) that did not fit in the queue: counted, reported at close.
        self.dropped = 0
        self._closing = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tuneyard-tracking", daemon=True)
        self._thread.start()

    @classmethod
    def for_rank(
        cls, spec: RunSpec, *, rank: int, on_failure: Callable[[str], None] | None = None
    ) -> Trackers | None:
        """Rank 0's trackers; None on other ranks and for a run that asks for none."""
        if rank != 0 or (spec.tracking.mlflow is None and spec.tracking.wandb is None):
            return None
        return cls(spec, on_failure=on_failure)

    def log(self, metrics: Mapping[str, float], *, step: int) -> None:
        self._put(_Item("metrics", step=step, metrics=dict(metrics)))

    def exported(self, path: str, kind: str) -> None:
        self._put(_Item("export", path=path, export_kind=kind))

    def _put(self, item: _Item) -> None:
        if self._closing.is_set():
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def close(self, *, failed: bool = False, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End the tracker runs (FAILED with `failed`), after what is queued, waiting up
        to `timeout_s`: past it the thread is left to itself and the run ends anyway."""
        if self._closing.is_set():
            return
        self._closing.set()
        end = _Item("close", failed=failed)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                # Blocks only while the queue is full, and never past the deadline.
                self._queue.put(end, timeout=max(0.01, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._done.wait(max(0.0, deadline - time.monotonic()))
        if not self._done.is_set():
            log.warning(
                "the experiment trackers did not finish within %.0f s; their runs may show "
                "as still running",
                timeout_s,
            )
        if self.dropped:
            log.warning(
                "%d logged steps were not sent to the experiment trackers (their queue was full)",
                self.dropped,
            )

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            for backend in self.backends:
                backend.started = self._guarded(backend, backend.start)
            while True:
                items = self._next_items()
                points = [(i.step, i.metrics) for i in items if i.kind == "metrics"]
                for backend in self._live():
                    if points:
                        self._guarded(backend, backend.log_metrics, points)
                for item in items:
                    for backend in self._live():
                        if item.kind == "export":
                            self._guarded(backend, backend.log_export, item.path, item.export_kind)
                        elif item.kind == "close":
                            self._guarded(backend, backend.finish, failed=item.failed)
                    if item.kind == "close":
                        return
        finally:
            self._done.set()

    def _next_items(self) -> list[_Item]:
        """The next item and whatever else is queued (a batch for MLflow), up to a close."""
        items = [self._queue.get()]
        while items[-1].kind != "close" and len(items) < MLFLOW_METRICS_PER_BATCH:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    def _live(self) -> Iterable[_Backend]:
        return (b for b in self.backends if b.started)

    def _guarded(
        self, backend: _Backend, call: Callable[..., None], *args: Any, **kwargs: Any
    ) -> bool:
        """`call(*args, **kwargs)`, whose failure is reported once per tracker and then kept
        quiet; the tracker is tried again at its next call (a server may come back)."""
        try:
            call(*args, **kwargs)
            return True
        except Exception as exc:
            if backend.failed:
                log.debug("%s tracking failed again: %s", backend.name, exc)
                return False
            backend.failed = True
            message = (
                f"{backend.name} tracking failed, the run goes on without it: "
                f"{type(exc).__name__}: {exc}"
            )[:FAILURE_MESSAGE_CHARS]
            log.warning("%s (later errors of this tracker are not logged)", message)
            if self._on_failure is not None:
                try:
                    self._on_failure(message)
                except Exception:
                    log.exception("reporting the %s tracking failure failed", backend.name)
            return False


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
