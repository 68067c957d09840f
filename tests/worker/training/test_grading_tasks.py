"""worker/training/grading_tasks.py: a node that cannot sandbox Python graders fails a run that has
them, at its first grading, and grades every other grader as before."""

from __future__ import annotations

import math
import os
import shutil
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import RayTaskError

from contract.callbacks import FailureCode
from contract.graders import sandbox
from worker.reporting.failures import TrainingCodeError, failure_code
from worker.training.grading_tasks import PythonSandboxMissing, grade_all, grade_off_rank
from worker.training.trainer import TrainingErrorStop

EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
PYTHON = {
    "type": "python",
    "name": "py",
    "source": "def grade(sample, item):\n"
    "    return 1.0 if sample['output_text'] == item['answer'] else 0.0\n",
}
RAISES = {
    "type": "python",
    "name": "py",
    "source": "def grade(sample, item):\n    raise ValueError('boom')\n",
}
TEXTS = ["4", "5"]
ITEMS = [{"answer": "4"}, {"answer": "4"}]
FIX = "install bubblewrap (bwrap) on every ray node that trains, or turn python graders off"


def multi(**graders: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "multi",
        "name": "both",
        "graders": graders,
        "calculate_output": " + ".join(graders),
    }


@pytest.fixture
def no_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node without bubblewrap: a PATH with util-linux's prlimit and taskset and no
    `bwrap`, where `PythonSandbox()` looks for them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("prlimit", "taskset"):
        if found := shutil.which(tool):
            (bin_dir / tool).symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert sandbox.unavailable() is not None


def missing_sandbox(grader: dict[str, Any]) -> PythonSandboxMissing:
    with pytest.raises(PythonSandboxMissing) as caught:
        grade_all(grader, TEXTS, ITEMS)
    return caught.value


class TestWithoutASandbox:
    @pytest.mark.parametrize(
        "grader",
        [PYTHON, multi(exact=EXACT, py=PYTHON)],
        ids=["python", "python-in-multi"],
    )
    def test_a_python_grader_fails_saying_what_is_missing_where(
        self, no_bwrap: None, grader: dict[str, Any]
    ) -> None:
        message = str(missing_sandbox(grader))
        assert f"node {socket.gethostname()!r}" in message
        assert "bubblewrap (`bwrap`" in message  # the sandbox's own reason
        assert FIX in message.lower()
        assert "\n" not in message  # the run's error shows an error's last line

    def test_off_rank_grading_outside_ray_raises_it_too(self, no_bwrap: None) -> None:
        with pytest.raises(PythonSandboxMissing, match="bubblewrap"):
            grade_off_rank(PYTHON, TEXTS, ITEMS)

    def test_graders_without_python_grade_as_before(self, no_bwrap: None) -> None:
        assert grade_all(EXACT, TEXTS, ITEMS).rewards == [1.0, 0.0]
        similar = {
            "type": "text_similarity",
            "name": "similar",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "evaluation_metric": "fuzzy_match",
        }
        graded = grade_all(multi(exact=EXACT, similar=similar), TEXTS, ITEMS)
        assert graded.rewards == [2.0, 0.0]
        assert graded.sub_rewards == {"exact": [1.0, 0.0], "similar": [1.0, 0.0]}
        assert graded.failures == []

    def test_through_ray_the_runs_error_reads_as_one_line(self, no_bwrap: None) -> None:
        """`ray.get` re-raises the grading task's error wrapped as
        `RayTaskError(PythonSandboxMissing)`, whose own text is the task's traceback; the
        run's `training_error` still reads the error's own line."""
        error = missing_sandbox(PYTHON)
        # As Ray builds it from the task's error (the process and address are the task's).
        trace = "".join(traceback.format_exception(error))
        wrapped = RayTaskError("grade_all", trace, error, "ray::grade_all", os.getpid(), "10.0.0.7")
        raised = wrapped.as_instanceof_cause()
        assert isinstance(raised, PythonSandboxMissing)
        assert failure_code(raised) is FailureCode.TRAINING_ERROR
        with pytest.raises(TrainingCodeError) as stopped:
            TrainingErrorStop().after_exception(None, {0: raised})
        assert str(stopped.value) == f"worker rank 0: PythonSandboxMissing: {error}"


def test_a_python_grader_that_raises_fails_its_grades_not_the_run() -> None:
    """With a sandbox (bubblewrap installed, as .ci/run does)."""
    graded = grade_all(multi(exact=EXACT, py=RAISES), TEXTS, ITEMS)
    assert all(math.isnan(r) for r in graded.rewards)
    assert graded.failures == ["python_grader_runtime_error"] * 2
