"""What a run's training data comes to, computed by the worker's own preparation:
`python -m worker.data_plan`, a run spec (JSON) on stdin, one JSON line on stdout.

The service runs this to answer `POST /v1/runs/validate` exactly (app/services/data_plan.py):
packed data has as many steps as its blocks, and an unset seq_length is chosen from the
data. Counting with a second implementation would drift from what the worker trains;
this runs the same functions, in a process of its own so that the service never imports
torch, and under limits of its own: it runs the request's chat template on the service's
host.

The answer is one of: {"examples", "seq_length", "notes"}; {"problem": ...}, the data
cannot be trained on (the worker would fail the same way); {"error": ...}, it could not be
counted here (a tokenizer that does not load, the memory bound).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
from typing import Any

from contract.run_request import RunSpec


def plan(spec: RunSpec) -> dict[str, Any]:
    from worker.data.preparation import prepare_training
    from worker.model.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(spec)
    except Exception as exc:
        return {"error": _first_line(exc)}
    notes: list[str] = []
    try:
        resolved, examples, _ = prepare_training(spec, tokenizer, notes=notes)
    except MemoryError:
        return {"error": "preparing the data went past the memory a count may take"}
    except Exception as exc:  # what the worker would fail with, at the same point
        return {"problem": _first_line(exc)}
    return {
        "examples": len(examples),
        "seq_length": resolved.training.seq_length,
        "notes": notes,
    }


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.data_plan")
    parser.add_argument("--max-data-bytes", type=int, default=None)
    parser.add_argument("--max-cpu-seconds", type=int, default=None)
    limits = parser.parse_args()
    # Bounds of this process's own, set before anything of the request runs: its template
    # is rendered here, on the service's host.
    if limits.max_data_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (limits.max_data_bytes, limits.max_data_bytes))
    if limits.max_cpu_seconds:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.max_cpu_seconds, limits.max_cpu_seconds))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        answer = plan(RunSpec.model_validate_json(sys.stdin.read()))
    except MemoryError:
        answer = {"error": "the count went past the memory it may take"}
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
