"""Tiny judges for score_model graders, built locally: a random one with a chat template,
and a rigged one whose greedy answer to any conversation is known in advance."""

from __future__ import annotations

from pathlib import Path

# ChatML, as Qwen's instruct models write it.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Byte-level BPE writes a newline as this character.
NEWLINE = "\u010a"


def build_chat_judge(folder: Path, *, max_positions: int = 512, sharpen: float = 1.0) -> Path:
    """A randomly initialised tiny Llama whose tokenizer has a chat template. `sharpen`
    scales its attention and residual writes: freshly initialised, its attention is nearly
    uniform and every prompt gets much the same answer; at 5 the answer depends on the
    prompt, and on whatever a batch's padding lets it see."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from app.cli.tiny_assets import build_tiny_llama

    build_tiny_llama(folder, max_positions=max_positions)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    if sharpen != 1.0:
        model = LlamaForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            for layer in model.model.layers:
                for linear in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.o_proj,
                    layer.mlp.down_proj,
                ):
                    linear.weight.mul_(sharpen)
        model.save_pretrained(folder)
    return folder


def build_rigged_judge(folder: Path, *, answer: str) -> Path:
    """A tiny chat Llama that answers every conversation with `answer` (distinct characters,
    no newline), greedily.

    Its attention and MLP outputs are zeroed, so the hidden state at each position is the
    embedding of that position's token: the next token depends on the current one alone (a
    bigram model). The embeddings of the generation prompt's last token (a newline) and of
    the answer's characters are one-hot, and the output head maps each to its successor:
    newline to the first character, each character to the next, the last one to eos. A
    real model, loaded and generating as any judge does; only its weights are chosen."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    build_chat_judge(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chain = [NEWLINE, *answer]
    assert len(set(chain)) == len(chain), "each token needs its own successor"
    ids = [tokenizer.convert_tokens_to_ids(token) for token in chain]
    assert tokenizer.unk_token_id not in ids, chain
    successors = [*ids[1:], tokenizer.eos_token_id]
    model = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for slot, (token, successor) in enumerate(zip(ids, successors, strict=True)):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, slot] = 1.0
            model.lm_head.weight[successor, slot] = 10.0
    model.save_pretrained(folder)
    return folder
