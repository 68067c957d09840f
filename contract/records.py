"""What makes one chat or preference record trainable: the rules that an upload is checked
with (app/services/rules/file_checks.py) and that the worker applies to every record it reads
(worker/data/chat.py, worker/data/preference.py), so a file the service accepted never fails them on
the cluster.

Chat records are OpenAI's fine-tuning chat format:
`{"messages": [{"role": "system" | "developer" | "user" | "assistant", "content": "...",
"weight"?: 0 | 1, "name"?: "..."}]}`. `developer` is OpenAI's newer name for `system` (its
RFT examples use it); it is trained as `system` (`template_role`), the role chat templates
know. `weight` (assistant messages only) says whether a turn is learned; absent
means 1. `name` is accepted because OpenAI's format has it; it goes to the chat template,
which may render it or, as most do, ignore it. Tool calls are not supported: roles `tool`
and `function` and keys such as `tool_calls` are refused with that reason, never dropped.

Preference records are TRL's: `prompt` (text, or chat messages ending with a user turn) and
`chosen` / `rejected` (text, or the assistant's reply as one message, alone or in a list).

A key whose value is null counts as absent everywhere: the worker reads records through
Arrow, which gives every record each key that any record has, filled with null.

Messages are numbered from 0 in every problem, as `messages[2].role`. No torch, no service
imports: this module ships to the cluster beside the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = ("system", "developer", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "weight", "name")
# Parts of OpenAI's format for function calling, which tuneyard does not train.
_TOOL_ROLES = ("tool", "function")
_TOOL_KEYS = ("tool_calls", "function_call", "tool_call_id")
_TOOL_RECORD_KEYS = ("tools", "functions", "parallel_tool_calls")


def chat_record_problem(record: Any, *, messages_field: str = "messages") -> str | None:
    """Why one chat record is not trainable, or None."""
    if not isinstance(record, Mapping):
        return f"a record must be a JSON object, got {_kind(record)}"
    for key in _TOOL_RECORD_KEYS:
        if _present(record, key):
            return f"record field {key!r}: tool calls are not supported"
    messages = record.get(messages_field)
    if messages is None:
        return f"record has no {messages_field!r} (dataset.messages_field)"
    if not isinstance(messages, list):
        return f"{messages_field!r} must be a list of messages, got {_kind(messages)}"
    if not messages:
        return f"{messages_field!r} is an empty list: a conversation needs messages"
    for i, message in enumerate(messages):
        if problem := _message_problem(message, f"{messages_field}[{i}]", weighted=True):
            return problem
    learned = [
        i for i, m in enumerate(messages) if m["role"] == "assistant" and message_weight(m) == 1
    ]
    if not learned:
        return (
            f"{messages_field!r} has no assistant message with weight 1 (absent weight means "
            "1): nothing in the conversation would be learned"
        )
    if learned[0] == 0:
        return (
            f"{messages_field}[0] is an assistant message with weight 1 and nothing before it "
            "to answer: start with a system or user message, or give it weight 0"
        )
    for i in learned:
        if not messages[i]["content"].strip():
            return (
                f"{messages_field}[{i}].content is empty: an assistant message with weight 1 "
                "needs text to learn (give it weight 0 to keep it as context only)"
            )
    return None


def preference_record_problem(
    record: Any,
    *,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
) -> str | None:
    """Why one preference record is not trainable, or None."""
    if not isinstance(record, Mapping):
        return f"a record must be a JSON object, got {_kind(record)}"
    fields = (
        (prompt_field, "dataset.prompt_field"),
        (chosen_field, "dataset.chosen_field"),
        (rejected_field, "dataset.rejected_field"),
    )
    for name, setting in fields:
        if record.get(name) is None:
            return f"record has no {name!r} ({setting})"
    if problem := _prompt_problem(record[prompt_field], prompt_field):
        return problem
    for name in (chosen_field, rejected_field):
        if problem := _answer_problem(record[name], name):
            return problem
    return None


def template_role(role: str) -> str:
    """The role a chat template renders: OpenAI's `developer` is `system` to templates,
    which (Qwen's, Llama's, ChatML) know no `developer` and would drop or refuse it."""
    return "system" if role == "developer" else role


def message_weight(message: Mapping[str, Any]) -> int:
    """1 if the message is learned (OpenAI's rule: absent weight means 1), else 0. Only for
    messages that passed the checks above."""
    weight = message.get("weight")
    return 1 if weight is None else int(weight)


def answer_text(answer: Any) -> str:
    """The text of a `chosen` or `rejected` answer that passed `preference_record_problem`:
    the string itself, or the content of its one assistant message."""
    if isinstance(answer, str):
        return answer
    message = answer[0] if isinstance(answer, list) else answer
    content: str = message["content"]
    return content


def is_conversational(value: Any) -> bool:
    """Whether a prompt or answer is given as chat messages (rendered with the chat
    template) rather than text."""
    return isinstance(value, list | Mapping)


def _message_problem(message: Any, where: str, *, weighted: bool) -> str | None:
    if not isinstance(message, Mapping):
        return f"{where} must be a message object with 'role' and 'content', got {_kind(message)}"
    role = message.get("role")
    if role in _TOOL_ROLES:
        return f"{where}.role {role!r}: tool calls are not supported"
    if role not in ROLES:
        shown = "missing" if role is None else f"got {role!r}"
        allowed = ", ".join(repr(r) for r in ROLES)
        return f"{where}.role must be one of {allowed}, {shown}"
    for key in message:
        if message[key] is None or key in ("role", "content", "name"):
            continue
        if key in _TOOL_KEYS:
            return f"{where} has {key!r}: tool calls are not supported"
        if key != "weight":
            allowed = ", ".join(MESSAGE_KEYS if weighted else ("role", "content", "name"))
            return f"{where} has unknown key {key!r}; a message's keys are {allowed}"
    content = message.get("content")
    if not isinstance(content, str):
        if isinstance(content, list):
            return (
                f"{where}.content must be a string, got a list of content parts: only text "
                "messages are supported"
            )
        return f"{where}.content must be a string, got {_kind(content)}"
    name = message.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        return f"{where}.name must be a non-empty string, got {_kind(name)}"
    return _weight_problem(message, where, weighted=weighted)


def _weight_problem(message: Mapping[str, Any], where: str, *, weighted: bool) -> str | None:
    weight = message.get("weight")
    if weight is None:
        return None
    if not weighted:
        return f"{where} has 'weight': weights mark learned chat turns; a prompt is never learned"
    if message["role"] != "assistant":
        return f"{where}.weight is allowed on assistant messages only, not on {message['role']!r}"
    # JSON has one kind of number: 1.0 is 1 (and Arrow turns a column's 1s into 1.0 once
    # any record writes 1.0).
    if not isinstance(weight, bool | int | float) or weight not in (0, 1):
        return f"{where}.weight must be 0 or 1, got {weight!r}"
    return None


def prompt_record_problem(record: Any, *, prompt_field: str = "prompt") -> str | None:
    """Why one record of prompts (method grpo's) is not trainable, or None. Its other
    fields are the grader's to read."""
    if not isinstance(record, Mapping):
        return f"a record must be a JSON object, got {_kind(record)}"
    if record.get(prompt_field) is None:
        return f"record has no {prompt_field!r} (dataset.prompt_field)"
    return _prompt_problem(record[prompt_field], prompt_field, answered_by="the completions")


def _prompt_problem(
    prompt: Any, field: str, *, answered_by: str = "the chosen and rejected answers"
) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else f"{field!r} is empty"
    if not isinstance(prompt, list):
        return f"{field!r} must be text or a list of chat messages, got {_kind(prompt)}"
    if not prompt:
        return f"{field!r} is an empty list of messages"
    for i, message in enumerate(prompt):
        if problem := _message_problem(message, f"{field}[{i}]", weighted=False):
            return problem
    if prompt[-1]["role"] != "user":
        return (
            f"{field}[{len(prompt) - 1}].role is {prompt[-1]['role']!r}: a prompt given as "
            f"messages ends with the user turn that {answered_by} reply to"
        )
    return None


def _answer_problem(answer: Any, field: str) -> str | None:
    if isinstance(answer, str):
        return None if answer.strip() else f"{field!r} is empty"
    where = field
    if isinstance(answer, list):
        if len(answer) != 1:
            return (
                f"{field!r} must be text or exactly one assistant message, got a list of "
                f"{len(answer)} messages"
            )
        answer, where = answer[0], f"{field}[0]"
    if not isinstance(answer, Mapping):
        return f"{field!r} must be text or one assistant message, got {_kind(answer)}"
    if problem := _message_problem(answer, where, weighted=False):
        return problem
    if answer["role"] != "assistant":
        return f"{where}.role must be 'assistant' (it answers the prompt), got {answer['role']!r}"
    if not answer["content"].strip():
        return f"{where}.content is empty"
    return None


def _present(record: Mapping[str, Any], key: str) -> bool:
    return record.get(key) is not None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__)
