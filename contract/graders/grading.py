"""One sample graded: a reward, each sub-grader's score, and what went wrong, in the shape
of OpenAI's `POST /v1/fine_tuning/alpha/graders/run` answer. A grader never raises for
what the data or the sample does: a missing field, a sample that is not JSON, a formula
with no value are flags in `errors` and a reward of 0, so a run counts them and goes on.

Python and score-model graders run elsewhere (a sandbox; a model on the cluster): the
caller passes how, or leaves them to fail as `python_grader_server_error` /
`model_grader_server_error` saying they are not available there. A training run's judges
answer on its ranks first (worker/training/judge.py); `judged` reads those answers back."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from contract.graders import formula, similarity
from contract.graders.models import (
    AnyGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from contract.graders.score_model import (
    JudgeReply,
    UnreadableScore,
    judged_leaves,
    messages_of,
    score_of,
)
from contract.graders.templates import MissingValue, RenderedTooLong, Sample, render

# How a Python grader runs: (grader, sample, item, seconds it may take) → its score; raises
# PythonGraderFailed.
PythonRunner = Callable[[PythonGrader, Sample, Any, float], float]
# How a score-model grader runs: (grader, rendered messages) → its score.
ModelScorer = Callable[[ScoreModelGrader, list[dict[str, str]]], float]


class PythonGraderFailed(Exception):
    """The grader's code raised, or the sandbox ended it (`kind`: runtime or server)."""

    def __init__(self, details: str, *, server: bool = False, kind: str | None = None) -> None:
        super().__init__(details)
        self.details = details
        self.server = server
        self.kind = kind


class ModelGraderFailed(Exception):
    def __init__(self, details: str, *, parse: bool = False) -> None:
        super().__init__(details)
        self.details = details
        self.parse = parse


@dataclass
class Errors:
    """OpenAI's error flags, every one present (its SDK requires them all)."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False

    def any(self) -> bool:
        return any(v is True for v in vars(self).values())

    def merge(self, other: Errors) -> None:
        for name, value in vars(other).items():
            if value not in (False, None) and getattr(self, name) in (False, None):
                setattr(self, name, value)


@dataclass
class Grade:
    reward: float
    name: str
    type: str
    errors: Errors = field(default_factory=Errors)
    sub_rewards: dict[str, float] = field(default_factory=dict)
    execution_time: float = 0.0

    def as_openai(self) -> dict[str, Any]:
        """The body of OpenAI's graders/run answer."""
        return {
            "reward": self.reward,
            "metadata": {
                "name": self.name,
                "type": self.type,
                "errors": vars(self.errors),
                "execution_time": self.execution_time,
                "scores": dict(self.sub_rewards),
                "token_usage": None,
                "sampled_model_name": None,
            },
            "sub_rewards": dict(self.sub_rewards),
            "model_grader_token_usage_per_model": {},
        }


@dataclass(frozen=True)
class Runners:
    """Where the graders that cannot run in-process run, if anywhere, and how long one
    grade may spend in Python graders all told (a multi grader's run in turn)."""

    python: PythonRunner | None = None
    model: ModelScorer | None = None
    python_budget_s: float = 120.0


def _score(
    grader: AnyGrader, sample: Sample, item: Any, runners: Runners, deadline: float
) -> float:
    """The grader's score; raises MissingValue, PythonGraderFailed, ModelGraderFailed."""
    match grader:
        case StringCheckGrader(operation=operation):
            given = render(grader.input, sample, item)
            reference = render(grader.reference, sample, item)
            passed = {
                "eq": given == reference,
                "ne": given != reference,
                "like": reference in given,
                "ilike": reference.casefold() in given.casefold(),
            }[operation]
            return 1.0 if passed else 0.0
        case TextSimilarityGrader(evaluation_metric=metric):
            given = render(grader.input, sample, item)
            return similarity.score(metric, given, render(grader.reference, sample, item))
        case PythonGrader():
            if runners.python is None:
                raise PythonGraderFailed(
                    "Python graders are not enabled here", server=True, kind="disabled"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise PythonGraderFailed(
                    f"the grade's {runners.python_budget_s:g} s for Python graders ran out "
                    "before this one"
                )
            return runners.python(grader, sample, item, left)
        case ScoreModelGrader():
            messages = messages_of(grader, sample, item)
            if runners.model is None:
                raise ModelGraderFailed(
                    "score_model graders are scored by the cluster during a run; this "
                    "service loads no model to score one here"
                )
            return runners.model(grader, messages)
    raise TypeError(f"not a leaf grader: {grader.type}")


def judged(
    grader: AnyGrader, replies: Mapping[str, Sequence[JudgeReply]], index: int
) -> ModelScorer:
    """The model runner of completion `index`: the answer its judge already gave (`replies`:
    by `judged_leaves`' key, one per completion), read as a score."""
    keys = {id(leaf): key for key, leaf in judged_leaves(grader)}

    def score(leaf: ScoreModelGrader, messages: list[dict[str, str]]) -> float:
        reply = replies[keys[id(leaf)]][index]
        if reply.text is None:
            raise ModelGraderFailed(reply.error or "the judge gave no answer")
        try:
            return score_of(reply.text, leaf)
        except UnreadableScore as exc:
            raise ModelGraderFailed(str(exc), parse=True) from None

    return score


def _leaf(
    grader: AnyGrader, sample: Sample, item: Any, runners: Runners, deadline: float
) -> tuple[float, Errors]:
    errors = Errors()
    try:
        score = _score(grader, sample, item, runners, deadline)
    except (similarity.TextTooLong, RenderedTooLong):
        errors.truncated_observation_error = True
        return 0.0, errors
    except MissingValue as missing:
        if missing.namespace == "sample":
            errors.sample_parse_error = True
        else:
            errors.invalid_variable_error = True
        return 0.0, errors
    except PythonGraderFailed as failed:
        if failed.server:
            errors.python_grader_server_error = True
            errors.python_grader_server_error_type = failed.kind
        else:
            errors.python_grader_runtime_error = True
            errors.python_grader_runtime_error_details = failed.details
        return 0.0, errors
    except ModelGraderFailed as failed:
        if failed.parse:
            errors.model_grader_parse_error = True
        else:
            errors.model_grader_server_error = True
            errors.model_grader_server_error_details = failed.details
        return 0.0, errors
    if not math.isfinite(score):
        errors.unresponsive_reward_error = True
        return 0.0, errors
    return score, errors


def grade(grader: AnyGrader, model_sample: str, item: Any, runners: Runners = Runners()) -> Grade:
    """`model_sample` graded against `item` (the dataset line; None reads as {})."""
    started = time.perf_counter()
    deadline = time.monotonic() + runners.python_budget_s
    sample = Sample.of(model_sample)
    item = {} if item is None else item
    result = Grade(0.0, grader.name, grader.type)
    if isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            score, errors = _leaf(sub, sample, item, runners, deadline)
            result.sub_rewards[key] = score
            result.errors.merge(errors)
        if not result.errors.any():
            try:
                reward = formula.evaluate(grader.parsed_formula, result.sub_rewards)
            except (ArithmeticError, ValueError, TypeError, RecursionError):
                result.errors.other_error = True
            else:
                if math.isfinite(reward):
                    result.reward = reward
                else:
                    result.errors.unresponsive_reward_error = True
    else:
        result.reward, result.errors = _leaf(grader, sample, item, runners, deadline)
    result.execution_time = time.perf_counter() - started
    return result
