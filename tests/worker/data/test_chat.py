"""worker/data/chat.py: conversations rendered with a chat template, learned on the weighted
assistant turns only.

References nobody here wrote: transformers' `return_assistant_tokens_mask` on a template
with `{% generation %}` markers, and TRL's Qwen2.5 template with its training variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contract.run_request import RunSpec
from tests.worker.conftest import in_memory_dataset
from worker.data.chat import (
    ChatStats,
    encode_conversation,
    render_assistant_reply,
    render_prompt,
    tokenize_chat,
    tokenize_chat_with_stats,
)
from worker.data.loading import IGNORE_INDEX

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The same rendering, with transformers' generation markers around what an assistant turn
# learns (weight 1 or none): the reference for the labels.
CHATML_WITH_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if message.weight is not defined or message.weight == 1 %}"
    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SYSTEM = "You answer with a city."
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Where did the Lions play on Monday?"},
    {"role": "assistant", "content": "In Paris."},
    {"role": "user", "content": "And the Tigers?"},
    {"role": "assistant", "content": "In Lagos, I think.", "weight": 0},
    {"role": "user", "content": "Are you sure?"},
    {"role": "assistant", "content": "Yes: in Lima on Friday."},
]


@pytest.fixture(scope="module")
def chatml(tiny_model_dir: Path) -> Any:
    """The tiny tokenizer with ChatML's two markers as special tokens and its template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def chat_spec(seq_length: int = 512, **dataset: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "model": "/models/tiny",
            "dataset": {"source": "/data/chat.jsonl", "format": "chat", **dataset},
            "training": {"seq_length": seq_length},
            "run_id": "run-chat",
            "attempt": 1,
            "storage_path": "/storage",
        }
    )


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def learned(labels: list[int]) -> list[bool]:
    return [label != IGNORE_INDEX for label in labels]


class TestLabels:
    def test_only_the_weighted_assistant_turns_and_their_end_markup_are_learned(
        self, chatml: Any
    ) -> None:
        # The rendering in pieces that tokenize on their own (they meet at newlines and
        # special tokens), each marked learned or not.
        pieces = [
            (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", False),
            ("<|im_start|>user\nWhere did the Lions play on Monday?<|im_end|>\n", False),
            ("<|im_start|>assistant\n", False),
            ("In Paris.<|im_end|>\n", True),
            ("<|im_start|>user\nAnd the Tigers?<|im_end|>\n", False),
            ("<|im_start|>assistant\nIn Lagos, I think.<|im_end|>\n", False),  # weight 0
            ("<|im_start|>user\nAre you sure?<|im_end|>\n", False),
            ("<|im_start|>assistant\n", False),
            ("Yes: in Lima on Friday.<|im_end|>\n", True),
        ]
        expected_ids: list[int] = []
        expected_labels: list[int] = []
        for text, is_learned in pieces:
            piece = ids_of(chatml, text)
            expected_ids += piece
            expected_labels += piece if is_learned else [IGNORE_INDEX] * len(piece)

        ids, labels = encode_conversation(CONVERSATION, chatml)

        assert ids == expected_ids
        assert labels == expected_labels
        targets = [t for t in labels if t != IGNORE_INDEX]
        assert chatml.decode(targets) == "In Paris.<|im_end|>\nYes: in Lima on Friday.<|im_end|>\n"
        im_start, im_end = chatml.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        assert targets.count(im_end) == 2
        assert im_start not in targets

    def test_a_developer_message_is_rendered_as_system(self, chatml: Any) -> None:
        # OpenAI's `developer` is `system` to a chat template (ChatML knows no developer).
        as_developer = [{**CONVERSATION[0], "role": "developer"}, *CONVERSATION[1:]]
        assert CONVERSATION[0]["role"] == "system"
        assert encode_conversation(as_developer, chatml) == encode_conversation(
            CONVERSATION, chatml
        )
        assert render_prompt(as_developer[:2], chatml) == render_prompt(CONVERSATION[:2], chatml)

    def test_labels_match_transformers_assistant_mask_from_generation_markers(
        self, chatml: Any
    ) -> None:
        reference = chatml.apply_chat_template(
            CONVERSATION,
            chat_template=CHATML_WITH_GENERATION,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )

        ids, labels = encode_conversation(CONVERSATION, chatml)

        assert ids == list(reference["input_ids"])
        assert learned(labels) == [bool(m) for m in reference["assistant_masks"]]
        assert any(reference["assistant_masks"])

    def test_labels_match_trls_qwen2_5_training_template_but_for_the_header_newline(
        self, chatml: Any
    ) -> None:
        """TRL's training variant of Qwen2.5's template opens the learned part one newline
        early, before the content (`<|im_start|>assistant` {% generation %} `\\n`...): the
        same tokens but that one per turn, which the generation prompt holds anyway."""
        from trl.chat_template_utils import (
            qwen2_5_chat_template,
            qwen2_5_training_chat_template,
        )

        messages = [m for m in CONVERSATION if "weight" not in m]  # TRL knows no weights
        reference = chatml.apply_chat_template(
            messages,
            chat_template=qwen2_5_training_chat_template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        chatml.chat_template = qwen2_5_chat_template
        try:
            ids, labels = encode_conversation(messages, chatml)
        finally:
            chatml.chat_template = CHATML

        assert ids == list(reference["input_ids"])
        theirs = [bool(m) for m in reference["assistant_masks"]]
        ours = learned(labels)
        trl_only = [i for i in range(len(ids)) if theirs[i] and not ours[i]]
        ours_only = [i for i in range(len(ids)) if ours[i] and not theirs[i]]
        assert ours_only == []
        assert [chatml.decode([ids[i]]) for i in trl_only] == ["\n", "\n"]
        assert all(chatml.decode(ids[:i]).endswith("<|im_start|>assistant") for i in trl_only)

    def test_a_template_that_rewrites_earlier_turns_is_refused(self, chatml: Any) -> None:
        """Qwen3's template drops the empty reasoning block from every assistant turn but
        the last (TRL ships a training variant because of it)."""
        from trl.chat_template_utils import qwen3_chat_template

        chatml.chat_template = qwen3_chat_template
        try:
            with pytest.raises(ValueError, match=r"rewrites earlier turns.*dataset\.chat_template"):
                encode_conversation(CONVERSATION, chatml)
        finally:
            chatml.chat_template = CHATML

    def test_a_learned_assistant_turn_with_nothing_before_it_is_refused(self, chatml: Any) -> None:
        with pytest.raises(ValueError, match=r"messages\[0\].*weight 0"):
            encode_conversation([{"role": "assistant", "content": "Hello."}], chatml)


class TestChatExamples:
    def test_records_become_input_ids_and_labels(self, chatml: Any) -> None:
        dataset = in_memory_dataset({"messages": [CONVERSATION, CONVERSATION[:3]]})

        examples, stats = tokenize_chat_with_stats(dataset, chatml, spec=chat_spec())

        assert examples.column_names == ["input_ids", "labels"]
        assert [examples[0]["input_ids"], examples[0]["labels"]] == list(
            encode_conversation(CONVERSATION, chatml)
        )
        assert stats == ChatStats(conversations=2, truncated=0, dropped=0)

    def test_a_custom_messages_field(self, chatml: Any) -> None:
        dataset = in_memory_dataset({"dialogue": [CONVERSATION]})

        examples = tokenize_chat(dataset, chatml, spec=chat_spec(messages_field="dialogue"))

        assert len(examples) == 1

    def test_long_conversations_are_cut_and_those_left_with_nothing_to_learn_dropped(
        self, chatml: Any
    ) -> None:
        ids, labels = encode_conversation(CONVERSATION, chatml)
        first_target = learned(labels).index(True)
        last_target = len(labels) - 1
        # Cuts inside the last learned turn: the first turn survives.
        seq_length = last_target - 3
        short = CONVERSATION[:3]
        assert len(encode_conversation(short, chatml)[0]) < seq_length
        late = [*CONVERSATION[:1], {"role": "user", "content": "Lions " * 200}, CONVERSATION[2]]
        dataset = in_memory_dataset({"messages": [CONVERSATION, short, late]})

        examples, stats = tokenize_chat_with_stats(dataset, chatml, spec=chat_spec(seq_length))

        # CONVERSATION cut but kept; `late` cut before its only learned turn.
        assert stats == ChatStats(conversations=3, truncated=2, dropped=1)
        assert len(examples) == 2
        assert examples[0]["input_ids"] == ids[:seq_length]
        assert examples[0]["labels"] == labels[:seq_length]
        assert first_target < seq_length

    def test_no_conversation_left_is_refused(self, chatml: Any) -> None:
        late = [CONVERSATION[0], {"role": "user", "content": "Lions " * 200}, CONVERSATION[2]]

        with pytest.raises(ValueError, match=r"seq_length \(32\).*1 of 1 dropped"):
            tokenize_chat_with_stats(
                in_memory_dataset({"messages": [late]}), chatml, spec=chat_spec(32)
            )

    def test_no_template_is_refused(self, tiny_model_dir: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        assert tokenizer.chat_template is None

        with pytest.raises(ValueError, match=r"has none: give dataset\.chat_template"):
            tokenize_chat_with_stats(
                in_memory_dataset({"messages": [CONVERSATION]}), tokenizer, spec=chat_spec()
            )

    def test_a_bad_record_is_refused_naming_it(self, chatml: Any) -> None:
        bad = [{"role": "user", "content": "Where?"}, {"role": "wizard", "content": "Oslo."}]
        dataset = in_memory_dataset({"messages": [CONVERSATION, bad]})

        with pytest.raises(ValueError, match=r"record 1: messages\[1\]\.role .*'wizard'"):
            tokenize_chat_with_stats(dataset, chatml, spec=chat_spec())

    def test_a_conversation_with_nothing_to_learn_is_refused(self, chatml: Any) -> None:
        unlearned = [*CONVERSATION[:2], {**CONVERSATION[2], "weight": 0}]
        dataset = in_memory_dataset({"messages": [unlearned]})

        with pytest.raises(ValueError, match=r"record 0: .*no assistant message with weight 1"):
            tokenize_chat_with_stats(dataset, chatml, spec=chat_spec())


class TestPromptAndReply:
    def test_prompt_and_reply_tokens_make_the_conversation(self, chatml: Any) -> None:
        prompt_messages = CONVERSATION[:2]
        reply = "In Paris."

        prompt = render_prompt(prompt_messages, chatml)
        reply_ids = render_assistant_reply(prompt_messages, reply, chatml)

        whole = chatml.apply_chat_template(
            [*prompt_messages, {"role": "assistant", "content": reply}], tokenize=True
        )
        assert prompt + reply_ids == list(whole["input_ids"])
        assert chatml.decode(prompt).endswith("<|im_start|>assistant\n")
        assert chatml.decode(reply_ids) == "In Paris.<|im_end|>\n"
        # The reply's tokens are the ones chat data would learn for the same turn.
        _, labels = encode_conversation(
            [*prompt_messages, {"role": "assistant", "content": reply}], chatml
        )
        assert [t for t in labels if t != IGNORE_INDEX] == reply_ids

    def test_a_prompt_without_a_template_is_refused(self, tiny_model_dir: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

        with pytest.raises(ValueError, match=r"dataset\.chat_template"):
            render_prompt(CONVERSATION[:2], tokenizer)

    def test_a_reply_that_merges_with_the_generation_prompt_is_its_own_tokens(
        self, chatml: Any
    ) -> None:
        # No separator after the generation prompt: "assistant" + "s" tokenize as one word.
        chatml.chat_template = (
            "{% for message in messages %}{{ message['role'] + message['content'] + '\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'assistant' }}{% endif %}"
        )
        prompt_messages = [{"role": "user", "content": "Where?"}]
        try:
            prompt = render_prompt(prompt_messages, chatml)
            reply_ids = render_assistant_reply(prompt_messages, "s", chatml)
        finally:
            chatml.chat_template = CHATML

        whole = ids_of(chatml, "userWhere?\nassistants\n")
        assert whole[: len(prompt)] != prompt  # the boundary token merges
        assert prompt == ids_of(chatml, "userWhere?\nassistant")
        assert reply_ids == ids_of(chatml, "s\n")

    def test_a_reply_after_a_prompt_the_template_rewrites_is_refused(self, chatml: Any) -> None:
        # Marks the conversation's last message: the prompt's last user turn loses its
        # mark once a reply follows.
        chatml.chat_template = (
            "{% for message in messages %}{{ '[last]' if loop.last else '' }}"
            "{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
        )
        try:
            with pytest.raises(ValueError, match=r"rewrites earlier turns.*dataset\.chat_template"):
                render_assistant_reply(CONVERSATION[:2], "In Paris.", chatml)
        finally:
            chatml.chat_template = CHATML
