"""One rank raises alone; its peer waits in the step's collective. The run must end at once
with that rank's own error, as a training error, and not be retried.

The failing row is real bad data: a model whose embedding is smaller than its tokenizer's
vocabulary. A row of rare characters tokenizes into byte tokens the model knows; a row of
ordinary words into merged tokens past its embedding, so only the rank that reads it fails
(IndexError in the embedding lookup) while the other rank goes on into the gradient
all-reduce of ZeRO-2 and waits there.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Service

pytestmark = pytest.mark.e2e

MODEL_VOCAB = 300  # the tokenizer has 512: byte tokens are 2..257, merges 258..511


@pytest.fixture(scope="module")
def short_vocab_model(tiny_models_root: Path, tiny_model_dir: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    folder = tiny_models_root / "gpt2-short-vocab"
    if not (folder / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        config = GPT2Config(
            vocab_size=MODEL_VOCAB,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=2,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def _events(service: Service, run_id: str) -> list[dict[str, Any]]:
    return list(service.http.get(f"/v1/runs/{run_id}/events").json()["data"])


def test_a_rank_that_fails_alone_ends_the_run_with_its_own_error(
    service: Service, short_vocab_model: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(short_vocab_model)
    safe, bad = "~^ ~^ `| `|", "the market rallied after the announcement"
    assert max(tokenizer(safe)["input_ids"]) < MODEL_VOCAB <= max(tokenizer(bad)["input_ids"])
    data = service.data_dir / "one-bad-row.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in (safe, bad)))

    run_id = service.submit(
        {
            "model": str(short_vocab_model),
            "dataset": {"source": str(data)},
            # One row per rank: exactly one rank reads the bad row in the first step.
            "training": {"max_steps": 1, "batch_size_per_worker": 1, "seq_length": 32},
            "deepspeed": {"zero_stage": 2},
            "resources": {"num_workers": 2},
            "checkpointing": {"export_hf": False},
            "fault_tolerance": {"max_failures": 2, "max_resubmits": 2},
        }
    )["id"]
    run = service.wait_terminal(run_id, timeout_s=300)

    assert run["status"] == "failed", run
    assert run["error"]["code"] == "training_error"
    # The failing rank's own words, not a peer's collective error or a Ray wrapper.
    message = run["error"]["message"]
    assert message.startswith("worker rank "), message
    assert "IndexError" in message and "index out of range" in message, message
    # Not retried: neither by Ray inside the job nor by the service with a new attempt.
    assert run["attempt"] == 1
    assert not [e for e in _events(service, run_id) if "resubmit" in e["message"]]
    # Ended within a minute of the engines being ready (the first step comes right after),
    # not at the 30-minute collective timeout.
    ready = [e for e in _events(service, run_id) if e["type"] == "engine_ready"]
    assert ready, _events(service, run_id)
    waited = datetime.fromisoformat(run["finished_at"]) - max(
        datetime.fromisoformat(e["created_at"]) for e in ready
    )
    assert waited.total_seconds() < 60, waited
