"""The judges of a run's score_model graders: each grader's `model` is checked as the run's
own `model` is (app/services/rules/run_rules.py), naming the grader's field, and resolved
the same way for the worker (worker/training/judge.py loads it on every rank).

A judge is a hub id (the cluster resolves it), a local model folder inside the allowed
roots, or one of the caller's earlier runs (its exported model). A local folder must hold
a config.json of a model transformers can load as a causal LM, and a tokenizer with a chat
template: the judge reads its input as chat messages. What the service cannot read (a hub
id's files, an export in object storage's tokenizer) the worker checks as it loads."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import field_problem
from app.services.rules.grader_rules import leaves
from app.services.rules.model_files import chat_template_of, trainable_model_types
from app.services.rules.path_rules import allowed_local_path
from app.storage.models import RUN_ID
from contract.datasets import is_local_source
from contract.graders.models import AnyGrader, ScoreModelGrader
from contract.run_request import source_problem
from contract.storage import Storage, StorageError, is_uri

Problem = dict[str, str]
# OpenAI's own models, which its graders name (its graders guide lists gpt-4o-2024-08-06,
# gpt-4.1-*, o1-*, o3-*, o4-mini-*): valid hub ids by their shape, on no hub. Refused here,
# rather than by the first step of a run that loaded everything else first.
_OPENAI_MODEL = re.compile(r"(?:gpt-4|gpt-4o|gpt-4\.1|gpt-5|o1|o3|o4)(?:-.*)?", re.IGNORECASE)
# An earlier run's exported model: (its location, None), or (None, why there is none).
ExportOf = Callable[[str], tuple[str | None, str | None]]


@dataclass(frozen=True, slots=True)
class Judge:
    """One score_model grader's model as the worker will load it."""

    field: str  # the request's field that names it, e.g. method.grpo.grader.model
    key: str | None  # its key in a multi grader; None for a grader on its own
    model: str  # a hub id, a local folder's real path or an export's location
    config: dict[str, Any] | None = None  # its config.json, where the service can read it

    @property
    def folder(self) -> Path | None:
        return None if self.config is None or is_uri(self.model) else Path(self.model)


def check_judges(
    grader: AnyGrader, field: str, *, roots: Sequence[Path], export_of: ExportOf
) -> tuple[list[Judge], list[Problem]]:
    """Every score_model grader's judge, resolved, and what is wrong with any of them."""
    judges: list[Judge] = []
    problems: list[Problem] = []
    for where, leaf in leaves(grader, field):
        if not isinstance(leaf, ScoreModelGrader):
            continue
        key = where.rsplit(".", 1)[-1] if where != field else None
        judge, problem = _judge(leaf.model, f"{where}.model", key, roots, export_of)
        if problem is not None:
            problems.append(field_problem(f"{where}.model", problem))
        elif judge is not None:
            judges.append(judge)
    return judges, problems


def resolved_grader(grader: dict[str, Any], judges: Sequence[Judge]) -> dict[str, Any]:
    """The stored grader (the request's, as JSON) naming each judge as the worker loads it."""
    for judge in judges:
        leaf = grader if judge.key is None else grader["graders"][judge.key]
        leaf["model"] = judge.model
    return grader


def _judge(
    value: str, field: str, key: str | None, roots: Sequence[Path], export_of: ExportOf
) -> tuple[Judge | None, str | None]:
    if RUN_ID.fullmatch(value):
        location, why = export_of(value)
        if location is None:
            return None, why
        if is_uri(location):
            try:
                config = json.loads(Storage(location).read_bytes(f"{location}/config.json"))
            except (StorageError, ValueError) as exc:
                return None, f"cannot read the export's config: {exc}"
            if (problem := _config_problem(config, value)) is not None:
                return None, problem
            return Judge(field, key, location, config), None
        return _local_judge(Path(location), value, field, key)
    if (shape := source_problem(value)) is not None:
        return None, shape
    if _OPENAI_MODEL.fullmatch(value):
        return None, (
            f"{value!r} is one of OpenAI's models, which this service cannot load: give a model "
            "the cluster can (a Hugging Face hub id such as 'Qwen/Qwen2.5-7B-Instruct', a local "
            "model folder or an earlier run's id)"
        )
    if not is_local_source(value):
        return Judge(field, key, value), None  # a hub id: the cluster resolves it
    path, message = allowed_local_path(value, roots)
    if message:
        return None, message
    assert path is not None
    return _local_judge(path, value, field, key)


def _local_judge(
    folder: Path, value: str, field: str, key: str | None
) -> tuple[Judge | None, str | None]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None, f"local model {value!r} has no config.json: give a save_pretrained folder"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return None, f"cannot read {config_file}: {exc}"
    if (problem := _config_problem(config, value)) is not None:
        return None, problem
    if chat_template_of(folder) is None:
        return None, (
            f"the tokenizer of {value!r} has no chat template, and a score_model grader's "
            "input is chat messages rendered with it: give a chat or instruct model's folder"
        )
    return Judge(field, key, str(folder), config), None


def _config_problem(config: dict[str, Any], value: str) -> str | None:
    causal = trainable_model_types("causal_lm")
    model_type = config.get("model_type")
    if causal is not None and model_type not in causal:
        return (
            f"model type {model_type!r} of {value!r} is not a causal language model, which a "
            "score_model grader's model must be: it answers with its score"
        )
    return None
