"""worker/data/loading.py: packed examples keep their own positions, and the model keeps them apart.

The reference for the rows is transformers' own DataCollatorWithFlattening (positions
restarting at 0, each example's first label ignored); the reference for the model is the
example fed alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.conftest import in_memory_dataset
from worker.data.chat import encode_conversation
from worker.data.loading import (
    IGNORE_INDEX,
    CausalLMCollator,
    model_inputs,
    pack_sequences,
    packs_in_one_row,
    tokens_in,
)

# ChatML's markup spelled as plain text, so that the tiny models' vocabulary covers it.
PLAIN_CHATML = (
    "{% for message in messages %}"
    "{{ '[start]' + message['role'] + '\\n' + message['content'] + '[end]\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '[start]assistant\\n' }}{% endif %}"
)

CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "You answer with a city."},
        {"role": "user", "content": "Where did the Lions play on Monday?"},
        {"role": "assistant", "content": "In Paris."},
    ],
    [
        {"role": "user", "content": "Why did Acme shares rise?"},
        {"role": "assistant", "content": "Strong results on Friday."},
        {"role": "user", "content": "And Globex?"},
        {"role": "assistant", "content": "Markets in Oslo fell."},
    ],
]


def flattened(rows: list[list[int]]) -> dict[str, list[int]]:
    """transformers' padding-free collator on the same examples: one row, positions
    restarting at 0, every example's first label ignored."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": r} for r in rows])
    return {k: batch[k][0].tolist() for k in ("input_ids", "labels", "position_ids")}


class TestPackedRows:
    def test_a_block_is_what_transformers_flattening_makes_of_its_examples(self) -> None:
        rows = [[5, 6, 0], [7, 8], [9, 10, 11]]
        # eos (0) closes every example that does not end with it; 3 + 3 + 4 tokens.
        with_eos = [[5, 6, 0], [7, 8, 0], [9, 10, 11, 0]]

        packed = pack_sequences(
            in_memory_dataset({"input_ids": rows}), seq_length=10, eos_token_id=0
        )

        assert len(packed) == 1
        got = {k: packed[0][k] for k in ("input_ids", "labels", "position_ids")}
        assert got == flattened(with_eos)
        assert got["position_ids"] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3]

    def test_labels_of_prompts_stay_masked(self) -> None:
        rows = in_memory_dataset(
            {"input_ids": [[5, 6, 7, 0], [8, 9, 0]], "labels": [[-100, -100, 7, 0], [8, 9, 0]]}
        )

        packed = pack_sequences(rows, seq_length=7, eos_token_id=0)

        assert packed["labels"] == [[-100, -100, 7, 0, -100, 9, 0]]
        assert packed["position_ids"] == [[0, 1, 2, 3, 0, 1, 2]]

    def test_an_example_cut_by_a_block_starts_the_next_block_at_position_zero(self) -> None:
        rows = in_memory_dataset({"input_ids": [[5, 6, 7, 8, 9, 10], [11, 12, 13]]})

        packed = pack_sequences(rows, seq_length=4, eos_token_id=None)

        assert packed["input_ids"] == [[5, 6, 7, 8], [9, 10, 11, 12]]
        assert packed["position_ids"] == [[0, 1, 2, 3], [0, 1, 0, 1]]

    def test_the_collator_passes_positions_and_the_model_gets_no_mask(self) -> None:
        rows = [
            {"input_ids": [5, 6, 0, 7], "labels": [-100, 6, 0, -100], "position_ids": [0, 1, 2, 0]},
            {"input_ids": [8, 0, 9, 0], "labels": [8, 0, -100, 0], "position_ids": [1, 2, 0, 1]},
        ]

        batch = CausalLMCollator(pad_token_id=1)(rows)
        inputs = model_inputs(batch)

        assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [1, 2, 0, 1]]
        # The mask stays in the batch, for counting tokens; the model must not see it.
        assert tokens_in(batch) == 8
        assert "attention_mask" not in inputs
        assert inputs["use_cache"] is False
        assert inputs["position_ids"] is batch["position_ids"]

    def test_one_row_is_the_layout_flash_attention_reads_packed_examples_from(self) -> None:
        from transformers.modeling_flash_attention_utils import (
            _is_packed_sequence,
            prepare_fa_kwargs_from_position_ids,
        )

        rows = [
            {"input_ids": [5, 6, 0, 7], "labels": [-100, 6, 0, -100], "position_ids": [0, 1, 2, 0]},
            {"input_ids": [8, 0, 9, 0], "labels": [8, 0, -100, 0], "position_ids": [0, 1, 0, 1]},
        ]
        batch = CausalLMCollator(pad_token_id=1)(rows)

        inputs = model_inputs(batch, one_row=True)

        assert inputs["input_ids"].tolist() == [[5, 6, 0, 7, 8, 0, 9, 0]]
        assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
        # The second block's first label would be predicted by the first block's last token.
        assert inputs["labels"].tolist() == [[-100, 6, 0, -100, -100, 0, -100, 0]]
        assert batch["labels"][1, 0] == 8  # the batch itself is left as it was
        # transformers' flash-attention path: rows are read as one sequence each, one row
        # as its examples.
        assert not _is_packed_sequence(batch["position_ids"], batch_size=2)
        assert _is_packed_sequence(inputs["position_ids"], batch_size=1)
        (cu_seqlens, _), _ = prepare_fa_kwargs_from_position_ids(inputs["position_ids"])
        assert cu_seqlens.tolist() == [0, 3, 4, 6, 8]

    @pytest.mark.parametrize(
        ("implementation", "one_row"),
        [
            ("flash_attention_2", True),
            ("flash_attention_3", True),
            ("kernels-community/flash-attn", True),
            ("sdpa", False),
            ("eager", False),
            ("flex_attention", False),
            (None, False),
        ],
    )
    def test_which_attention_needs_one_row(self, implementation: str | None, one_row: bool) -> None:
        assert packs_in_one_row(implementation) is one_row

    def test_unpacked_batches_go_to_the_model_as_they_are(self) -> None:
        batch = CausalLMCollator(pad_token_id=1)([{"input_ids": [3, 4, 5]}, {"input_ids": [6]}])

        assert "position_ids" not in batch
        assert model_inputs(batch) is batch
        assert tokens_in(batch) == 4


@pytest.fixture(scope="module")
def chat_rows(tiny_model_dir: Path) -> list[dict[str, list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = PLAIN_CHATML
    rows = []
    for messages in CONVERSATIONS:
        ids, labels = encode_conversation(messages, tokenizer)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _one_block(rows: list[dict[str, list[int]]], eos: int) -> dict[str, torch.Tensor]:
    """The two conversations packed into exactly one block, collated. Rows with their own
    labels are joined as they are: no eos between them (worker/data/loading.py)."""
    seq_length = sum(len(r["input_ids"]) for r in rows)
    packed = pack_sequences(
        in_memory_dataset({k: [r[k] for r in rows] for k in ("input_ids", "labels")}),
        seq_length=seq_length,
        eos_token_id=eos,
    )
    assert len(packed) == 1
    return CausalLMCollator(pad_token_id=eos)(list(packed))


def _alone(row: dict[str, list[int]], eos: int) -> dict[str, torch.Tensor]:
    return CausalLMCollator(pad_token_id=eos)(
        [{"input_ids": row["input_ids"], "labels": row["labels"]}]
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "model_fixture", ["tiny_llama_dir", "tiny_model_dir"], ids=["llama", "gpt2"]
)
def test_a_packed_conversation_sees_only_itself(
    request: pytest.FixtureRequest,
    chat_rows: list[dict[str, list[int]]],
    model_fixture: str,
    attn: str,
) -> None:
    """The second conversation's logits in the block are its logits alone (so it attends
    to nothing of the first), and the block's summed loss is the two conversations'."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(model_fixture)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=attn, dtype=torch.float32
    ).eval()
    eos = model.config.eos_token_id
    block = _one_block(chat_rows, eos)
    first = len(chat_rows[0]["input_ids"])
    alone = [_alone(row, eos) for row in chat_rows]

    with torch.no_grad():
        packed_logits = model(**model_inputs(block)).logits[0]
        alone_logits = [model(**model_inputs(a)).logits[0] for a in alone]
        # Without the positions, as before: the second conversation attends to the first.
        crossed = model(**block).logits[0]

    torch.testing.assert_close(packed_logits[:first], alone_logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_logits[first:], alone_logits[1], rtol=1e-5, atol=1e-5)
    assert (crossed[first:] - alone_logits[1]).abs().max() > 1e-3
    assert _summed_loss(packed_logits, block["labels"][0]) == pytest.approx(
        sum(_summed_loss(lg, a["labels"][0]) for lg, a in zip(alone_logits, alone, strict=True)),
        rel=1e-5,
    )


def _summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    # As HF's causal-LM loss, summed instead of averaged: label t is predicted at t - 1.
    return float(
        torch.nn.functional.cross_entropy(
            logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum"
        )
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "model_fixture", ["tiny_llama_dir", "tiny_model_dir"], ids=["llama", "gpt2"]
)
def test_blocks_in_one_row_give_the_logits_and_loss_of_the_rows(
    request: pytest.FixtureRequest,
    chat_rows: list[dict[str, list[int]]],
    model_fixture: str,
    attn: str,
) -> None:
    """What flash-attention is fed (`one_row`), checked where it runs here: the same
    logits per token and the same mean loss as the blocks fed as rows."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(model_fixture)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=attn, dtype=torch.float32
    ).eval()
    eos = model.config.eos_token_id
    first, second = chat_rows
    # Two blocks of two conversations each, the second cut across the block boundary.
    seq_length = len(first["input_ids"]) + len(second["input_ids"])
    packed = pack_sequences(
        in_memory_dataset(
            {k: [r[k] for r in (first, second, second, first)] for k in ("input_ids", "labels")}
        ),
        seq_length=seq_length - 3,
        eos_token_id=eos,
    )
    assert len(packed) == 2
    batch = CausalLMCollator(pad_token_id=eos)(list(packed))

    with torch.no_grad():
        rows = model(**model_inputs(batch))
        one_row = model(**model_inputs(batch, one_row=True))

    torch.testing.assert_close(
        one_row.logits.reshape(rows.logits.shape), rows.logits, rtol=1e-5, atol=1e-5
    )
    assert float(one_row.loss) == pytest.approx(float(rows.loss), rel=1e-5)
