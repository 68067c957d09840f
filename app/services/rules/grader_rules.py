"""Which graders a run (method grpo) or a grader route may use here, and whether the data
has what a grader reads: refused before any compute, naming the field."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from app.errors import field_problem
from contract.graders.models import AnyGrader, PythonGrader, scoring_leaves

Problem = dict[str, str]

PYTHON_OFF = (
    "python graders are off on this service: they run the code they are given, so an "
    "operator turns them on (TUNEYARD_PYTHON_GRADERS=true, with bubblewrap installed to "
    "sandbox them)"
)


def leaves(grader: AnyGrader, field: str) -> list[tuple[str, AnyGrader]]:
    """The graders that score (a multi grader's, or the grader itself), each with the field
    that names it."""
    return [
        (field if key is None else f"{field}.graders.{key}", leaf)
        for key, leaf in scoring_leaves(grader)
    ]


def python_graders_in(grader: AnyGrader, field: str) -> list[tuple[str, PythonGrader]]:
    return [(f, g) for f, g in leaves(grader, field) if isinstance(g, PythonGrader)]


def runnable_problems(grader: AnyGrader, field: str, *, python_graders: bool) -> list[Problem]:
    """What of `grader` this service cannot run: Python graders where the operator left
    them off. (A score_model grader runs in training, its model checked by judge_rules.py;
    the grader routes report it as a model_grader_server_error: the service loads no
    model.)"""
    return [
        field_problem(f"{where}.type", PYTHON_OFF)
        for where, leaf in leaves(grader, field)
        if isinstance(leaf, PythonGrader) and not python_graders
    ]


def item_roots(grader: AnyGrader) -> list[str]:
    """The record fields a grader reads at the top level ({{item.answer.text}} reads
    `answer`), in a stable order."""
    return sorted({field.split(".", 1)[0] for field in grader.item_fields()})


def missing_item_fields(grader: AnyGrader, fields: Iterable[str]) -> list[str]:
    """The top-level record fields the grader reads that `fields` (a file's) lack."""
    have = set(fields)
    return [name for name in item_roots(grader) if name not in have]


def record_item_problem(grader: AnyGrader, record: Mapping[str, Any]) -> str | None:
    """Why one record cannot be graded for want of a field the grader reads, or None. A
    path is followed as the grader follows it (contract/graders/templates.py: keys, and
    list indices), and a null counts as absent, as everywhere in a record
    (contract/records.py): the worker reads records through Arrow, which fills a field
    that some records lack with null, so the grader would read it as the text "null"."""
    for dotted in sorted(grader.item_fields()):
        value: Any = record
        keys = dotted.split(".")
        for depth, key in enumerate(keys, start=1):
            if isinstance(value, Mapping) and key in value:
                value = value[key]
            elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                value = value[int(key)]
            else:
                return (
                    f"record has no field {dotted!r}, which the grader reads as "
                    f"{{{{item.{dotted}}}}}"
                )
            if value is None:
                null = ".".join(keys[:depth])
                return (
                    f"record's field {null!r} is null (which counts as absent), and the "
                    f"grader reads {{{{item.{dotted}}}}}"
                )
    return None
