"""Chat data: conversations rendered with the tokenizer's chat template, learned on the
assistant turns only.

Records are OpenAI's fine-tuning chat format, `{"messages": [{"role", "content",
"weight"?}]}`. A conversation is rendered once with `tokenizer.apply_chat_template` and
tokenized once; each learned assistant message is found in the rendered text as the part
that the message adds after the template's generation prompt (`<|im_start|>assistant\\n`
in ChatML): its content and the markup that closes it (`<|im_end|>`, which the model must
learn to emit to stop), never the header before it and never a system or user turn.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contract.records import chat_record_problem, message_weight, template_role
from contract.run_request import RunSpec
from worker.data.loading import IGNORE_INDEX

log = logging.getLogger("tuneyard.worker")

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ChatStats:
    """What fitting conversations into training.seq_length cost."""

    conversations: int  # records read
    truncated: int  # cut at seq_length
    dropped: int  # cut before any learned token


def tokenize_chat(
    dataset: Any, tokenizer: Any, *, spec: RunSpec, notes: list[str] | None = None
) -> Any:
    """Token ids and labels per conversation (`tokenize_chat_with_stats`). What fitting
    them into seq_length cost is logged and, with `notes`, added to it for the run's
    events."""
    examples, stats = tokenize_chat_with_stats(dataset, tokenizer, spec=spec)
    if stats.truncated or stats.dropped:
        note = (
            f"chat data: {stats.truncated} of {stats.conversations} conversations longer "
            f"than training.seq_length ({spec.training.seq_length}) were truncated to it; "
            f"{stats.dropped} of them kept no learned assistant token and were dropped"
        )
        log.info("%s", note)
        if notes is not None:
            notes.append(note)
    return examples


def tokenize_chat_with_stats(
    dataset: Any, tokenizer: Any, *, spec: RunSpec
) -> tuple[Any, ChatStats]:
    """A `datasets.Dataset` of `input_ids` and `labels` (IGNORE_INDEX where nothing is
    learned), one row per conversation that keeps a learned token, and what truncation
    cost."""
    field = spec.dataset.messages_field
    seq_length = spec.training.seq_length
    assert seq_length is not None  # resolved first (data/preparation.py's prepare_training)
    _require_template(tokenizer)

    def encode(record: dict[str, Any], index: int) -> dict[str, Any]:
        problem = chat_record_problem(record, messages_field=field)
        if problem:
            raise ValueError(f"record {index}: {problem}")
        try:
            ids, labels = encode_conversation(record[field], tokenizer)
        except ValueError as exc:
            raise ValueError(f"record {index}: {exc}") from exc
        return {
            "input_ids": ids[:seq_length],
            "labels": labels[:seq_length],
            "truncated": len(ids) > seq_length,
        }

    encoded = dataset.map(encode, with_indices=True, remove_columns=dataset.column_names)
    truncated = sum(encoded["truncated"])
    # HF shifts labels inside the model: a label at position 0 is never a target.
    kept = encoded.filter(lambda row: any(t != IGNORE_INDEX for t in row["labels"][1:]))
    stats = ChatStats(
        conversations=len(encoded), truncated=truncated, dropped=len(encoded) - len(kept)
    )
    if len(kept) == 0:
        raise ValueError(
            f"no conversation in dataset field {field!r} keeps a learned assistant token "
            f"within training.seq_length ({seq_length}): {stats.dropped} of "
            f"{stats.conversations} dropped; raise seq_length or shorten the conversations"
        )
    return kept.remove_columns("truncated"), stats


def encode_conversation(
    messages: Sequence[dict[str, Any]], tokenizer: Any
) -> tuple[list[int], list[int]]:
    """The conversation's token ids, and labels that are the ids of the learned assistant
    messages' tokens (weight 1, or no weight) and IGNORE_INDEX elsewhere."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "format 'chat' needs a fast tokenizer (one with offset mappings) to find the "
            "assistant turns in the rendered text"
        )
    chat = _template_messages(messages)
    text = _render(tokenizer, chat)
    spans = [
        _assistant_span(tokenizer, chat, i, text)
        for i, message in enumerate(messages)
        if message["role"] == "assistant" and message_weight(message) == 1
    ]
    # The template writes any BOS itself; the tokenizer must not add a second.
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [
        token if any(_overlaps(offsets, span) for span in spans) else IGNORE_INDEX
        for token, offsets in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return ids, labels


def render_prompt(messages: Sequence[dict[str, Any]], tokenizer: Any) -> list[int]:
    """The token ids of a conversation so far, ending with the template's generation
    prompt: what the model sees before it writes its reply."""
    _require_template(tokenizer)
    return _ids(
        tokenizer, _render(tokenizer, _template_messages(messages), add_generation_prompt=True)
    )


def render_assistant_reply(
    prompt_messages: Sequence[dict[str, Any]], reply_text: str, tokenizer: Any
) -> list[int]:
    """The token ids of an assistant reply as they follow `render_prompt(prompt_messages)`,
    its end-of-turn markup included.

    As TRL's DPOTrainer does, the reply is what tokenizing the conversation with the reply
    adds after the tokenized prompt, so prompt ids + reply ids == the whole conversation's.
    Where a token spans the boundary (a reply that continues the generation prompt's last
    word), the reply is its own characters tokenized alone: the prompt stays as the model
    sees it at inference, and the reply as the tokens it would write after it. A template
    that renders the prompt differently once a reply follows is refused rather than
    trained on a context the model never sees.
    """
    _require_template(tokenizer)
    chat = _template_messages(prompt_messages)
    prompt_text = _render(tokenizer, chat, add_generation_prompt=True)
    text = _render(tokenizer, [*chat, {"role": "assistant", "content": reply_text}])
    if not text.startswith(prompt_text):
        raise ValueError(
            "the chat template's rendering of the prompt (with the generation prompt) is "
            "not the start of its rendering of the prompt followed by the reply: it "
            "rewrites earlier turns once a reply follows, or its generation prompt is not "
            "how it starts an assistant turn; give a dataset.chat_template that renders "
            "earlier turns unchanged"
        )
    prompt = _ids(tokenizer, prompt_text)
    whole = _ids(tokenizer, text)
    if whole[: len(prompt)] == prompt:
        return whole[len(prompt) :]
    return _ids(tokenizer, text[len(prompt_text) :])


def _ids(tokenizer: Any, text: str) -> list[int]:
    # The template writes any BOS itself; the tokenizer must not add a second.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _require_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat data needs a chat template and the model's tokenizer has none: give "
            "dataset.chat_template (a Jinja template, e.g. ChatML's)"
        )


def _template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # `weight` is for training, not for the template to render.
    return [
        {k: template_role(v) if k == "role" else v for k, v in m.items() if k != "weight"}
        for m in messages
    ]


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja's TemplateError, or raise_exception() in the template
        raise ValueError(f"the chat template cannot render this conversation: {exc}") from exc
    # transformers 5 returns the rendered string itself when tokenize=False.
    assert isinstance(text, str)
    return text


def _assistant_span(tokenizer: Any, chat: list[dict[str, Any]], i: int, text: str) -> Span:
    """Where message i's learned text lies in `text`: after the generation prompt that the
    turns before it end with, up to the end of the conversation rendered through it."""
    if i == 0:
        raise ValueError(
            "messages[0] is a learned assistant message with nothing before it; start with "
            "a system or user message, or give it weight 0"
        )
    before = _render(tokenizer, chat[:i], add_generation_prompt=True)
    through = _render(tokenizer, chat[: i + 1])
    if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
        raise ValueError(
            f"the chat template renders the conversation up to messages[{i}] (an assistant "
            "turn) differently from the start of the whole conversation: it rewrites "
            "earlier turns (e.g. drops past reasoning) or its generation prompt is not how "
            "it starts an assistant turn, so the turn to learn cannot be located; give a "
            "dataset.chat_template that renders earlier turns unchanged"
        )
    return len(before), len(through)


def _overlaps(offsets: Sequence[int], span: Span) -> bool:
    # A token is learned when any of its characters is: as transformers'
    # return_assistant_tokens_mask counts a token from its first character to its last.
    start, end = offsets
    if start == end:  # a token of no characters (e.g. a prefix marker) sits at its start
        return span[0] <= start < span[1]
    return start < span[1] and end > span[0]
