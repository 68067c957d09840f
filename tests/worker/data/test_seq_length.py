"""An unset training.seq_length is chosen from the data and the model: the longest tokenized
example rounded up to a multiple of 64, at most the model's maximum positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contract.run_request import RunSpec
from contract.seq_length import chosen_seq_length, max_positions_of, seq_length_cap
from tests.worker.conftest import write_jsonl
from worker.data.preparation import prepare_examples, prepare_training


def _spec(model: Path, data: Path, **training: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "run_id": "run_seq",
            "attempt": 1,
            "storage_path": "/unused",
            "model": str(model),
            "dataset": {"source": str(data), "text_field": "text"},
            "training": {"max_steps": 1, **training},
        }
    )


def test_the_rule() -> None:
    assert chosen_seq_length(1, 128) == 64
    assert chosen_seq_length(64, 128) == 64
    assert chosen_seq_length(65, 128) == 128
    assert chosen_seq_length(500, 128) == 128
    assert max_positions_of({"n_positions": 128}) == 128
    assert max_positions_of({"max_position_embeddings": 4096, "n_positions": 7}) == 4096
    assert max_positions_of({"model_type": "x"}) is None
    assert seq_length_cap({"model_type": "x"}) == 2048


def test_short_examples_get_a_short_length(
    tokenizer: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a few words"}, {"text": "and more"}])
    notes: list[str] = []
    spec, _, _ = prepare_training(_spec(tiny_model_dir, data), tokenizer, notes=notes)
    assert spec.training.seq_length == 64
    (note,) = notes
    assert "chose 64" in note and "no example is truncated" in note


def test_longer_examples_than_the_model_takes_are_cut_at_its_positions(
    tokenizer: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    long = " ".join(f"word{i}" for i in range(400))  # far past the tiny GPT-2's 128 positions
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": long}, {"text": "short one"}])
    notes: list[str] = []
    spec, _, _ = prepare_training(_spec(tiny_model_dir, data, packing=True), tokenizer, notes=notes)
    assert spec.training.seq_length == 128
    assert spec.training.packing  # the choice leaves the rest of the spec as it was
    assert "1 of 2 examples are longer and were truncated to it" in notes[0]
    examples, _ = prepare_examples(spec, tokenizer, split=None, notes=[])
    assert all(len(ids) == 128 for ids in examples["input_ids"])


def test_a_set_length_is_kept(tokenizer: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a few words"}])
    spec = _spec(tiny_model_dir, data, seq_length=16)
    notes: list[str] = []
    resolved, _, _ = prepare_training(spec, tokenizer, notes=notes)
    assert resolved is spec and notes == []


def test_rows_the_choice_cut_nothing_of_are_the_rows_a_pass_at_it_gives(
    tokenizer: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The choosing pass's rows are kept where it truncated nothing: the data is tokenized
    # once, and what trains is what a pass at the chosen length gives, packed included.
    rows = [{"text": " ".join(["the market rose"] * (1 + i % 5))} for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    for packing in (False, True):
        spec, examples, _ = prepare_training(
            _spec(tiny_model_dir, data, packing=packing), tokenizer, notes=[]
        )
        again, _ = prepare_examples(spec, tokenizer, split=None, notes=[])
        assert spec.training.seq_length == 64
        assert examples["input_ids"] == again["input_ids"]
        assert (
            examples["labels" if packing else "input_ids"]
            == again["labels" if packing else "input_ids"]
        )
