"""Record-by-record checks of an uploaded dataset file, with line numbers in every error."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from contract.datasets import Purpose, required_fields
from contract.records import (
    chat_record_problem,
    preference_record_problem,
    prompt_record_problem,
)

# Enough to show the pattern of what is wrong without flooding the response.
MAX_REPORTED_ERRORS = 20
# One record is one training example. A line longer than this is almost surely not one, and
# reading it would hold all of it in memory at once (an upload may be a single 1 GiB line).
MAX_LINE_BYTES = 16 << 20
_SKIP_CHUNK = 1 << 20


class _LineTooLong(ValueError):
    def __init__(self, number: int) -> None:
        super().__init__(
            f"line {number}: longer than the {MAX_LINE_BYTES}-byte limit for one record"
        )


@dataclass(slots=True)
class FileReport:
    records: int = 0
    fields: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    more_errors: int = 0
    # The check stopped at its `limit` with records still to read.
    limited: bool = False

    def error(self, message: str) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(message)
        else:
            self.more_errors += 1


RecordProblem = Callable[[dict[str, Any]], str | None]
# A file's bytes from its start, opened anew at each call: a local file, or one in storage.
Opener = Callable[[], BinaryIO]
# Called with each record checked and where it is ("line 3", "row 3").
RecordVisitor = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class RecordChecks:
    """What every record of an upload is checked for."""

    # Fields that must hold non-empty text (the label field: an integer or a string).
    required: list[str] = field(default_factory=list)
    label_field: str | None = None
    # A purpose's rule for the whole record (chat, preference), whose fields hold lists and
    # objects that the text rule above would refuse.
    record_problem: RecordProblem | None = None
    # The records hold lists of messages, which CSV cells cannot.
    nested: bool = False


def checks_for(
    purpose: Purpose,
    *,
    text_field: str = "text",
    text_pair_field: str | None = None,
    label_field: str = "label",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    messages_field: str = "messages",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
) -> RecordChecks:
    """The checks of an upload for `purpose`, the record fields named as a run names them."""
    if purpose == "chat":
        rule = partial(chat_record_problem, messages_field=messages_field)
        return RecordChecks(record_problem=rule, nested=True)
    if purpose == "preference":
        # Prompts and answers may be plain text, so a CSV file can hold preference pairs.
        rule = partial(
            preference_record_problem,
            prompt_field=prompt_field,
            chosen_field=chosen_field,
            rejected_field=rejected_field,
        )
        return RecordChecks(record_problem=rule)
    if purpose == "prompt":
        # A prompt may be plain text, so a CSV file can hold prompts (and the grader's fields).
        return RecordChecks(
            record_problem=partial(prompt_record_problem, prompt_field=prompt_field)
        )
    fields = required_fields(
        purpose,
        text_field=text_field,
        prompt_field=prompt_field,
        completion_field=completion_field,
        label_field=label_field,
        text_pair_field=text_pair_field,
    )
    return RecordChecks(
        required=[f.name for f in fields],
        label_field=label_field if purpose == "sequence_classification" else None,
    )


def check_file(
    path: Path, *, fmt: str, checks: RecordChecks, limit: int | None = None
) -> FileReport:
    """Parse every record (the first `limit` with one) and check it (see RecordChecks),
    one record at a time."""
    return check_records(lambda: path.open("rb"), fmt=fmt, checks=checks, limit=limit)


def check_records(
    open_file: Opener,
    *,
    fmt: str,
    checks: RecordChecks,
    limit: int | None = None,
    visit: RecordVisitor | None = None,
) -> FileReport:
    """`check_file` of the file `open_file` opens; `visit` sees each record checked."""
    report = FileReport()
    if checks.nested and fmt == "csv":
        report.error(
            "a CSV file cannot hold chat records: its cells are text, not lists of messages; "
            "upload .jsonl or .parquet"
        )
        return report
    seen_fields: dict[str, None] = {}
    try:
        for where, record in _records(open_file, fmt, report):
            if limit is not None and report.records >= limit:
                report.limited = True
                break
            report.records += 1
            for name in record:
                if problem := _field_name_problem(name):
                    report.error(f"{where}: the field name {name!r} {problem}")
                else:
                    seen_fields.setdefault(name, None)
            for problem in _record_problems(record, checks):
                report.error(f"{where}: {problem}")
            if visit is not None:
                visit(where, record)
    except _LineTooLong as exc:
        report.error(str(exc))
    except (ValueError, OSError, csv.Error, RecursionError) as exc:
        # RecursionError: a parquet reader may recurse into nested columns as json does.
        report.error(f"cannot read the file as {fmt}: {exc}")
    if report.records == 0 and not report.errors:
        report.error("the file holds no records")
    report.fields = list(seen_fields)
    return report


def _field_name_problem(name: str) -> str | None:
    """Field names are stored with the file and served in its listing: one that UTF-8
    cannot encode (JSON's lone surrogate escapes, "\\ud800") or PostgreSQL's text cannot
    hold (NUL) would fail there, after the file was stored."""
    if "\x00" in name:
        return "holds a NUL character"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate escape)"
    return None


# OpenAI's purpose for every fine-tuning file; the records say which kind they are.
FINE_TUNE = "fine-tune"


def detect_purpose(path: Path, *, fmt: str) -> Purpose | None:
    """What an upload with OpenAI's purpose "fine-tune" holds, from its first record, as
    OpenAI tells its formats apart: chat (`messages`), reinforcement prompts (`messages`
    ending with a turn other than the assistant's: "prompt", its prompt in `messages`),
    preference pairs (`prompt`, `chosen`, `rejected`: DPO), prompt/completion pairs, or
    plain `text`; None when the
    first record is none of these (or cannot be read)."""
    try:
        first = next(iter(_records(lambda: path.open("rb"), fmt, FileReport())), None)
    except (ValueError, OSError, csv.Error, RecursionError):
        return None
    if first is None:
        return None
    record = first[1]
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        # OpenAI's reinforcement data: a conversation ending with the turn to answer.
        if isinstance(last, dict) and last.get("role") != "assistant":
            return "prompt"
        return "chat"
    if "messages" in record:
        return "chat"
    if {"prompt", "chosen", "rejected"} <= record.keys():
        return "preference"
    if {"prompt", "completion"} <= record.keys():
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def _record_problems(record: dict[str, Any], checks: RecordChecks) -> Iterator[str]:
    for name in checks.required:
        if problem := _field_problem(record, name, is_label=name == checks.label_field):
            yield problem
    if checks.record_problem and (problem := checks.record_problem(record)):
        yield problem


def _field_problem(record: dict[str, Any], name: str, *, is_label: bool) -> str | None:
    if name not in record or record[name] is None:
        return f"missing field {name!r}"
    value = record[name]
    if is_label:
        if isinstance(value, bool) or not isinstance(value, int | str):
            return (
                f"field {name!r} must be an integer or a string label, got {type(value).__name__}"
            )
        return None
    if not isinstance(value, str):
        return f"field {name!r} must be text, got {type(value).__name__}"
    if not value.strip():
        return f"field {name!r} is empty"
    return None


def _records(
    open_file: Opener, fmt: str, report: FileReport
) -> Iterator[tuple[str, dict[str, Any]]]:
    if fmt == "jsonl":
        with open_file() as f:
            yield from _jsonl_records(f, report)
    elif fmt == "csv":
        with open_file() as f:
            reader = csv.DictReader(_csv_lines(f))
            try:
                for row in reader:
                    # Empty CSV cells arrive as "", which the emptiness check reports.
                    yield f"line {reader.line_num}", dict(row)
            except csv.Error as exc:
                raise csv.Error(f"line {reader.line_num}: {exc}") from exc
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        with open_file() as f:
            parquet = pq.ParquetFile(f)
            number = 0
            for batch in parquet.iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    number += 1
                    yield f"row {number}", row
    else:
        raise ValueError(f"unknown format {fmt!r}")


def _jsonl_records(f: BinaryIO, report: FileReport) -> Iterator[tuple[str, dict[str, Any]]]:
    for number, raw in enumerate(_lines(f), start=1):
        if raw is None:
            report.error(str(_LineTooLong(number)))
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            report.error(f"line {number}: not valid UTF-8 ({exc.reason} at byte {exc.start})")
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            report.error(f"line {number}: not valid JSON ({exc.msg})")
            continue
        except RecursionError:
            # json recurses once per level of nesting: `[[[[…]]]]` thousands deep would
            # otherwise escape as a 500. No training record nests that deep.
            report.error(f"line {number}: JSON nested too deeply")
            continue
        if not isinstance(record, dict):
            report.error(f"line {number}: expected a JSON object, got {type(record).__name__}")
            continue
        yield f"line {number}", record


def _csv_lines(f: BinaryIO) -> Iterator[str]:
    for number, raw in enumerate(_lines(f), start=1):
        if raw is None:
            # csv needs every line in order (a quoted cell may span several): stop here.
            raise _LineTooLong(number)
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"line {number}: not valid UTF-8 ({exc.reason})") from exc


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """Physical lines, newline kept; `None` stands for a line over MAX_LINE_BYTES, which is
    skipped in chunks rather than read whole."""
    while line := f.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while (rest := f.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
            pass
        yield None
