"""What a run's training data comes to, for `POST /v1/runs/validate`: the examples (or
packed rows) the worker will train on, and the seq_length it will choose where the request
leaves it unset.

Only the worker's own preparation can say this exactly (tokenizer, chat template, the
filters, packing, max_samples), so the service runs it: `python -m worker.data_plan` in a
process of its own, which keeps torch out of the service. Answers are cached by the
content of the data file and of the tokenizer, and by the fields that shape the data, so
a second validate of the same request is instant. Hub datasets, object storage and very
large files are not counted here: the plan stays unknown, with the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.datasets import is_local_source

log = logging.getLogger("tuneyard.data_plan")

# Beyond this a file is tokenized on the cluster only: hashing and tokenizing it inside a
# request would take minutes.
MAX_BYTES = 256 * 1024 * 1024
TIMEOUT_SECONDS = 300
# Each count is a process that imports torch and tokenizes: a burst of validates waits for
# these slots rather than starting a process each (memory, cores).
_SLOTS = threading.BoundedSemaphore(2)
_CACHE_SIZE = 256
# The files AutoTokenizer reads from a model folder (transformers 5).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "config.json",
)


@dataclass(frozen=True, slots=True)
class DataPlan:
    examples: int | None = None  # training examples, or packed rows, after preparation
    seq_length: int | None = None  # the request's, or the one the worker will choose
    notes: list[str] = field(default_factory=list)
    unknown_because: str | None = None


def needed(spec: dict[str, Any]) -> bool:
    """Whether the request leaves the service anything to count: packed data, or an unset
    seq_length."""
    training = spec.get("training") or {}
    return bool(training.get("packing")) or training.get("seq_length") is None


def data_plan(spec: dict[str, Any]) -> DataPlan:
    """The plan for a checked request's resolved spec (local paths resolved, an upload's id
    replaced by its path)."""
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
    key = _key(spec, data, Path(model))
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


def _key(spec: dict[str, Any], data: Path, model: Path) -> str:
    digest = hashlib.sha256()
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
    for name in _TOKENIZER_FILES:
        if (model / name).is_file():
            digest.update(name.encode() + _file_digest(model / name))
    return digest.hexdigest()


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


def _run_worker_plan(spec: dict[str, Any]) -> DataPlan:
    worker_spec = {**spec, "run_id": "run_validate", "attempt": 1, "storage_path": "/unused"}
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    try:
        with _SLOTS:
            done = subprocess.run(
                [sys.executable, "-m", "worker.data_plan"],
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
    if "error" in answer:
        return DataPlan(unknown_because=f"preparing the data failed: {answer['error']}")
    return DataPlan(
        examples=int(answer["examples"]),
        seq_length=int(answer["seq_length"]),
        notes=[str(n) for n in answer.get("notes", [])],
    )
