"""A step is the mean over its tokens: however a step's rows are split over micro-batches,
workers and tensor-parallel ranks, tuneyard's per-step loss equals Hugging Face Trainer's
on the same rows as one batch of 4 (transformers >= 4.46 normalises by the step's targets).

Four rows of very different lengths, a tiny Llama (no dropout), fp32, AdamW, a constant
learning rate and no weight decay; every optimizer step sees all four rows, so the order
in which a shuffle deals them cannot change a step's loss.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Service
from tests.e2e.helpers import assert_succeeded, metric_series, trainer_losses

pytestmark = pytest.mark.e2e

STEPS = 6
SEQ_LENGTH = 128
LEARNING_RATE = 3e-3
TOLERANCE = 1e-4
# Words per row: one short row, two medium, one that fills seq_length.
ROW_WORDS = (2, 12, 30, 200)


def _words(rng: random.Random, n: int) -> str:
    vocabulary = ["market", "team", "season", "city", "price", "goal", "vote", "storm", "bank"]
    return " ".join(rng.choice(vocabulary) for _ in range(n))


@pytest.fixture(scope="module")
def text_rows(service: Service) -> Path:
    rng = random.Random(5)
    path = service.data_dir / "uneven.jsonl"
    path.write_text("".join(json.dumps({"text": _words(rng, n)}) + "\n" for n in ROW_WORDS))
    return path


@pytest.fixture(scope="module")
def prompt_completion_rows(service: Service) -> Path:
    rng = random.Random(6)
    path = service.data_dir / "uneven-pc.jsonl"
    lengths = [(3, 1), (10, 2), (2, 12), (5, 20)]  # (prompt words, completion words)
    path.write_text(
        "".join(
            json.dumps({"prompt": _words(rng, p), "completion": " " + _words(rng, c)}) + "\n"
            for p, c in lengths
        )
    )
    return path


def _tuneyard_losses(service: Service, model: Path, data: Path, **groups: Any) -> list[float]:
    body: dict[str, Any] = {
        "model": str(model),
        "dataset": {"source": str(data)},
        "training": {
            "max_steps": STEPS,
            "learning_rate": LEARNING_RATE,
            "seq_length": SEQ_LENGTH,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
        },
        "deepspeed": {"precision": "fp32"},
        "checkpointing": {"export_hf": False},
        "fault_tolerance": {"max_failures": 0},
    }
    for name, values in groups.items():
        body[name] = {**body.get(name, {}), **values}
    run = service.wait_terminal(service.submit(body)["id"])
    assert_succeeded(service, run)
    losses = metric_series(service, run["id"], "loss")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return [losses[step] for step in range(1, STEPS + 1)]


def _reference_losses(model_dir: Path, rows: list[dict[str, list[int]]], out: Path) -> list[float]:
    """Hugging Face Trainer, one process, batch 4: its logged loss of every step."""
    return trainer_losses(model_dir, rows, out, steps=STEPS, learning_rate=LEARNING_RATE)


def _text_reference_rows(
    model_dir: Path, data: Path, seq_length: int = SEQ_LENGTH
) -> list[dict[str, list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    ids = tokenizer(texts, truncation=True, max_length=seq_length)["input_ids"]
    return [{"input_ids": row, "labels": row} for row in ids]


def _prompt_completion_reference_rows(model_dir: Path, data: Path) -> list[dict[str, list[int]]]:
    """prompt + completion + eos, the loss on the completion and eos only."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for line in data.read_text().splitlines():
        record = json.loads(line)
        prompt = tokenizer(record["prompt"])["input_ids"]
        target = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        target = [*target, tokenizer.eos_token_id]
        rows.append({"input_ids": prompt + target, "labels": [-100] * len(prompt) + target})
    # Nothing truncated: the rows are the same whatever tuneyard would cut.
    assert max(len(r["input_ids"]) for r in rows) <= SEQ_LENGTH
    return rows


def _packed_reference_rows(model_dir: Path, data: Path, seq_length: int) -> list[dict[str, Any]]:
    """The rows, each ending in eos, laid out by transformers' padding-free collator (each
    row's positions from 0, its first token no target) and cut into full blocks, the rest
    dropped. A row cut by a block boundary keeps counting its positions there; with
    rotary positions only their differences matter."""
    from transformers import AutoTokenizer, DataCollatorWithFlattening

    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    rows = [
        {"input_ids": ids if ids[-1] == eos else [*ids, eos]}
        for ids in (r["input_ids"] for r in _text_reference_rows(model_dir, data, seq_length))
    ]
    flat = DataCollatorWithFlattening(return_tensors="pt")(rows)
    columns = {k: flat[k][0].tolist() for k in ("input_ids", "labels", "position_ids")}
    starts = range(0, len(columns["input_ids"]) // seq_length * seq_length, seq_length)
    return [{k: v[s : s + seq_length] for k, v in columns.items()} for s in starts]


def _assert_matches(got: list[float], expected: list[float]) -> None:
    gaps = [abs(a - b) for a, b in zip(got, expected, strict=True)]
    assert max(gaps) < TOLERANCE, list(zip(got, expected, strict=True))


@pytest.fixture(scope="module")
def text_reference(tiny_llama_dir: Path, text_rows: Path, tmp_path_factory: Any) -> list[float]:
    rows = _text_reference_rows(tiny_llama_dir, text_rows)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    assert lengths[0] < 8 and lengths[-1] == SEQ_LENGTH, lengths  # really uneven
    return _reference_losses(tiny_llama_dir, rows, tmp_path_factory.mktemp("hf-text"))


@pytest.mark.parametrize(
    ("workers", "batch", "accum", "zero_stage"),
    # (One micro-batch of all four rows needs no normalising across micro-batches; ZeRO-1
    # is proven by the packing case below.)
    [(1, 2, 2, 2), (2, 1, 2, 3)],
    ids=["batch2-accum2", "2workers-batch1-accum2"],
)
def test_text_matches_trainers_batch_of_four(
    service: Service,
    tiny_llama_dir: Path,
    text_rows: Path,
    text_reference: list[float],
    workers: int,
    batch: int,
    accum: int,
    zero_stage: int,
) -> None:
    got = _tuneyard_losses(
        service,
        tiny_llama_dir,
        text_rows,
        training={"batch_size_per_worker": batch, "gradient_accumulation_steps": accum},
        deepspeed={"zero_stage": zero_stage},
        resources={"num_workers": workers},
    )
    _assert_matches(got, text_reference)


def test_autotp_counts_a_tensor_parallel_groups_batch_once(
    service: Service, tiny_llama_dir: Path, text_rows: Path, text_reference: list[float]
) -> None:
    got = _tuneyard_losses(
        service,
        tiny_llama_dir,
        text_rows,
        training={"batch_size_per_worker": 2, "gradient_accumulation_steps": 2},
        deepspeed={"zero_stage": 2, "tensor_parallel_size": 2},
        resources={"num_workers": 2},
    )
    _assert_matches(got, text_reference)


def test_prompt_completion_weighs_completion_tokens(
    service: Service, tiny_llama_dir: Path, prompt_completion_rows: Path, tmp_path: Path
) -> None:
    rows = _prompt_completion_reference_rows(tiny_llama_dir, prompt_completion_rows)
    expected = _reference_losses(tiny_llama_dir, rows, tmp_path)
    got = _tuneyard_losses(
        service,
        tiny_llama_dir,
        prompt_completion_rows,
        dataset={"format": "prompt_completion"},
        training={"batch_size_per_worker": 1, "gradient_accumulation_steps": 2},
        deepspeed={"zero_stage": 2},
        resources={"num_workers": 2},
    )
    _assert_matches(got, expected)


def test_packing_matches_trainer_on_the_same_blocks(
    service: Service, tiny_llama_dir: Path, text_rows: Path, tmp_path: Path
) -> None:
    # A block length that packs the rows into exactly four blocks: one step sees them all.
    seq_length = next(
        n
        for n in range(64, 8, -1)
        if len(_packed_reference_rows(tiny_llama_dir, text_rows, n)) == 4
    )
    rows = _packed_reference_rows(tiny_llama_dir, text_rows, seq_length)
    expected = _reference_losses(tiny_llama_dir, rows, tmp_path)
    got = _tuneyard_losses(
        service,
        tiny_llama_dir,
        text_rows,
        training={
            "packing": True,
            "seq_length": seq_length,
            "batch_size_per_worker": 1,
            "gradient_accumulation_steps": 2,
        },
        deepspeed={"zero_stage": 1},
        resources={"num_workers": 2},
    )
    _assert_matches(got, expected)
