"""What a run's training data comes to, computed by the worker's own preparation:
`python -m worker.data_plan`, a run spec (JSON) on stdin, one JSON line on stdout.

The service runs this to answer `POST /v1/runs/validate` exactly (app/services/data_plan.py):
packed data has as many steps as its blocks, and an unset seq_length is chosen from the
data. Counting with a second implementation would drift from what the worker trains;
this runs the same functions, in a process of its own so that the service never imports
torch.
"""

from __future__ import annotations

import json
import logging
import sys

from contract.run_request import RunSpec


def plan(spec: RunSpec) -> dict[str, object]:
    from worker.model_setup import load_tokenizer, prepare_examples, with_seq_length

    tokenizer = load_tokenizer(spec)
    notes: list[str] = []
    resolved = with_seq_length(spec, tokenizer, notes=notes)
    examples, _ = prepare_examples(resolved, tokenizer, split=None, notes=notes)
    return {
        "examples": len(examples),
        "seq_length": resolved.training.seq_length,
        "notes": notes,
    }


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        answer = plan(RunSpec.model_validate_json(sys.stdin.read()))
    except Exception as exc:  # the service shows why it could not count, as a note
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        answer = {"error": first}
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
