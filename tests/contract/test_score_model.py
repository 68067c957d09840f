"""score_model graders after their judge answered (contract/graders/score_model.py): the
messages the judge reads, its answer read as a score as OpenAI's graders guide describes
(`{"result": float, "steps": [...]}`, truncated to `range`), and a grade that reads the
answers the training rank's judges gave, alone and inside a multi grader."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from contract.graders.grading import Runners, grade, judged
from contract.graders.models import AnyGrader, Grader, ScoreModelGrader
from contract.graders.score_model import (
    JudgeReply,
    UnreadableScore,
    judged_leaves,
    messages_of,
    read_score,
    score_of,
)
from contract.graders.templates import MissingValue, Sample

GRADER: TypeAdapter[AnyGrader] = TypeAdapter(Grader)

JUDGE = {
    "type": "score_model",
    "name": "judge",
    "model": "/models/judge",
    "input": [
        {"role": "system", "content": "Score the answer from 0 to 1."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Expected {{item.answer}}; "},
                {"type": "input_text", "text": "got {{sample.output_text}}"},
            ],
        },
    ],
}
MULTI = {
    "type": "multi",
    "name": "both",
    "graders": {
        "judge": JUDGE,
        "exact": {
            "type": "string_check",
            "name": "exact",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
    },
    "calculate_output": "0.5 * judge + exact",
}


def score_model(**fields: Any) -> ScoreModelGrader:
    parsed = GRADER.validate_python({**JUDGE, **fields})
    assert isinstance(parsed, ScoreModelGrader)
    return parsed


class TestReadingTheAnswer:
    @pytest.mark.parametrize(
        ("answer", "score"),
        [
            ('{"result": 0.8, "steps": [{"description": "d", "conclusion": "c"}]}', 0.8),
            ('{"steps": [], "result": 1}', 1.0),
            ('Here it is:\n```json\n{"result": 0.25}\n```', 0.25),
            # Cut off by max_completions_tokens while writing its steps.
            ('{"result": 0.6, "steps": [{"description": "the answ', 0.6),
            ("0.5", 0.5),
            ("  -1\n", -1.0),
            ("3e-1", 0.3),
            (".75", 0.75),
        ],
    )
    def test_a_result_or_a_bare_number_is_the_score(self, answer: str, score: float) -> None:
        assert read_score(answer) == pytest.approx(score)

    @pytest.mark.parametrize(
        "answer",
        [
            "",
            "I cannot grade this.",
            "Score: 0.8",  # a number among words: which number is not for us to guess
            "0.8.",
            '{"result": "0.8"}',  # a string, not a number
            '{"result": true}',
            '{"result": NaN}',
            '{"result": 0.',  # cut off inside the number
            '{"steps": [{"result": 1}]}',  # not the answer's own result
            "1e999",
        ],
    )
    def test_anything_else_is_unreadable(self, answer: str) -> None:
        with pytest.raises(UnreadableScore, match="the judge answered"):
            read_score(answer)

    def test_a_score_outside_the_range_is_truncated_to_it(self) -> None:
        judge = score_model(range=[-1, 5])
        assert score_of('{"result": 7}', judge) == 5.0
        assert score_of("-3", judge) == -1.0
        assert score_of("2.5", judge) == 2.5


class TestTheJudgesInput:
    def test_templates_read_the_item_and_the_sample(self) -> None:
        judge = score_model()
        messages = messages_of(judge, Sample.of("Lyon"), {"answer": "Paris"})
        assert messages == [
            {"role": "system", "content": "Score the answer from 0 to 1."},
            {"role": "user", "content": "Expected Paris; got Lyon"},
        ]

    def test_json_fields_of_the_sample_and_nested_item_fields(self) -> None:
        judge = score_model(
            input=[
                {
                    "role": "user",
                    "content": "{{sample.output_json.city}} vs {{item.gold.city}} ({{item.gold}})",
                }
            ]
        )
        messages = messages_of(judge, Sample.of('{"city": "Oslo"}'), {"gold": {"city": "Lima"}})
        assert messages[0]["content"] == 'Oslo vs Lima ({"city": "Lima"})'

    def test_an_item_without_the_field_is_missing(self) -> None:
        with pytest.raises(MissingValue) as missing:
            messages_of(score_model(), Sample.of("Lyon"), {})
        assert missing.value.namespace == "item"


class TestGradingWithTheJudgesAnswers:
    def test_a_multi_grader_mixes_the_judge_with_other_graders(self) -> None:
        multi = GRADER.validate_python(MULTI)
        assert [key for key, _ in judged_leaves(multi)] == ["judge"]
        replies = {"judge": [JudgeReply(text='{"result": 0.6}'), JudgeReply(text="1")]}
        first = grade(multi, "Lyon", {"answer": "Paris"}, Runners(model=judged(multi, replies, 0)))
        second = grade(
            multi, "Paris", {"answer": "Paris"}, Runners(model=judged(multi, replies, 1))
        )
        assert (first.sub_rewards, first.reward) == ({"judge": 0.6, "exact": 0.0}, 0.3)
        assert (second.sub_rewards, second.reward) == ({"judge": 1.0, "exact": 1.0}, 1.5)
        assert not first.errors.any() and not second.errors.any()

    def test_an_unreadable_answer_is_a_parse_error_scoring_zero(self) -> None:
        judge = score_model()
        replies = {"judge": [JudgeReply(text="no idea")]}
        result = grade(judge, "Lyon", {"answer": "Paris"}, Runners(model=judged(judge, replies, 0)))
        assert result.reward == 0.0
        assert result.errors.model_grader_parse_error
        assert not result.errors.model_grader_server_error

    def test_a_judge_that_gave_no_answer_is_a_server_error_saying_why(self) -> None:
        judge = score_model()
        replies = {"judge": [JudgeReply(error="the judge's prompt is 900 tokens")]}
        result = grade(judge, "Lyon", {"answer": "Paris"}, Runners(model=judged(judge, replies, 0)))
        assert result.errors.model_grader_server_error
        assert result.errors.model_grader_server_error_details == (
            "the judge's prompt is 900 tokens"
        )

    def test_a_missing_item_field_is_flagged_before_any_answer_is_read(self) -> None:
        judge = score_model()
        # No answer at all: the template fails first, as it does for the other graders.
        result = grade(judge, "Lyon", {}, Runners(model=judged(judge, {"judge": []}, 0)))
        assert result.errors.invalid_variable_error
        assert not result.errors.model_grader_server_error

    def test_without_answers_the_grader_is_not_available(self) -> None:
        result = grade(score_model(), "Lyon", {"answer": "Paris"})
        assert result.errors.model_grader_server_error
        assert "loads no model" in (result.errors.model_grader_server_error_details or "")
