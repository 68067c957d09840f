"""worker/data/loading.py: prompt/completion examples, packing, and classification examples."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.run_request import DatasetSpec
from tests.worker.conftest import in_memory_dataset, write_jsonl
from worker.data.loading import (
    IGNORE_INDEX,
    CausalLMCollator,
    ClassificationCollator,
    label_ids,
    load_raw_dataset,
    pack_sequences,
    tokenize_classification,
    tokenize_dataset,
    tokenize_prompt_completion,
)

PROMPTS = [
    "Where did the Lions beat the Tigers?",
    "Why did Acme shares rise?",
    "What closed schools in Oslo?",
]
COMPLETIONS = [
    " In Paris on Monday.",
    " Strong results.",
    " Heavy rain on Tuesday closed schools in Oslo.",
]


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer: Any) -> Any:
    """The tiny tokenizer with a BOS of its own (`<s>`) put before every encoded text,
    as Llama's tokenizer does."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<|endoftext|>", pad_token="<pad>"
    )
    assert wrapped.bos_token_id == bos != wrapped.eos_token_id
    return wrapped


@pytest.fixture(scope="module")
def tiny_gpt2(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def flat(rows: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(rows))


def plain_ids(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


def qa_dataset(prompts: list[str] = PROMPTS, completions: list[str] = COMPLETIONS) -> Any:
    return in_memory_dataset(
        {"question": prompts, "answer": completions, "source": ["wire"] * len(prompts)}
    )


def tokenize_qa(dataset: Any, tokenizer: Any, seq_length: int = 64) -> Any:
    return tokenize_prompt_completion(
        dataset,
        tokenizer,
        prompt_field="question",
        completion_field="answer",
        seq_length=seq_length,
    )


class TestTokenizePromptCompletion:
    def test_prompt_is_masked_and_completion_plus_eos_is_learned(self, tokenizer: Any) -> None:
        eos = tokenizer.eos_token_id
        # The tiny tokenizer adds nothing, so the expected ids are the parts' plain ids.
        assert tokenizer(PROMPTS[0]).input_ids == plain_ids(tokenizer, PROMPTS[0])

        tokenized = tokenize_qa(qa_dataset(), tokenizer)

        assert sorted(tokenized.column_names) == ["input_ids", "labels"]
        assert len(tokenized) == len(PROMPTS)
        for row, prompt, completion in zip(tokenized, PROMPTS, COMPLETIONS, strict=True):
            p, c = plain_ids(tokenizer, prompt), plain_ids(tokenizer, completion)
            assert row["input_ids"] == p + c + [eos]
            assert row["labels"] == [IGNORE_INDEX] * len(p) + c + [eos]
            assert eos not in p + c

    def test_no_special_token_between_prompt_and_completion(self, bos_tokenizer: Any) -> None:
        bos, eos = bos_tokenizer.bos_token_id, bos_tokenizer.eos_token_id
        assert bos_tokenizer(PROMPTS[0]).input_ids[0] == bos

        tokenized = tokenize_qa(qa_dataset(), bos_tokenizer)

        for row, prompt, completion in zip(tokenized, PROMPTS, COMPLETIONS, strict=True):
            p, c = plain_ids(bos_tokenizer, prompt), plain_ids(bos_tokenizer, completion)
            assert row["input_ids"] == [bos, *p, *c, eos]
            assert [i for i, t in enumerate(row["input_ids"]) if t == bos] == [0]
            assert row["labels"] == [IGNORE_INDEX] * (1 + len(p)) + c + [eos]

    def test_truncates_to_seq_length(self, tokenizer: Any) -> None:
        p = plain_ids(tokenizer, PROMPTS[2])
        c = plain_ids(tokenizer, COMPLETIONS[2])
        seq_length = len(p) + 3
        assert len(c) > 3

        tokenized = tokenize_qa(qa_dataset(PROMPTS[2:], COMPLETIONS[2:]), tokenizer, seq_length)

        assert tokenized["input_ids"] == [p + c[:3]]
        assert tokenized["labels"] == [[IGNORE_INDEX] * len(p) + c[:3]]

    def test_example_whose_completion_is_cut_away_is_dropped(self, tokenizer: Any) -> None:
        long_prompt = " ".join(PROMPTS)
        short = plain_ids(tokenizer, PROMPTS[1])
        seq_length = len(plain_ids(tokenizer, long_prompt))
        assert len(short) < seq_length - 3

        tokenized = tokenize_qa(
            qa_dataset([long_prompt, PROMPTS[1]], [COMPLETIONS[0], COMPLETIONS[1]]),
            tokenizer,
            seq_length,
        )

        assert tokenized["input_ids"] == [
            (short + plain_ids(tokenizer, COMPLETIONS[1]) + [tokenizer.eos_token_id])[:seq_length]
        ]

    def test_one_completion_token_within_seq_length_is_kept(self, tokenizer: Any) -> None:
        p = plain_ids(tokenizer, PROMPTS[0])
        first = plain_ids(tokenizer, COMPLETIONS[0])[0]

        tokenized = tokenize_qa(qa_dataset(PROMPTS[:1], COMPLETIONS[:1]), tokenizer, len(p) + 1)

        assert tokenized["labels"] == [[IGNORE_INDEX] * len(p) + [first]]

    def test_a_target_at_position_zero_is_not_enough(self, tokenizer: Any) -> None:
        """Nothing predicts the first token; an example needs a target after it."""
        c = plain_ids(tokenizer, COMPLETIONS[0])
        dataset = qa_dataset(["", PROMPTS[1]], COMPLETIONS[:2])
        assert plain_ids(tokenizer, "") == []

        kept = tokenize_qa(dataset, tokenizer, seq_length=2)

        assert kept["labels"][0] == c[:2]
        with pytest.raises(ValueError, match="'answer'"):
            tokenize_qa(dataset, tokenizer, seq_length=1)

    def test_nothing_left_to_learn_names_the_completion_field(self, tokenizer: Any) -> None:
        seq_length = min(len(plain_ids(tokenizer, p)) for p in PROMPTS)

        with pytest.raises(ValueError, match=rf"'answer'.*\({seq_length}\)"):
            tokenize_qa(qa_dataset(), tokenizer, seq_length)


class TestPromptCompletionBatches:
    """Collated prompt/completion batches: only completion tokens (and eos) carry loss."""

    @pytest.fixture
    def rows(self, tokenizer: Any) -> list[dict[str, list[int]]]:
        return list(tokenize_qa(qa_dataset(), tokenizer))

    def spans(self, tokenizer: Any) -> list[tuple[int, int]]:
        """(prompt length, sequence length) per example, from the texts alone."""
        prompt_ids = [plain_ids(tokenizer, p) for p in PROMPTS]
        return [
            (len(prompt), len(prompt) + len(plain_ids(tokenizer, c)) + 1)
            for prompt, c in zip(prompt_ids, COMPLETIONS, strict=True)
        ]

    def test_prompt_and_padding_positions_are_ignored(self, tokenizer: Any, rows: Any) -> None:
        batch = CausalLMCollator(pad_token_id=tokenizer.pad_token_id)(rows)

        spans = self.spans(tokenizer)
        width = max(n for _, n in spans)
        assert batch["labels"].shape == (len(rows), width)
        assert min(n for _, n in spans) < width  # some rows are padded
        for i, (prompt, n) in enumerate(spans):
            labels, ids = batch["labels"][i], batch["input_ids"][i]
            assert (labels[:prompt] == IGNORE_INDEX).all()
            assert torch.equal(labels[prompt:n], ids[prompt:n])
            assert (labels[n:] == IGNORE_INDEX).all()
            assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)

    def test_model_loss_is_cross_entropy_over_completion_targets_only(
        self, tokenizer: Any, tiny_gpt2: Any, rows: Any
    ) -> None:
        batch = CausalLMCollator(pad_token_id=tokenizer.pad_token_id)(rows)
        logits = tiny_gpt2(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.detach()
        logits.requires_grad_(True)

        # The target at position t is predicted from position t - 1 (HF shifts by one);
        # targets are the completion tokens and the eos, found from the texts alone.
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        spans = self.spans(tokenizer)
        targets = [(i, t) for i, (prompt, n) in enumerate(spans) for t in range(prompt, n)]
        manual = -torch.stack(
            [log_probs[i, t - 1, batch["input_ids"][i, t]] for i, t in targets]
        ).mean()

        loss = tiny_gpt2.loss_function(logits, batch["labels"], tiny_gpt2.config.vocab_size)
        with torch.no_grad():
            model_loss = tiny_gpt2(**batch).loss

        assert torch.allclose(model_loss, manual, atol=1e-6)
        assert torch.allclose(loss, manual, atol=1e-6)
        # Exactly the positions that predict a completion token get a gradient: nothing
        # flows from prompt tokens or padding.
        loss.backward()
        assert logits.grad is not None
        has_gradient = logits.grad.abs().sum(dim=-1) > 0
        expected = torch.zeros_like(has_gradient)
        for i, t in targets:
            expected[i, t - 1] = True
        assert torch.equal(has_gradient, expected)

    def test_learning_the_prompt_too_would_give_another_loss(
        self, tokenizer: Any, tiny_gpt2: Any, rows: Any
    ) -> None:
        """The masking is not a no-op: the same batch with prompt labels kept differs."""
        collate = CausalLMCollator(pad_token_id=tokenizer.pad_token_id)
        masked = collate(rows)
        unmasked = collate([{"input_ids": r["input_ids"]} for r in rows])

        with torch.no_grad():
            assert not torch.allclose(tiny_gpt2(**masked).loss, tiny_gpt2(**unmasked).loss)


class TestPackSequences:
    def test_blocks_are_the_concatenation_with_eos_between_examples(self, tokenizer: Any) -> None:
        eos = tokenizer.eos_token_id
        texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
        tokenized = tokenize_dataset(
            in_memory_dataset({"text": texts}), tokenizer, text_field="text", seq_length=64
        )
        examples = [[*plain_ids(tokenizer, text), eos] for text in texts]
        stream = [t for ids in examples for t in ids]
        # Each example's first token is no target: alone, nothing before it predicts it.
        targets = [t for ids in examples for t in [IGNORE_INDEX, *ids[1:]]]
        seq_length = 8
        assert len(stream) % seq_length != 0  # so a partial tail is dropped

        packed = pack_sequences(tokenized, seq_length=seq_length, eos_token_id=eos)

        assert sorted(packed.column_names) == ["input_ids", "labels", "position_ids"]
        assert len(packed) == len(stream) // seq_length
        assert all(len(row) == seq_length for row in packed["input_ids"])
        assert flat(packed["input_ids"]) == stream[: len(packed) * seq_length]
        assert flat(packed["labels"]) == targets[: len(packed) * seq_length]

    def test_no_second_eos_after_an_example_ending_in_eos(self) -> None:
        rows = in_memory_dataset({"input_ids": [[5, 6, 0], [7, 8], [9, 0]]})

        packed = pack_sequences(rows, seq_length=4, eos_token_id=0)

        assert packed["input_ids"] == [[5, 6, 0, 7], [8, 0, 9, 0]]

    def test_without_eos_token_examples_are_just_joined(self) -> None:
        rows = in_memory_dataset({"input_ids": [[5, 6, 0], [7, 8], [9, 0]]})

        packed = pack_sequences(rows, seq_length=3, eos_token_id=None)

        assert packed["input_ids"] == [[5, 6, 0], [7, 8, 9]]

    def test_labels_travel_with_their_tokens(self) -> None:
        rows = in_memory_dataset(
            {
                "input_ids": [[5, 6, 7, 0], [8, 9, 10], [11, 12, 0]],
                "labels": [[-100, 6, 7, 0], [-100, -100, 10], [-100, 12, 0]],
            }
        )

        packed = pack_sequences(rows, seq_length=3, eos_token_id=0)

        # Rows with labels are joined as they are: the truncated middle example gains no
        # eos. The block [0, 8, 9] has no target after its first position (HF shifts labels
        # by one), so it is dropped rather than trained on with a NaN loss.
        assert packed["input_ids"] == [[5, 6, 7], [10, 11, 12]]
        assert packed["labels"] == [[-100, 6, 7], [10, -100, 12]]

    def test_rows_with_labels_learn_no_token_unpacked_rows_would_not(self) -> None:
        # ChatML rows end in `<|im_end|>\n` (here 3, 4), not in eos (0): packing must not
        # append a learned eos after the final turn, nor after a user turn or a cut.
        rows = in_memory_dataset(
            {
                "input_ids": [[5, 6, 7, 3, 4], [8, 9, 3, 4], [10, 11, 12, 13]],
                "labels": [[-100, -100, 7, 3, -100], [-100, 9, 3, -100], [-100, -100, -100, 13]],
            }
        )

        packed = pack_sequences(rows, seq_length=13, eos_token_id=0)

        assert packed["input_ids"] == [[5, 6, 7, 3, 4, 8, 9, 3, 4, 10, 11, 12, 13]]
        learned = [t for t in packed["labels"][0] if t != IGNORE_INDEX]
        assert learned == [7, 3, 9, 3, 13]

    def test_packed_prompt_completion_masks_exactly_the_prompts(self, tokenizer: Any) -> None:
        tokenized = tokenize_qa(qa_dataset(PROMPTS * 2, COMPLETIONS * 2), tokenizer)
        stream: list[int] = []
        is_prompt: list[bool] = []
        for p, c in zip(PROMPTS * 2, COMPLETIONS * 2, strict=True):
            prompt, target = plain_ids(tokenizer, p), plain_ids(tokenizer, c)
            stream += [*prompt, *target, tokenizer.eos_token_id]
            is_prompt += [True] * len(prompt) + [False] * (len(target) + 1)
        seq_length = 16
        kept = len(stream) // seq_length * seq_length
        assert len(stream) > kept  # so a partial tail is dropped

        packed = pack_sequences(
            tokenized, seq_length=seq_length, eos_token_id=tokenizer.eos_token_id
        )

        assert len(packed) * seq_length == kept
        ids, labels = flat(packed["input_ids"]), flat(packed["labels"])
        assert ids == stream[:kept]
        assert [label == IGNORE_INDEX for label in labels] == is_prompt[:kept]
        assert [lab for lab in labels if lab != IGNORE_INDEX] == [
            t for t, prompt in zip(ids, is_prompt, strict=False) if not prompt
        ]

    def test_fewer_tokens_than_one_block_is_refused(self) -> None:
        rows = in_memory_dataset({"input_ids": [[5, 6, 7], [8, 9]]})

        with pytest.raises(ValueError, match=r"fewer than seq_length \(8\)"):
            pack_sequences(rows, seq_length=8, eos_token_id=0)

    def test_every_block_has_a_target(self) -> None:
        """A block holding only prompt tokens after position 0 gives the model nothing to
        predict: HF's mean loss over no targets is NaN, in training and in evaluation."""
        rows = in_memory_dataset(
            {
                "input_ids": [[5, 6, 0], [7, 0], [11, 12, 13, 14]],
                "labels": [[-100, 6, 0], [-100, 0], [-100, -100, -100, 14]],
            }
        )

        packed = pack_sequences(rows, seq_length=4, eos_token_id=0)

        assert all(any(t != IGNORE_INDEX for t in row[1:]) for row in packed["labels"])


class TestLabelIds:
    def test_integer_labels_are_their_own_ids(self) -> None:
        assert label_ids(in_memory_dataset({"label": [2, 0, 1, 0]}), "label") == [0, 1, 2]

    def test_integer_labels_keep_ids_for_values_absent_from_the_data(self) -> None:
        assert label_ids(in_memory_dataset({"stars": [3, 0, 3]}), "stars") == [0, 1, 2, 3]

    def test_string_labels_are_sorted(self) -> None:
        dataset = in_memory_dataset({"label": ["pos", "neg", "neu", "neg", "pos"]})
        assert label_ids(dataset, "label") == ["neg", "neu", "pos"]

    def test_negative_integer_labels_are_refused(self) -> None:
        with pytest.raises(ValueError, match=r"'grade'.*>= 0"):
            label_ids(in_memory_dataset({"grade": [1, -1, 0]}), "grade")


class TestTokenizeClassification:
    SENTENCES = ("Acme shares rose.", "Heavy rain in Oslo.", "The Lions won.")
    PAIRS = ("Markets rallied.", "Schools closed.", "The Tigers lost.")

    def test_text_and_label_ids(self, tokenizer: Any) -> None:
        dataset = in_memory_dataset({"sentence": self.SENTENCES, "label": ["pos", "neg", "pos"]})

        tokenized = tokenize_classification(
            dataset,
            tokenizer,
            text_field="sentence",
            text_pair_field=None,
            label_field="label",
            labels=["neg", "pos"],
            seq_length=64,
        )

        assert sorted(tokenized.column_names) == ["input_ids", "label"]
        assert tokenized["input_ids"] == [tokenizer(s).input_ids for s in self.SENTENCES]
        assert tokenized["label"] == [1, 0, 1]

    def test_text_pair_and_truncation(self, bos_tokenizer: Any) -> None:
        dataset = in_memory_dataset({"a": self.SENTENCES, "b": self.PAIRS, "label": [2, 0, 1]})

        tokenized = tokenize_classification(
            dataset,
            bos_tokenizer,
            text_field="a",
            text_pair_field="b",
            label_field="label",
            labels=[0, 1, 2],
            seq_length=8,
        )

        bos = bos_tokenizer.bos_token_id
        for row, a, b in zip(tokenized, self.SENTENCES, self.PAIRS, strict=True):
            a_ids, b_ids = plain_ids(bos_tokenizer, a), plain_ids(bos_tokenizer, b)
            assert len(a_ids) + len(b_ids) + 1 > 8
            assert len(row["input_ids"]) == 8
            assert row["input_ids"][0] == bos
            # Both texts keep their first tokens, in order, after the one BOS.
            body = row["input_ids"][1:]
            assert any(body == a_ids[:k] + b_ids[: 7 - k] for k in range(1, 7))
        assert tokenized["label"] == [2, 0, 1]

    def test_pair_encoding_is_the_tokenizer_pair_encoding(self, tokenizer: Any) -> None:
        dataset = in_memory_dataset({"a": self.SENTENCES, "b": self.PAIRS, "label": [0, 1, 0]})

        tokenized = tokenize_classification(
            dataset,
            tokenizer,
            text_field="a",
            text_pair_field="b",
            label_field="label",
            labels=[0, 1],
            seq_length=64,
        )

        assert tokenized["input_ids"] == [
            plain_ids(tokenizer, a) + plain_ids(tokenizer, b)
            for a, b in zip(self.SENTENCES, self.PAIRS, strict=True)
        ]

    def test_unknown_label_is_named(self, tokenizer: Any) -> None:
        dataset = in_memory_dataset({"text": self.SENTENCES, "mood": ["pos", "meh", "neg"]})

        with pytest.raises(ValueError, match=r"'meh'.*'mood'"):
            tokenize_classification(
                dataset,
                tokenizer,
                text_field="text",
                text_pair_field=None,
                label_field="mood",
                labels=["neg", "pos"],
                seq_length=64,
            )


class TestClassificationCollator:
    def test_pads_right_to_the_longest_with_one_label_per_example(self) -> None:
        rows = [
            {"input_ids": [5, 6, 7], "label": 1},
            {"input_ids": [8], "label": 0},
            {"input_ids": [9, 10], "label": 2},
        ]

        batch = ClassificationCollator(pad_token_id=1)(rows)

        assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1], [9, 10, 1]]
        assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
        assert batch["labels"].tolist() == [1, 0, 2]
        assert batch["labels"].shape == (3,)
        assert all(t.dtype == torch.long for t in batch.values())

    def test_tokenized_examples_collate(self, tokenizer: Any) -> None:
        texts = ["Rain.", "Acme shares rose 3 percent on Friday."]
        tokenized = tokenize_classification(
            in_memory_dataset({"text": texts, "label": [1, 0]}),
            tokenizer,
            text_field="text",
            text_pair_field=None,
            label_field="label",
            labels=[0, 1],
            seq_length=64,
        )

        batch = ClassificationCollator(pad_token_id=tokenizer.pad_token_id)(list(tokenized))

        longest = len(tokenizer(texts[1]).input_ids)
        assert batch["input_ids"].shape == (2, longest)
        assert batch["input_ids"][1].tolist() == tokenizer(texts[1]).input_ids
        assert batch["labels"].tolist() == [1, 0]


class TestLoadRawDatasetFields:
    ROWS = tuple(
        {"text": f"Line {i}.", "pair": f"Pair {i}.", "label": i % 2, "prompt": "Q?", "answer": "A."}
        for i in range(10)
    )

    def write(self, tmp_path: Path, drop: str | None = None) -> Path:
        rows = [{k: v for k, v in row.items() if k != drop} for row in self.ROWS]
        return write_jsonl(tmp_path / "d.jsonl", rows)

    def test_classification_reads_text_and_label(self, tmp_path: Path) -> None:
        spec = DatasetSpec(source=str(self.write(tmp_path)), text_pair_field="pair")

        dataset = load_raw_dataset(spec, task="sequence_classification")

        assert dataset["label"] == [i % 2 for i in range(10)]

    @pytest.mark.parametrize(
        ("drop", "spec_fields", "setting"),
        [
            ("label", {}, "dataset.label_field"),
            ("label", {"label_field": "label"}, "dataset.label_field"),
            ("pair", {"text_pair_field": "pair"}, "dataset.text_pair_field"),
            ("text", {}, "dataset.text_field"),
        ],
    )
    def test_classification_missing_field_is_named(
        self, tmp_path: Path, drop: str, spec_fields: dict[str, str], setting: str
    ) -> None:
        spec = DatasetSpec(source=str(self.write(tmp_path, drop=drop)), **spec_fields)

        with pytest.raises(ValueError) as err:
            load_raw_dataset(spec, task="sequence_classification")

        assert f"'{drop}'" in str(err.value)
        assert setting in str(err.value)

    def test_label_field_is_only_required_for_classification(self, tmp_path: Path) -> None:
        spec = DatasetSpec(source=str(self.write(tmp_path, drop="label")))

        assert len(load_raw_dataset(spec, task="causal_lm")) == 10

    @pytest.mark.parametrize(
        ("drop", "setting"),
        [("prompt", "dataset.prompt_field"), ("answer", "dataset.completion_field")],
    )
    def test_prompt_completion_missing_field_is_named(
        self, tmp_path: Path, drop: str, setting: str
    ) -> None:
        spec = DatasetSpec(
            source=str(self.write(tmp_path, drop=drop)),
            format="prompt_completion",
            completion_field="answer",
        )

        with pytest.raises(ValueError) as err:
            load_raw_dataset(spec)

        assert f"'{drop}'" in str(err.value)
        assert setting in str(err.value)

    def test_prompt_completion_does_not_need_a_text_field(self, tmp_path: Path) -> None:
        spec = DatasetSpec(
            source=str(self.write(tmp_path, drop="text")),
            format="prompt_completion",
            completion_field="answer",
        )

        dataset = load_raw_dataset(spec)

        assert dataset["prompt"] == ["Q?"] * 10

    def test_split_slices_a_local_file(self, tmp_path: Path) -> None:
        source = str(self.write(tmp_path))
        texts = [row["text"] for row in self.ROWS]

        head = load_raw_dataset(DatasetSpec(source=source, split="train[:50%]"))
        tail = load_raw_dataset(DatasetSpec(source=source), split="train[50%:]")

        assert head["text"] == texts[:5]
        assert tail["text"] == texts[5:]
