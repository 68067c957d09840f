"""What a run's training data comes to, for `POST /v1/runs/validate`: the examples (or
packed rows) the worker will train on, and the seq_length it will choose where the request
leaves it unset.

Only the worker's own preparation can say this exactly (tokenizer, chat template, the
filters, packing, max_samples), so the service runs it: `python -m worker.data_plan` in a
process of its own, which keeps torch out of the service, under a memory and CPU bound
(the request's chat template is rendered there), with a dataset cache of its own that is
removed after. Answers are cached per API key by the content of the data file and of the
model folder's non-weight files, and by the fields that shape the data, so a second
validate of the same request is instant. Hub datasets, object storage and very large files
are not counted here: the plan stays unknown, with the reason.

Counting waits on the event loop, not on a thread: for one of COUNT_SLOTS slots, and behind
any other count of the same API key, so neither a burst of validates nor one key holds the
service's threads or every slot.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from contract.datasets import is_local_source

log = logging.getLogger("tuneyard.data_plan")

# Beyond this a file is tokenized on the cluster only: hashing and tokenizing it inside a
# request would take minutes.
MAX_BYTES = 256 * 1024 * 1024
TIMEOUT_SECONDS = 300
# The count's own bounds: about 1.4 GB of data segment is torch and the worker's imports;
# the rest is for the data (a 256 MiB file parses into a few times its size at most).
MAX_DATA_BYTES = 3 * 1024**3
COUNT_SLOTS = 2
_CACHE_SIZE = 256
# Weights are what a model folder holds that the data preparation never reads.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
_MAX_MODEL_FILES = 1_000


@dataclass(frozen=True, slots=True)
class DataPlan:
    examples: int | None = None  # training examples, or packed rows, after preparation
    seq_length: int | None = None  # the request's, or the one the worker will choose
    notes: list[str] = field(default_factory=list)
    # Why the data was not counted here (the worker counts it on the cluster).
    unknown_because: str | None = None
    # Why the worker's preparation refuses this data: the request is not valid.
    problem: str | None = None


def needed(spec: dict[str, Any]) -> bool:
    """Whether the request leaves the service anything to count: packed data, or an unset
    seq_length."""
    training = spec.get("training") or {}
    return bool(training.get("packing")) or training.get("seq_length") is None


async def plan_for(owner_id: str, spec: dict[str, Any]) -> DataPlan:
    """The plan for a checked request's resolved spec (local paths resolved, an upload's id
    replaced by its path), counted for `owner_id`."""
    gates = _gates()
    lock = gates.owners.setdefault(owner_id, _OwnerLock())
    lock.users += 1
    try:
        async with lock.lock:
            return await anyio.to_thread.run_sync(data_plan, owner_id, spec, limiter=gates.slots)
    finally:
        lock.users -= 1
        if not lock.users:
            gates.owners.pop(owner_id, None)


@dataclass
class _OwnerLock:
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 0


@dataclass
class _Gates:
    slots: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(COUNT_SLOTS))
    owners: dict[str, _OwnerLock] = field(default_factory=dict)


# anyio's primitives belong to one event loop: one set per loop (a test may run several).
_loop_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Gates] = (
    weakref.WeakKeyDictionary()
)


def _gates() -> _Gates:
    loop = asyncio.get_running_loop()
    if loop not in _loop_gates:
        _loop_gates[loop] = _Gates()
    return _loop_gates[loop]


def data_plan(owner_id: str, spec: dict[str, Any]) -> DataPlan:
    """Blocking: the cached plan, or a count by the worker's own preparation."""
    source, model = spec["dataset"]["source"], spec["model"]
    if not is_local_source(source):
        return DataPlan(unknown_because="the dataset is read on the cluster (hub or storage)")
    if not is_local_source(model):
        return DataPlan(unknown_because="the model's tokenizer is read on the cluster")
    data = Path(source)
    if not data.is_file():
        return DataPlan(unknown_because="the dataset is a folder, counted on the cluster")
    if data.stat().st_size > MAX_BYTES:
        return DataPlan(
            unknown_because=f"the dataset is over {MAX_BYTES // 2**20} MiB, counted on the cluster"
        )
    key = _key(owner_id, spec, data, Path(model))
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    plan = _run_worker_plan(spec)
    if plan.unknown_because is None:
        with _lock:
            _cache[key] = plan
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return plan


_cache: OrderedDict[str, DataPlan] = OrderedDict()
_lock = threading.Lock()


def _key(owner_id: str, spec: dict[str, Any], data: Path, model: Path) -> str:
    digest = hashlib.sha256(owner_id.encode() + b"\0")
    # Everything that shapes the examples but the file's name: the same bytes under another
    # path count the same.
    shaping = {k: v for k, v in spec["dataset"].items() if k not in ("source", "eval_source")}
    digest.update(
        json.dumps(
            {"dataset": shaping, "training": spec["training"], "task": spec.get("task")},
            sort_keys=True,
        ).encode()
    )
    digest.update(_file_digest(data))
    # Every file of the model folder but its weights: the tokenizer, its templates (also
    # in subfolders, as transformers 5 keeps named ones) and the config.
    files = sorted(
        p
        for p in model.rglob("*")
        if p.is_file() and not p.is_symlink() and not p.name.endswith(_WEIGHT_SUFFIXES)
    )
    for path in files[:_MAX_MODEL_FILES]:
        digest.update(str(path.relative_to(model)).encode() + b"\0" + _file_digest(path))
    return digest.hexdigest()


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


def _run_worker_plan(spec: dict[str, Any]) -> DataPlan:
    worker_spec = {**spec, "run_id": "run_validate", "attempt": 1, "storage_path": "/unused"}
    command = [
        sys.executable,
        "-m",
        "worker.data_plan",
        f"--max-data-bytes={MAX_DATA_BYTES}",
        f"--max-cpu-seconds={TIMEOUT_SECONDS}",
    ]
    with tempfile.TemporaryDirectory(prefix="tuneyard-data-plan-") as cache:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            # The count's Arrow files go with it: a validate leaves nothing on the disk.
            "HF_DATASETS_CACHE": cache,
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        try:
            done = subprocess.run(
                command,
                input=json.dumps(worker_spec),
                capture_output=True,
                text=True,
                timeout=TIMEOUT_SECONDS,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return DataPlan(unknown_because=f"counting took over {TIMEOUT_SECONDS} s")
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        log.warning("worker.data_plan gave no answer (exit %s): %s", done.returncode, done.stderr)
        return DataPlan(unknown_because="the data could not be counted here")
    if "problem" in answer:
        return DataPlan(problem=str(answer["problem"]))
    if "error" in answer:
        return DataPlan(unknown_because=f"the data could not be counted here: {answer['error']}")
    return DataPlan(
        examples=int(answer["examples"]),
        seq_length=int(answer["seq_length"]),
        notes=[str(n) for n in answer.get("notes", [])],
    )
