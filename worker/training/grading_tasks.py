"""Grading a step's completions off the training process: a Ray task per rank and step,
so that grading (a Python grader's sandbox, a long text_similarity) runs in a process of its
own rather than in the rank's, and a grader that crashes its process fails a grade, never
the run.

The task asks for no CPU: the training workers hold the cluster's CPUs for the whole run
(a CPU-only cluster is often exactly full), and a task that waited for one of theirs would
wait forever. Python graders are pinned to one CPU each by their sandbox.

A grade that fails (an error flag of OpenAI's, a grader that raised) is a NaN reward: it
counts in no group's mean and gets no advantage, and the run's metrics count it. A node that
cannot sandbox a grader's Python graders fails the run instead (`PythonSandboxMissing`):
there every grade would fail, every group would be flat, and the run would learn nothing.

A score_model grader's judge runs on the training rank, which holds the device
(worker/training/judge.py); its answers come here as `replies`, and the grade reads them, so that
a multi grader mixing a judge with other graders grades in one place.
"""

from __future__ import annotations

import functools
import math
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# Grades at once within a task: Python graders wait on their sandboxes, not on this process.
GRADING_THREADS = 4


class PythonSandboxMissing(RuntimeError):
    """The grader has Python graders and the node that grades cannot sandbox them. One
    line, one argument: it travels from a Ray task to the rank and ends as the run's
    `training_error`."""


@dataclass(slots=True)
class Graded:
    """A batch's rewards (NaN where grading failed), each multi grader's sub-rewards by
    name, and the first few failures' descriptions."""

    rewards: list[float]
    sub_rewards: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def grade_all(
    grader: dict[str, Any],
    texts: list[str],
    items: list[Any],
    replies: dict[str, list[Any]] | None = None,
) -> Graded:
    """Every completion graded against its record, here (a test or a task's body).
    `replies`: the score_model graders' answers (contract.graders.score_model.JudgeReply),
    by grader key, one per completion; without them such a grader fails saying why."""
    import dataclasses

    from pydantic import TypeAdapter

    from contract.graders import grading
    from contract.graders.models import Grader

    parsed = TypeAdapter(Grader).validate_python(grader)
    runners = _runners(parsed)

    def one(entry: tuple[int, tuple[str, Any]]) -> tuple[float, dict[str, float], str | None]:
        index, (text, item) = entry
        these = runners
        if replies is not None:
            these = dataclasses.replace(runners, model=grading.judged(parsed, replies, index))
        try:
            result = grading.grade(parsed, text, item, these)
        except Exception as exc:  # a grader's defect must not end the run
            return math.nan, {}, f"{type(exc).__name__}: {exc}"
        if result.errors.any():
            flags = [k for k, v in vars(result.errors).items() if v is True]
            return math.nan, result.sub_rewards, ", ".join(flags)
        if not math.isfinite(result.reward):
            return math.nan, result.sub_rewards, "the reward is not finite"
        return result.reward, result.sub_rewards, None

    with ThreadPoolExecutor(max_workers=GRADING_THREADS) as pool:
        results = list(pool.map(one, enumerate(zip(texts, items, strict=True))))
    graded = Graded(rewards=[r for r, _, _ in results])
    for name in sorted({name for _, subs, _ in results for name in subs}):
        graded.sub_rewards[name] = [subs.get(name, math.nan) for _, subs, _ in results]
    graded.failures = [why for _, _, why in results if why][:3]
    return graded


def _runners(grader: Any) -> Any:
    """Python graders run in the sandbox where this node has one. A grader with Python
    graders on a node without one ends the run; a grader without them needs none."""
    from contract.graders.grading import Runners
    from contract.graders.models import PythonGrader, scoring_leaves
    from contract.graders.sandbox import PythonSandbox, SandboxUnavailable

    if not any(isinstance(leaf, PythonGrader) for _, leaf in scoring_leaves(grader)):
        return Runners()
    try:
        return Runners(python=PythonSandbox())
    except SandboxUnavailable as exc:
        raise PythonSandboxMissing(
            f"python graders cannot run on node {socket.gethostname()!r}: {exc}. Install "
            "bubblewrap (bwrap) on every Ray node that trains, or turn python graders off "
            "(TUNEYARD_PYTHON_GRADERS=false on the service)"
        ) from None


def grade_off_rank(
    grader: dict[str, Any],
    texts: list[str],
    items: list[Any],
    replies: dict[str, list[Any]] | None = None,
) -> Graded:
    """`grade_all` in a Ray task where this process is part of a Ray cluster (a training
    worker), else here."""
    import ray

    if not ray.is_initialized():
        return grade_all(grader, texts, items, replies)
    return ray.get(_remote_grading().remote(grader, texts, items, replies))


@functools.cache
def _remote_grading() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_retries=0)(grade_all)
