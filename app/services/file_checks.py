"""Record-by-record checks of an uploaded dataset file, with line numbers in every error."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Enough to show the pattern of what is wrong without flooding the response.
MAX_REPORTED_ERRORS = 20


@dataclass(slots=True)
class FileReport:
    records: int = 0
    fields: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    more_errors: int = 0

    def error(self, message: str) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(message)
        else:
            self.more_errors += 1


def check_file(path: Path, *, fmt: str, required: list[str], label_field: str | None) -> FileReport:
    """Parse every record; each needs the `required` fields, non-empty (labels may be numbers)."""
    report = FileReport()
    seen_fields: dict[str, None] = {}
    try:
        for where, record in _records(path, fmt, report):
            report.records += 1
            for name in record:
                seen_fields.setdefault(name, None)
            for name in required:
                problem = _field_problem(record, name, is_label=name == label_field)
                if problem:
                    report.error(f"{where}: {problem}")
    except (ValueError, OSError, csv.Error) as exc:
        report.error(f"cannot read the file as {fmt}: {exc}")
    if report.records == 0 and not report.errors:
        report.error("the file holds no records")
    report.fields = list(seen_fields)
    return report


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


def _records(path: Path, fmt: str, report: FileReport) -> Iterator[tuple[str, dict[str, Any]]]:
    if fmt == "jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    report.error(f"line {number}: not valid JSON ({exc.msg})")
                    continue
                if not isinstance(record, dict):
                    report.error(
                        f"line {number}: expected a JSON object, got {type(record).__name__}"
                    )
                    continue
                yield f"line {number}", record
    elif fmt == "csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                # Empty CSV cells arrive as "", which the emptiness check reports.
                yield f"line {reader.line_num}", dict(row)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        number = 0
        for batch in parquet.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                number += 1
                yield f"row {number}", row
    else:
        raise ValueError(f"unknown format {fmt!r}")
