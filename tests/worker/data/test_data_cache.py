"""Tokenized and packed data is kept across attempts and runs on a node: a second attempt
(a new process) reads the Arrow files the first wrote instead of tokenizing again.

The cache is the `datasets` library's own (HF_DATASETS_CACHE): each map is keyed by its
input's fingerprint (for a file: its path, size and modification time) and a hash of the
function, the tokenizer included, so the same file, tokenizer and preparation give the
same files, and any change among them gives new ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from app.cli.tiny_assets import write_jsonl_dataset

# One attempt's data preparation, as build_data does it, in a process of its own.
PREPARE = """
import json, sys
from transformers import AutoTokenizer
from contract.run_request import RunRequest, RunSpec
from worker.data.preparation import prepare_examples

request = RunRequest.model_validate(json.loads(sys.argv[1]))
spec = RunSpec.for_attempt(
    request.worker_fields(), run_id="run_cache", attempt=int(sys.argv[2]), storage_path="/unused"
)
examples, _ = prepare_examples(spec, AutoTokenizer.from_pretrained(spec.model), split=None)
print(json.dumps({"rows": len(examples), "files": [f["filename"] for f in examples.cache_files]}))
"""


def _prepare(request: dict, *, attempt: int, cache: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PREPARE, json.dumps(request), str(attempt)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_second_attempt_reads_the_first_attempts_prepared_data(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = write_jsonl_dataset(tmp_path / "news.jsonl", rows=400)
    request = {
        "model": str(tiny_model_dir),
        "dataset": {"source": str(data)},
        "training": {"max_steps": 2, "seq_length": 64, "packing": True},
        "resources": {"num_workers": 1},
    }
    cache = tmp_path / "datasets-cache"

    first = _prepare(request, attempt=1, cache=cache)
    written = {Path(f).stat().st_mtime_ns for f in first["files"]}
    arrow_files = sorted(cache.rglob("cache-*.arrow"))
    second = _prepare(request, attempt=2, cache=cache)

    assert first["rows"] == second["rows"] > 0
    # The packed examples come from the same files, untouched, and no new one was written.
    assert second["files"] == first["files"] and first["files"]
    assert {Path(f).stat().st_mtime_ns for f in second["files"]} == written
    assert sorted(cache.rglob("cache-*.arrow")) == arrow_files

    # Another preparation of the same file (another seq_length) is prepared anew.
    request["training"]["seq_length"] = 32
    other = _prepare(request, attempt=1, cache=cache)
    assert set(other["files"]).isdisjoint(first["files"])
