"""`score_model` graders: the messages a judge model reads, and the score its answer gives.

OpenAI's graders guide (platform.openai.com/docs/guides/graders, "Score model graders" and
"Score model grader outputs") says the grader asks its model for the response format
`{"result": float, "steps": [{"description", "conclusion"}]}` (structured outputs), and that
"the output of the grader will be truncated to the given `range`, and default to 0 for all
non-numeric outputs". A model the cluster loads has no structured outputs to hold it to
that format, so its answer is read as:

- a JSON object with a numeric `result` (its `steps`, or anything else, unread), also inside
  a ```json fence or after some words, and also an object that opens with its `result` and
  is cut off after it (the judge ran out of max_completions_tokens writing its steps);
- or a bare number, the whole answer ("0.8", "1").

Anything else (no number, a number among words, `true`, NaN) is a parse error, OpenAI's
`model_grader_parse_error`: the grade reports it (OpenAI's reward of 0), and a training run
counts it as a failed grade. A score outside `range` is clipped to it, as OpenAI's is.

Torch-free: the worker generates the answers (worker/training/judge.py), the grading reads them
here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from contract.graders.models import AnyGrader, ScoreModelGrader, scoring_leaves
from contract.graders.templates import Sample, render

# A judge's answer is a number or a short JSON object: OpenAI documents no default for
# max_completions_tokens (its example gives a reasoning model 32768); 64 holds a number or
# a `result` written first. A judge asked to reason at length needs it set.
DEFAULT_MAX_TOKENS = 64

# The most prompt and answer tokens one batch of a judge's generation holds (rows x their
# longest length): its KV cache, on the training rank's device beside the policy. 16,384
# tokens of a 7B Llama (32 layers, 4,096-wide keys and values in bf16) are 8 GiB.
BATCH_TOKENS = 16_384

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_BARE_NUMBER = re.compile(rf"\s*({_NUMBER})\s*")
# An object that opens with `"result": <number>` and what may follow it there: an answer cut
# short after its result. A number at the very end may itself be cut short ("0.7" as "0."),
# and is not read.
_RESULT_FIRST = re.compile(rf'\{{\s*"result"\s*:\s*({_NUMBER})\s*[,}}]')


class UnreadableScore(ValueError):
    """A judge's answer with no score in it."""


@dataclass(frozen=True, slots=True)
class JudgeReply:
    """What a judge answered for one completion (`text`), or why it gave no answer
    (`error`: the prompt did not fit the judge, say)."""

    text: str | None = None
    error: str | None = None


def judged_leaves(grader: AnyGrader) -> list[tuple[str, ScoreModelGrader]]:
    """The score_model graders of `grader`, each with a key that names it the same way
    wherever the grader is parsed: its key in a multi grader, or its own name."""
    return [
        (leaf.name if key is None else key, leaf)
        for key, leaf in scoring_leaves(grader)
        if isinstance(leaf, ScoreModelGrader)
    ]


def messages_of(grader: ScoreModelGrader, sample: Sample, item: Any) -> list[dict[str, str]]:
    """The judge's input, its templates filled from the sample and the item (raises
    templates.MissingValue where either lacks a field)."""
    return [
        {"role": m.role, "content": "".join(render(t, sample, item) for t in m.texts())}
        for m in grader.input
    ]


def _finite(value: Any) -> float | None:
    # bool is an int to Python; `true` is no score.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _result_of_objects(text: str) -> float | None:
    """`result` of the first top-level JSON object in `text` that has one, or of an object
    cut short after its result."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            if (cut := _RESULT_FIRST.match(text, start)) is not None:
                return _finite(float(cut.group(1)))
            end = start + 1
        else:
            if isinstance(value, dict) and "result" in value:
                return _finite(value["result"])
        start = text.find("{", end)
    return None


def read_score(answer: str) -> float:
    """The score in a judge's answer, as the module says; raises UnreadableScore."""
    score = _result_of_objects(answer)
    if score is None and (bare := _BARE_NUMBER.fullmatch(answer)) is not None:
        score = _finite(float(bare.group(1)))
    if score is None:
        shown = answer if len(answer) <= 200 else answer[:200] + "..."
        raise UnreadableScore(
            f'the judge answered {shown!r}: neither {{"result": <number>, ...}} nor a number'
        )
    return score


def score_of(answer: str, grader: ScoreModelGrader) -> float:
    """The reward of a judge's answer: its score clipped to the grader's range."""
    low, high = grader.range
    return min(max(read_score(answer), low), high)
