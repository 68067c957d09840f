"""contract/records.py: when a chat or preference record is trainable, and the sentence
that says why not."""

from __future__ import annotations

from typing import Any

import pytest

from contract.datasets import fields_read_by, purpose_of, required_fields
from contract.records import (
    answer_text,
    chat_record_problem,
    message_weight,
    preference_record_problem,
)
from contract.run_request import DatasetSpec

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is 2 + 2?"}
ASSISTANT = {"role": "assistant", "content": "4"}


def chat(*messages: Any) -> dict[str, Any]:
    return {"messages": list(messages)}


class TestGoodChatRecords:
    @pytest.mark.parametrize(
        "record",
        [
            chat(USER, ASSISTANT),
            chat(SYSTEM, USER, ASSISTANT),
            # OpenAI's newer name for system, which its RFT examples use.
            chat({"role": "developer", "content": "Be brief."}, USER, ASSISTANT),
            # OpenAI's multi-turn example: an earlier answer kept as context only.
            chat(
                SYSTEM,
                USER,
                {**ASSISTANT, "weight": 0},
                {"role": "user", "content": "And 3 + 3?"},
                {"role": "assistant", "content": "6", "weight": 1},
            ),
            chat(USER, {**ASSISTANT, "weight": True}),
            chat({**USER, "name": "alice"}, {**ASSISTANT, "name": "bot"}),
            # Arrow gives each record every key that any record has, filled with null.
            chat({**USER, "weight": None, "name": None}, {**ASSISTANT, "weight": None}),
            # JSON has one kind of number; Arrow writes a column of 1s as 1.0 after one 1.0.
            chat(USER, {**ASSISTANT, "weight": 1.0}, {**USER, "content": "x"}),
            {"messages": [USER, ASSISTANT], "id": 7, "tools": None},
        ],
    )
    def test_pass(self, record: Any) -> None:
        assert chat_record_problem(record) is None

    def test_another_messages_field(self) -> None:
        assert (
            chat_record_problem({"conversation": [USER, ASSISTANT]}, messages_field="conversation")
            is None
        )


class TestBadChatRecords:
    @pytest.mark.parametrize(
        ("record", "problem"),
        [
            ([USER, ASSISTANT], "a record must be a JSON object, got a list"),
            ({"text": "hi"}, "record has no 'messages' (dataset.messages_field)"),
            ({"messages": None}, "record has no 'messages' (dataset.messages_field)"),
            ({"messages": "hi"}, "'messages' must be a list of messages, got a string"),
            (chat(), "'messages' is an empty list: a conversation needs messages"),
            (
                chat(USER, "4"),
                "messages[1] must be a message object with 'role' and 'content', got a string",
            ),
            (
                chat(USER, {"role": "bot", "content": "4"}),
                "messages[1].role must be one of 'system', 'developer', 'user', "
                "'assistant', got 'bot'",
            ),
            (
                chat({"content": "hi"}, ASSISTANT),
                "messages[0].role must be one of 'system', 'developer', 'user', "
                "'assistant', missing",
            ),
            (
                chat(USER, ASSISTANT, {"role": "tool", "content": "{}", "tool_call_id": "c"}),
                "messages[2].role 'tool': tool calls are not supported",
            ),
            (
                chat(USER, {"role": "function", "content": "{}"}),
                "messages[1].role 'function': tool calls are not supported",
            ),
            (
                chat(USER, {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}),
                "messages[1] has 'tool_calls': tool calls are not supported",
            ),
            (
                {"messages": [USER, ASSISTANT], "tools": [{"type": "function"}]},
                "record field 'tools': tool calls are not supported",
            ),
            (
                chat(USER, {**ASSISTANT, "thinking": "easy"}),
                "messages[1] has unknown key 'thinking'; a message's keys are role, content, "
                "weight, name",
            ),
            (
                chat({"role": "user", "content": [{"type": "text", "text": "hi"}]}, ASSISTANT),
                "messages[0].content must be a string, got a list of content parts: only "
                "text messages are supported",
            ),
            (
                chat(USER, {"role": "assistant", "content": None}),
                "messages[1].content must be a string, got null",
            ),
            (chat(USER, {"role": "assistant"}), "messages[1].content must be a string, got null"),
            (
                chat({**USER, "name": 3}, ASSISTANT),
                "messages[0].name must be a non-empty string, got a number",
            ),
            (
                chat({**USER, "weight": 2}, ASSISTANT),
                "messages[0].weight is allowed on assistant messages only, not on 'user'",
            ),
            (
                chat({**SYSTEM, "weight": 0}, USER, ASSISTANT),
                "messages[0].weight is allowed on assistant messages only, not on 'system'",
            ),
            (chat(USER, {**ASSISTANT, "weight": 2}), "messages[1].weight must be 0 or 1, got 2"),
            (
                chat(USER, {**ASSISTANT, "weight": 0.5}),
                "messages[1].weight must be 0 or 1, got 0.5",
            ),
            (
                chat(USER, {**ASSISTANT, "weight": "1"}),
                "messages[1].weight must be 0 or 1, got '1'",
            ),
            (
                chat(SYSTEM, USER),
                "'messages' has no assistant message with weight 1 (absent weight means 1): "
                "nothing in the conversation would be learned",
            ),
            (
                chat(USER, {**ASSISTANT, "weight": 0}),
                "'messages' has no assistant message with weight 1 (absent weight means 1): "
                "nothing in the conversation would be learned",
            ),
            (
                chat(ASSISTANT, USER),
                "messages[0] is an assistant message with weight 1 and nothing before it to "
                "answer: start with a system or user message, or give it weight 0",
            ),
            (
                chat(USER, {"role": "assistant", "content": "  "}),
                "messages[1].content is empty: an assistant message with weight 1 needs text "
                "to learn (give it weight 0 to keep it as context only)",
            ),
        ],
    )
    def test_refused_with_the_rule(self, record: Any, problem: str) -> None:
        assert chat_record_problem(record) == problem

    def test_the_field_is_named_as_the_request_names_it(self) -> None:
        record = {"conversation": [USER, {"role": "bot", "content": "4"}]}
        assert chat_record_problem(record, messages_field="conversation") == (
            "conversation[1].role must be one of 'system', 'developer', 'user', "
            "'assistant', got 'bot'"
        )
        assert chat_record_problem(chat(USER, ASSISTANT), messages_field="conversation") == (
            "record has no 'conversation' (dataset.messages_field)"
        )

    def test_an_unlearned_first_assistant_message_is_fine(self) -> None:
        # A conversation may open with the assistant's greeting, kept as context.
        assert chat_record_problem(chat({**ASSISTANT, "weight": 0}, USER, ASSISTANT)) is None


class TestMessageWeight:
    @pytest.mark.parametrize(
        ("message", "weight"),
        [
            (ASSISTANT, 1),
            ({**ASSISTANT, "weight": None}, 1),
            ({**ASSISTANT, "weight": 1}, 1),
            ({**ASSISTANT, "weight": 0}, 0),
            ({**ASSISTANT, "weight": False}, 0),
            ({**ASSISTANT, "weight": 0.0}, 0),
        ],
    )
    def test_absent_means_one(self, message: dict[str, Any], weight: int) -> None:
        assert message_weight(message) == weight


def pair(prompt: Any = "2 + 2 =", chosen: Any = " 4", rejected: Any = " 5") -> dict[str, Any]:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


class TestGoodPreferenceRecords:
    @pytest.mark.parametrize(
        "record",
        [
            pair(),
            # TRL's conversational preference format.
            pair(
                [SYSTEM, USER],
                [{"role": "assistant", "content": "4"}],
                [{"role": "assistant", "content": "5"}],
            ),
            pair([USER, ASSISTANT, {"role": "user", "content": "And 3 + 3?"}], "6", "7"),
            pair([USER], {"role": "assistant", "content": "4"}, " 5"),
            {**pair(), "id": 3, "score": None},
        ],
    )
    def test_pass(self, record: Any) -> None:
        assert preference_record_problem(record) is None

    def test_other_field_names(self) -> None:
        record = {"q": "2 + 2 =", "good": "4", "bad": "5"}
        assert (
            preference_record_problem(
                record, prompt_field="q", chosen_field="good", rejected_field="bad"
            )
            is None
        )


class TestBadPreferenceRecords:
    @pytest.mark.parametrize(
        ("record", "problem"),
        [
            ("2 + 2 = 4", "a record must be a JSON object, got a string"),
            ({"chosen": "4", "rejected": "5"}, "record has no 'prompt' (dataset.prompt_field)"),
            ({"prompt": "p", "rejected": "5"}, "record has no 'chosen' (dataset.chosen_field)"),
            ({"prompt": "p", "chosen": "4"}, "record has no 'rejected' (dataset.rejected_field)"),
            (pair(rejected=None), "record has no 'rejected' (dataset.rejected_field)"),
            (pair(prompt=" "), "'prompt' is empty"),
            (pair(chosen=""), "'chosen' is empty"),
            (pair(prompt=5), "'prompt' must be text or a list of chat messages, got a number"),
            (pair(prompt=[]), "'prompt' is an empty list of messages"),
            (
                pair(prompt=[USER, ASSISTANT]),
                "prompt[1].role is 'assistant': a prompt given as messages ends with the "
                "user turn that the chosen and rejected answers reply to",
            ),
            (
                pair(prompt=[{"role": "bot", "content": "x"}]),
                "prompt[0].role must be one of 'system', 'developer', 'user', "
                "'assistant', got 'bot'",
            ),
            (
                pair(prompt=[{**USER, "weight": 1}]),
                "prompt[0] has 'weight': weights mark learned chat turns; a prompt is never "
                "learned",
            ),
            (
                pair(prompt=[{**USER, "weight": 1}], chosen=[{**ASSISTANT, "extra": 1}]),
                "prompt[0] has 'weight': weights mark learned chat turns; a prompt is never "
                "learned",
            ),
            (
                pair(chosen=[ASSISTANT, ASSISTANT]),
                "'chosen' must be text or exactly one assistant message, got a list of 2 messages",
            ),
            (
                pair(chosen=[]),
                "'chosen' must be text or exactly one assistant message, got a list of 0 messages",
            ),
            (
                pair(rejected=[USER]),
                "rejected[0].role must be 'assistant' (it answers the prompt), got 'user'",
            ),
            (
                pair(rejected={"role": "assistant", "content": " "}),
                "rejected.content is empty",
            ),
            (
                pair(chosen=[{"role": "assistant", "content": [{"type": "text"}]}]),
                "chosen[0].content must be a string, got a list of content parts: only text "
                "messages are supported",
            ),
            (
                pair(chosen=[{"role": "assistant", "content": "4", "weight": 1}]),
                "chosen[0] has 'weight': weights mark learned chat turns; a prompt is never "
                "learned",
            ),
            (pair(chosen=4), "'chosen' must be text or one assistant message, got a number"),
            (
                pair(rejected=[{"role": "assistant", "content": "", "tool_calls": []}]),
                "rejected[0] has 'tool_calls': tool calls are not supported",
            ),
        ],
    )
    def test_refused_with_the_rule(self, record: Any, problem: str) -> None:
        assert preference_record_problem(record) == problem

    def test_the_missing_field_is_named_as_the_request_names_it(self) -> None:
        record = {"q": "2 + 2 =", "good": "4"}
        problem = preference_record_problem(
            record, prompt_field="q", chosen_field="good", rejected_field="bad"
        )
        assert problem == "record has no 'bad' (dataset.rejected_field)"


class TestAnswerText:
    @pytest.mark.parametrize(
        "answer",
        [" 4", {"role": "assistant", "content": " 4"}, [{"role": "assistant", "content": " 4"}]],
    )
    def test_every_form_gives_its_text(self, answer: Any) -> None:
        assert answer_text(answer) == " 4"


class TestFieldsReadByChatAndPreference:
    """The fields a run checks an uploaded file for (contract/datasets.py)."""

    def test_chat_reads_the_messages_field(self) -> None:
        spec = DatasetSpec(source="/d", format="chat", messages_field="conversation")
        assert fields_read_by("causal_lm", spec) == [("conversation", "dataset.messages_field")]

    def test_preference_reads_prompt_chosen_and_rejected(self) -> None:
        spec = DatasetSpec(source="/d", format="preference", prompt_field="q", rejected_field="bad")
        assert fields_read_by("causal_lm", spec) == [
            ("q", "dataset.prompt_field"),
            ("chosen", "dataset.chosen_field"),
            ("bad", "dataset.rejected_field"),
        ]

    @pytest.mark.parametrize("fmt", ["chat", "preference"])
    def test_an_upload_and_a_run_of_the_same_purpose_read_the_same_fields(self, fmt: str) -> None:
        spec = DatasetSpec(source="/d", format=fmt)
        purpose = purpose_of("causal_lm", fmt)
        assert purpose == fmt
        assert required_fields(purpose) == fields_read_by("causal_lm", spec)
