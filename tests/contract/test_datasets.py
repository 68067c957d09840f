"""contract/datasets.py: the data rules the service checks up front and the worker applies."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from contract.datasets import (
    FILE_FORMATS,
    fields_read_by,
    file_format,
    is_local_source,
    is_uploaded,
    local_split_problem,
    purpose_of,
    required_fields,
)
from contract.run_request import DatasetSpec


class TestFiles:
    @pytest.mark.parametrize(
        ("name", "fmt", "builder"),
        [
            ("a.jsonl", "jsonl", "json"),
            ("a.JSON", "jsonl", "json"),
            ("d/a.csv", "csv", "csv"),
            ("a.parquet", "parquet", "parquet"),
        ],
    )
    def test_each_suffix_has_an_upload_format_and_a_datasets_builder(
        self, name: str, fmt: str, builder: str
    ) -> None:
        found = file_format(name)
        assert found is not None
        assert (found.name, found.builder) == (fmt, builder)

    def test_other_files_are_not_datasets(self) -> None:
        assert file_format("notes.txt") is None
        assert ".txt" not in FILE_FORMATS

    @pytest.mark.parametrize("source", ["/d.jsonl", "./d", "../d"])
    def test_paths_are_local(self, source: str) -> None:
        assert is_local_source(source) and not is_uploaded(source)

    @pytest.mark.parametrize("source", ["~/d.jsonl", "~root/d.jsonl"])
    def test_home_folders_are_refused_not_expanded(self, source: str) -> None:
        # Whose home `~` would name (the service's, a worker's, any user's) is not the
        # client's to choose; the worker once expanded it.
        assert not is_local_source(source)
        with pytest.raises(ValidationError, match="home folders are not expanded"):
            DatasetSpec(source=source)

    @pytest.mark.parametrize("source", [".", "..", "./", "../", "data/.."])
    def test_dot_folders_are_neither_hub_ids_nor_silently_local(self, source: str) -> None:
        # `.` and `..` as hub ids were loaded from the worker's working directory.
        if source.endswith("/"):
            assert is_local_source(source)  # spelled as paths: checked against the roots
        else:
            with pytest.raises(ValidationError, match="neither a local path"):
                DatasetSpec(source=source)

    def test_hub_ids_and_uploads_are_not_local(self) -> None:
        assert not is_local_source("fancyzhx/ag_news")
        assert is_uploaded("file_0123") and not is_local_source("file_0123")


class TestSplits:
    @pytest.mark.parametrize("split", ["train", "train[:90%]", "train[90%:]"])
    def test_train_and_its_slices_are_fine(self, split: str) -> None:
        assert local_split_problem("split", split) is None

    @pytest.mark.parametrize("split", ["train_sft", "training", "trainX", "train[:10"])
    def test_names_that_only_start_like_train_are_refused(self, split: str) -> None:
        # A hub dataset's split name copied onto a local file: datasets refuses it on the
        # cluster ("Unknown split"), after placement and loading.
        problem = local_split_problem("split", split)
        assert problem is not None and problem.startswith(f"split {split!r}")

    def test_other_splits_name_the_setting_and_the_way_out(self) -> None:
        problem = local_split_problem("eval_split", "validation")
        assert problem is not None
        assert problem.startswith("eval_split 'validation'")
        assert "train[90%:]" in problem


class TestRequiredFields:
    def test_text(self) -> None:
        fields = fields_read_by("causal_lm", DatasetSpec(source="/d", text_field="body"))
        assert fields == [("body", "dataset.text_field")]

    def test_prompt_completion(self) -> None:
        spec = DatasetSpec(source="/d", format="prompt_completion", prompt_field="q")
        assert [f.name for f in fields_read_by("causal_lm", spec)] == ["q", "completion"]

    def test_classification_with_pairs(self) -> None:
        spec = DatasetSpec(source="/d", text_pair_field="b", label_field="y")
        fields = fields_read_by("sequence_classification", spec)
        assert [(f.name, f.setting) for f in fields] == [
            ("text", "dataset.text_field"),
            ("b", "dataset.text_pair_field"),
            ("y", "dataset.label_field"),
        ]

    def test_an_upload_and_a_run_of_the_same_purpose_read_the_same_fields(self) -> None:
        spec = DatasetSpec(source="/d", label_field="label")
        purpose = purpose_of("sequence_classification", spec.format)
        assert required_fields(purpose) == fields_read_by("sequence_classification", spec)
