"""worker/data/loading.py: loading local datasets, tokenizing, and collating causal-LM batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from contract.run_request import DatasetSpec
from tests.worker.conftest import in_memory_dataset, write_jsonl
from worker.data.loading import CausalLMCollator, load_raw_dataset, tokenize_dataset

LINES = [
    "The Lions beat the Tigers in Paris on Monday.",
    "Acme shares rose 3 percent on Friday after strong results.",
    "Heavy rain in Oslo closed schools on Tuesday.",
    "Globex will open a new office in Lima next year.",
    "Markets in Perth fell 2 percent as Hooli cut its forecast.",
]


def text_rows(lines: list[str]) -> list[dict[str, Any]]:
    return [{"text": line, "source": f"wire-{i}"} for i, line in enumerate(lines)]


class TestCausalLMCollator:
    def test_pads_to_the_longest_in_the_batch_not_to_seq_length(self, tokenizer: Any) -> None:
        texts = ["Rain in Oslo.", LINES[1], "The Lions won."]
        dataset = tokenize_dataset(
            in_memory_dataset({"text": texts}), tokenizer, text_field="text", seq_length=100
        )
        rows = [dataset[i] for i in range(len(dataset))]
        lengths = [len(r["input_ids"]) for r in rows]
        assert len(set(lengths)) == 3

        batch = CausalLMCollator(pad_token_id=tokenizer.pad_token_id)(rows)

        assert max(lengths) < 100
        assert batch["input_ids"].shape == (3, max(lengths))
        assert batch["attention_mask"].shape == (3, max(lengths))
        assert batch["labels"].shape == (3, max(lengths))
        assert batch["input_ids"].dtype == torch.long
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            assert batch["input_ids"][i, :n].tolist() == row["input_ids"]
            assert batch["input_ids"][i, n:].tolist() == [tokenizer.pad_token_id] * (
                max(lengths) - n
            )
            assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (max(lengths) - n)

    def test_labels_are_masked_exactly_on_padding(self) -> None:
        rows = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}, {"input_ids": [11, 12, 13]}]

        batch = CausalLMCollator(pad_token_id=0)(rows)

        assert batch["labels"].tolist() == [
            [5, 6, 7, 8],
            [9, 10, -100, -100],
            [11, 12, 13, -100],
        ]
        mask = batch["attention_mask"] == 1
        assert torch.equal(batch["labels"][mask], batch["input_ids"][mask])
        assert (batch["labels"][~mask] == -100).all()

    def test_pad_equal_to_a_real_token_keeps_that_token_as_a_target(self, tokenizer: Any) -> None:
        """Causal LMs without a pad token pad with eos; an eos in the text is still learnt."""
        eos = tokenizer.eos_token_id
        long_ids = tokenizer("The Lions won.<|endoftext|>Rain in Oslo.<|endoftext|>").input_ids
        short_ids = tokenizer("Rain.<|endoftext|>").input_ids
        assert long_ids.count(eos) == 2 and short_ids[-1] == eos

        batch = CausalLMCollator(pad_token_id=eos)(
            [{"input_ids": long_ids}, {"input_ids": short_ids}]
        )

        assert batch["labels"][0].tolist() == long_ids
        padding = len(long_ids) - len(short_ids)
        assert batch["labels"][1].tolist() == short_ids + [-100] * padding
        assert batch["attention_mask"][1].tolist() == [1] * len(short_ids) + [0] * padding

    def test_rows_of_equal_length_get_no_padding(self) -> None:
        batch = CausalLMCollator(pad_token_id=1)([{"input_ids": [3, 4]}, {"input_ids": [5, 6]}])
        assert batch["labels"].tolist() == [[3, 4], [5, 6]]
        assert batch["attention_mask"].tolist() == [[1, 1], [1, 1]]


class TestLoadRawDataset:
    def test_jsonl_file(self, tmp_path: Path) -> None:
        path = write_jsonl(tmp_path / "train.jsonl", text_rows(LINES))

        dataset = load_raw_dataset(DatasetSpec(source=str(path)))

        assert dataset["text"] == LINES
        assert sorted(dataset.column_names) == ["source", "text"]

    def test_csv_file(self, tmp_path: Path) -> None:
        path = tmp_path / "train.csv"
        pd.DataFrame({"id": range(len(LINES)), "body": LINES}).to_csv(path, index=False)

        dataset = load_raw_dataset(DatasetSpec(source=str(path), text_field="body"))

        assert dataset["body"] == LINES
        assert dataset["id"] == list(range(len(LINES)))

    def test_parquet_file(self, tmp_path: Path) -> None:
        path = tmp_path / "train.parquet"
        pd.DataFrame({"text": LINES, "label": [0, 1, 0, 1, 1]}).to_parquet(path)

        dataset = load_raw_dataset(DatasetSpec(source=str(path)))

        assert dataset["text"] == LINES
        assert dataset["label"] == [0, 1, 0, 1, 1]

    def test_folder_of_jsonl_files(self, tmp_path: Path) -> None:
        folder = tmp_path / "shards"
        folder.mkdir()
        write_jsonl(folder / "part-001.jsonl", text_rows(LINES[3:]))
        write_jsonl(folder / "part-000.jsonl", text_rows(LINES[:3]))
        (folder / "README.md").write_text("not data")

        dataset = load_raw_dataset(DatasetSpec(source=str(folder)))

        # Files are read in name order, so every rank sees the same rows in the same order.
        assert dataset["text"] == LINES

    def test_folder_mixing_file_types_is_refused(self, tmp_path: Path) -> None:
        folder = tmp_path / "mixed"
        folder.mkdir()
        write_jsonl(folder / "a.jsonl", text_rows(LINES[:2]))
        pd.DataFrame({"text": LINES[2:]}).to_csv(folder / "b.csv", index=False)

        with pytest.raises(ValueError, match=r"a\.jsonl.*b\.csv"):
            load_raw_dataset(DatasetSpec(source=str(folder)))

    def test_folder_without_data_files_is_refused(self, tmp_path: Path) -> None:
        folder = tmp_path / "empty"
        folder.mkdir()
        (folder / "notes.txt").write_text("hello")

        with pytest.raises(ValueError, match="holds no"):
            load_raw_dataset(DatasetSpec(source=str(folder)))

    def test_missing_text_field_names_it_and_the_fields_present(self, tmp_path: Path) -> None:
        path = write_jsonl(tmp_path / "d.jsonl", [{"title": "t", "body": line} for line in LINES])

        with pytest.raises(ValueError) as err:
            load_raw_dataset(DatasetSpec(source=str(path), text_field="text"))

        message = str(err.value)
        assert "'text'" in message
        assert "title" in message
        assert "body" in message

    @pytest.mark.parametrize(("max_samples", "expected"), [(2, 2), (5, 5), (50, 5)])
    def test_max_samples_truncates(self, tmp_path: Path, max_samples: int, expected: int) -> None:
        path = write_jsonl(tmp_path / "d.jsonl", text_rows(LINES))

        dataset = load_raw_dataset(DatasetSpec(source=str(path), max_samples=max_samples))

        assert dataset["text"] == LINES[:expected]


class TestTokenizeDataset:
    def test_drops_examples_under_two_tokens(self, tokenizer: Any) -> None:
        assert len(tokenizer("a").input_ids) == 1
        texts = [LINES[0], "", "a", None, "Rain in Oslo.", "<|endoftext|>"]

        tokenized = tokenize_dataset(
            in_memory_dataset({"text": texts}), tokenizer, text_field="text", seq_length=64
        )

        assert tokenized.column_names == ["input_ids"]
        assert tokenized["input_ids"] == [
            tokenizer(LINES[0]).input_ids,
            tokenizer("Rain in Oslo.").input_ids,
        ]

    def test_truncates_to_seq_length(self, tokenizer: Any) -> None:
        long_text = " ".join(LINES)
        full = tokenizer(long_text).input_ids
        assert len(full) > 8

        tokenized = tokenize_dataset(
            in_memory_dataset({"body": [long_text, "Rain in Oslo."]}),
            tokenizer,
            text_field="body",
            seq_length=8,
        )

        assert tokenized["input_ids"][0] == full[:8]
        assert all(len(ids) <= 8 for ids in tokenized["input_ids"])

    def test_nothing_long_enough_is_refused(self, tokenizer: Any) -> None:
        with pytest.raises(ValueError, match="at least 2 tokens"):
            tokenize_dataset(
                in_memory_dataset({"text": ["a", ""]}), tokenizer, text_field="text", seq_length=16
            )

    def test_loaded_then_tokenized_then_collated(self, tmp_path: Path, tokenizer: Any) -> None:
        path = write_jsonl(tmp_path / "d.jsonl", text_rows(LINES))
        raw = load_raw_dataset(DatasetSpec(source=str(path), max_samples=3))
        tokenized = tokenize_dataset(raw, tokenizer, text_field="text", seq_length=10)

        batch = CausalLMCollator(pad_token_id=tokenizer.pad_token_id)(list(tokenized))

        assert batch["input_ids"].shape[0] == 3
        assert batch["input_ids"].shape[1] <= 10
        assert batch["input_ids"][0].tolist() == tokenizer(LINES[0]).input_ids[:10]
