"""OpenAI's grader routes through OpenAI's own SDK: `openai_sdk.fine_tuning.alpha.graders.run`
and `.validate` on a served app, as code written for OpenAI's RFT calls them."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest

from app.settings import Settings
from tests.app.conftest import HTTP_TIMEOUT_S

EXACT = {
    "type": "string_check",
    "name": "exact answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
MULTI = {
    "type": "multi",
    "name": "answer and overlap",
    "graders": {
        "exact": EXACT,
        "overlap": {
            "type": "text_similarity",
            "name": "overlap",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "evaluation_metric": "rouge_1",
        },
    },
    "calculate_output": "0.5 * exact + 0.5 * overlap",
}


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: these routes store nothing; the database only checks the key."""
    return sqlite_url


def test_run_grades_a_sample_against_an_item(openai_sdk: openai.OpenAI) -> None:
    right = openai_sdk.fine_tuning.alpha.graders.run(
        grader=EXACT, model_sample="42", item={"answer": "42"}
    )
    wrong = openai_sdk.fine_tuning.alpha.graders.run(
        grader=EXACT, model_sample="41", item={"answer": "42"}
    )
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.metadata.name == "exact answer"
    assert right.metadata.type == "string_check"
    assert not right.metadata.errors.invalid_variable_error


def test_a_multi_grader_reports_each_graders_score(openai_sdk: openai.OpenAI) -> None:
    result = openai_sdk.fine_tuning.alpha.graders.run(
        grader=MULTI,  # type: ignore[arg-type]  # the SDK types `graders` as one grader
        model_sample="the cat",
        item={"answer": "the cat sat on the mat"},
    )
    assert result.sub_rewards == pytest.approx({"exact": 0.0, "overlap": 0.5})
    assert result.reward == pytest.approx(0.25)


def test_a_field_the_item_lacks_scores_zero_saying_so(openai_sdk: openai.OpenAI) -> None:
    result = openai_sdk.fine_tuning.alpha.graders.run(
        grader=EXACT, model_sample="42", item={"question": "6 x 7?"}
    )
    assert result.reward == 0.0
    assert result.metadata.errors.invalid_variable_error


def test_validate_returns_the_grader(openai_sdk: openai.OpenAI) -> None:
    validated = openai_sdk.fine_tuning.alpha.graders.validate(grader=EXACT)
    assert validated.grader is not None
    assert validated.grader.model_dump(exclude_none=True) == EXACT


@pytest.mark.parametrize(
    ("grader", "param", "says"),
    [
        ({**EXACT, "operation": "regex"}, "grader.string_check.operation", "'eq', 'ne'"),
        ({**EXACT, "input": "{{answer}}"}, "grader.string_check.input", "namespaces"),
        (
            {**MULTI, "calculate_output": "exact + __import__('os')"},
            "grader.multi.calculate_output",
            "is not allowed",
        ),
        (
            {
                "type": "text_similarity",
                "name": "s",
                "input": "{{sample.output_text}}",
                "reference": "x",
                "evaluation_metric": "cosine",
            },
            "grader.text_similarity.evaluation_metric",
            "text-embedding-3-large",
        ),
        (
            {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1\n"},
            "grader.type",
            "python graders are off on this service",
        ),
    ],
)
@pytest.mark.parametrize("route", ["run", "validate"])
def test_a_bad_grader_is_a_bad_request_naming_the_field(
    openai_sdk: openai.OpenAI, grader: dict[str, Any], param: str, says: str, route: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "run":
            openai_sdk.fine_tuning.alpha.graders.run(grader=grader, model_sample="x")  # type: ignore[arg-type]
        else:
            openai_sdk.fine_tuning.alpha.graders.validate(grader=grader)  # type: ignore[arg-type]
    assert raised.value.param is not None and raised.value.param.startswith(param)
    assert says in raised.value.message


def test_a_python_grader_inside_a_multi_grader_is_refused_too(openai_sdk: openai.OpenAI) -> None:
    python = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1\n"}
    with pytest.raises(openai.BadRequestError) as raised:
        openai_sdk.fine_tuning.alpha.graders.validate(
            grader={**MULTI, "graders": {**MULTI["graders"], "code": python}}  # type: ignore[arg-type, dict-item]
        )
    assert raised.value.param == "grader.graders.code.type"


def test_the_routes_need_an_api_key(openai_live: tuple[str, str]) -> None:
    url, _ = openai_live
    for route in ("run", "validate"):
        answer = httpx.post(
            f"{url}/v1/fine_tuning/alpha/graders/{route}",
            json={"grader": EXACT, "model_sample": "x"},
            timeout=HTTP_TIMEOUT_S,
        )
        assert answer.status_code == 401
        assert answer.json()["error"]["type"] == "authentication_error"


def test_a_grade_that_would_hold_the_service_is_refused_at_once(
    openai_live: tuple[str, str],
) -> None:
    """A reviewer's request: fuzzy_match of 20,000 characters against 2,000 held the GIL
    (and so every other request) for seconds, longer ones for hours. Past the metric's
    bound it is OpenAI's truncated_observation_error, answered at once; and a body past
    the grader routes' limit is a 413 before it is parsed."""
    url, key = openai_live
    headers = {"Authorization": f"Bearer {key}"}
    fuzzy = {
        "type": "text_similarity",
        "name": "t",
        "evaluation_metric": "fuzzy_match",
        "input": "{{sample.output_text}}",
        "reference": "{{item.r}}",
    }
    body = {"grader": fuzzy, "model_sample": "abcdefghij" * 2_000, "item": {"r": "zyx" * 700}}
    answer = httpx.post(
        f"{url}/v1/fine_tuning/alpha/graders/run", json=body, headers=headers, timeout=10
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["metadata"]["errors"]["truncated_observation_error"] is True
    assert answer.json()["reward"] == 0.0

    from app.api.body_limit import GRADER_BODY_BYTES

    huge = {"grader": EXACT, "model_sample": "x", "item": {"a": "y" * GRADER_BODY_BYTES}}
    answer = httpx.post(
        f"{url}/v1/fine_tuning/alpha/graders/run",
        json=huge,
        headers=headers,
        timeout=HTTP_TIMEOUT_S,
    )
    assert answer.status_code == 413, answer.text


SLEEPER = {
    "type": "python",
    "name": "slow",
    "source": "import time\ndef grade(sample, item):\n    time.sleep(3)\n    return 1.0\n",
}


class TestPythonGradersTurnedOn:
    """An operator's TUNEYARD_PYTHON_GRADERS=true: they run, sandboxed, a few at a time."""

    @pytest.fixture
    def settings(self, settings: Settings) -> Settings:
        return settings.model_copy(
            update={"python_graders": True, "max_concurrent_python_graders": 1}
        )

    def test_a_python_grader_runs(self, openai_sdk: openai.OpenAI) -> None:
        source = (
            "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n"
        )
        result = openai_sdk.fine_tuning.alpha.graders.run(
            grader={"type": "python", "name": "code", "source": source},
            model_sample="42",
            item={"answer": "42"},
        )
        assert result.reward == 1.0
        failing = openai_sdk.fine_tuning.alpha.graders.run(
            grader={"type": "python", "name": "code", "source": "def grade(s, i):\n    1/0\n"},
            model_sample="42",
        )
        assert failing.reward == 0.0
        assert failing.metadata.errors.python_grader_runtime_error
        assert "ZeroDivisionError" in (
            failing.metadata.errors.python_grader_runtime_error_details or ""
        )

    def test_past_the_limit_a_python_grader_is_a_429(self, openai_live: tuple[str, str]) -> None:
        url, key = openai_live
        body = {"grader": SLEEPER, "model_sample": "x"}
        headers = {"Authorization": f"Bearer {key}"}
        route = f"{url}/v1/fine_tuning/alpha/graders/run"

        def post(json: dict[str, Any]) -> httpx.Response:
            return httpx.post(route, json=json, headers=headers, timeout=HTTP_TIMEOUT_S)

        # Two at once (each sleeps 3 s in its sandbox): one runs, the other is refused.
        answers: list[httpx.Response] = []
        together = threading.Barrier(2)

        def send() -> None:
            together.wait()
            answers.append(post(body))

        threads = [threading.Thread(target=send) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        by_status = {a.status_code: a for a in answers}
        assert sorted(by_status) == [200, 429], [a.text for a in answers]
        assert by_status[200].json()["reward"] == 1.0
        refusal = by_status[429].json()["error"]
        assert "Python graders are running already" in refusal["message"]
        assert refusal["type"] == "rate_limit_error"
