"""Rules about a run's data that the service checks before a run and the worker applies
during it: which files are datasets, which fields a run reads, and what splits exist."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal, NamedTuple

from contract.run_request import LOCAL_SOURCE_PREFIXES, DatasetSpec

# A run's `dataset.source` naming an uploaded file (POST /v1/files) starts with this.
FILE_ID_PREFIX = "file_"

# What an uploaded file is checked for; each matches a (task, dataset.format) pair.
Purpose = Literal[
    "text", "prompt_completion", "sequence_classification", "chat", "preference", "prompt"
]


@dataclass(frozen=True, slots=True)
class FileFormat:
    name: str  # what an upload records as its format
    builder: str  # the `datasets` builder that reads it


_JSONL = FileFormat("jsonl", "json")
# By file suffix: every kind of local or uploaded dataset file tuneyard reads.
FILE_FORMATS = {
    ".jsonl": _JSONL,
    ".json": _JSONL,
    ".csv": FileFormat("csv", "csv"),
    ".parquet": FileFormat("parquet", "parquet"),
}


def file_format(path: str | PurePath) -> FileFormat | None:
    return FILE_FORMATS.get(PurePath(path).suffix.lower())


def is_local_source(source: str) -> bool:
    """A path on the cluster's file system (anything else is a hub id or an upload). The
    request schema refuses `~` paths, so a valid source is always one of the three."""
    return source.startswith(LOCAL_SOURCE_PREFIXES)


def is_uploaded(source: str) -> bool:
    return source.startswith(FILE_ID_PREFIX)


def local_split_problem(setting: str, split: str) -> str | None:
    """A local or uploaded dataset is one split, `train`; parts of it are slices."""
    # `datasets` reads a local file as the one split "train"; a name that only starts so
    # ("train_sft", a hub dataset's) fails on the cluster: "Unknown split".
    if split == "train" or (split.startswith("train[") and split.endswith("]")):
        return None
    return (
        f"{setting} {split!r}: a local or uploaded dataset is the single split 'train'; "
        "take parts of it with slices such as 'train[:90%]' and 'train[90%:]'"
    )


class RequiredField(NamedTuple):
    name: str  # the record field
    setting: str  # the request setting (or upload form field) that names it


def purpose_of(task: str, dataset_format: str) -> Purpose:
    if task == "sequence_classification":
        return "sequence_classification"
    by_format: dict[str, Purpose] = {
        "prompt_completion": "prompt_completion",
        "chat": "chat",
        "preference": "preference",
        "prompt": "prompt",
    }
    return by_format.get(dataset_format, "text")


def required_fields(
    purpose: Purpose,
    *,
    text_field: str = "text",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    label_field: str = "label",
    text_pair_field: str | None = None,
    messages_field: str = "messages",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
) -> list[RequiredField]:
    """Every record field a run (or an upload for that purpose) reads."""
    if purpose == "chat":
        return [RequiredField(messages_field, "dataset.messages_field")]
    if purpose == "preference":
        return [
            RequiredField(prompt_field, "dataset.prompt_field"),
            RequiredField(chosen_field, "dataset.chosen_field"),
            RequiredField(rejected_field, "dataset.rejected_field"),
        ]
    if purpose == "prompt":
        return [RequiredField(prompt_field, "dataset.prompt_field")]
    if purpose == "prompt_completion":
        return [
            RequiredField(prompt_field, "dataset.prompt_field"),
            RequiredField(completion_field, "dataset.completion_field"),
        ]
    fields = [RequiredField(text_field, "dataset.text_field")]
    if purpose == "sequence_classification":
        if text_pair_field:
            fields.append(RequiredField(text_pair_field, "dataset.text_pair_field"))
        fields.append(RequiredField(label_field, "dataset.label_field"))
    return fields


def fields_read_by(task: str, dataset: DatasetSpec) -> list[RequiredField]:
    return required_fields(
        purpose_of(task, dataset.format),
        text_field=dataset.text_field,
        prompt_field=dataset.prompt_field,
        completion_field=dataset.completion_field,
        label_field=dataset.label_field or "label",
        text_pair_field=dataset.text_pair_field,
        messages_field=dataset.messages_field,
        chosen_field=dataset.chosen_field,
        rejected_field=dataset.rejected_field,
    )
