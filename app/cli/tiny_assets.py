"""A tiny model, tokenizer and dataset built locally, for the demo and the tests.

No model or data hub is reachable on the machines this project runs on, so nothing here
downloads: the tokenizer is trained on generated text, the model is randomly initialised.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_TEAMS = ["Lions", "Tigers", "Falcons", "Rovers", "United", "Rangers", "Comets", "Giants"]
_CITIES = ["Paris", "Lagos", "Osaka", "Denver", "Lima", "Oslo", "Cairo", "Perth"]
_COMPANIES = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay", "Soylent"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_TEMPLATES = [
    "The {team} beat the {team2} in {city} on {day}.",
    "{company} shares rose {n} percent on {day} after strong results.",
    "Heavy rain in {city} closed schools on {day}.",
    "{company} will open a new office in {city} next year.",
    "The {team} signed a new coach before the match in {city}.",
    "Markets in {city} fell {n} percent as {company} cut its forecast.",
]


def news_lines(n: int, *, seed: int = 0) -> list[str]:
    """Short news-like sentences: regular enough that a tiny model's loss visibly falls."""
    rng = random.Random(seed)
    return [
        rng.choice(_TEMPLATES).format(
            team=rng.choice(_TEAMS),
            team2=rng.choice(_TEAMS),
            city=rng.choice(_CITIES),
            company=rng.choice(_COMPANIES),
            day=rng.choice(_DAYS),
            n=rng.randint(1, 9),
        )
        for _ in range(n)
    ]


def write_jsonl_dataset(path: Path, *, rows: int = 512, field: str = "text", seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for line in news_lines(rows, seed=seed):
            f.write(json.dumps({field: line}) + "\n")
    return path


def build_tokenizer(folder: Path, *, vocab_size: int = 512) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(news_lines(4000, seed=1), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<pad>",
    )
    wrapped.save_pretrained(folder)
    return wrapped


def build_tiny_gpt2(folder: Path, *, n_positions: int = 128) -> Path:
    """A ~100k-parameter GPT-2 with its tokenizer, saved with `save_pretrained`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = GPT2Config(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        n_positions=n_positions,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def build_tiny_llama(folder: Path, *, max_positions: int = 128) -> Path:
    """A tiny Llama (4 heads, 2 key/value heads) for AutoTP: its heads split over 2 ranks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def build_tiny_bert(folder: Path, *, num_labels: int = 2, max_positions: int = 128) -> Path:
    """A tiny BERT for sequence classification, as in the GLUE/MRPC tutorial."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = BertConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    config.num_labels = num_labels
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def write_paraphrase_dataset(path: Path, *, rows: int = 400, seed: int = 0) -> Path:
    """MRPC-like pairs: label 1 when the second sentence repeats the first's subject."""
    rng = random.Random(seed)
    lines = news_lines(rows * 2, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(rows):
            first = lines[2 * i]
            same = rng.random() < 0.5
            second = first if same else lines[2 * i + 1]
            f.write(
                json.dumps({"sentence1": first, "sentence2": second, "label": int(same)}) + "\n"
            )
    return path


def write_prompt_completion_dataset(path: Path, *, rows: int = 400, seed: int = 0) -> Path:
    """Headline → city: the completion is learnable from the prompt."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(rows):
            team = rng.choice(_TEAMS)
            city = _CITIES[_TEAMS.index(team) % len(_CITIES)]  # the home ground: learnable
            f.write(
                json.dumps({"prompt": f"The {team} played in", "completion": f" {city}."}) + "\n"
            )
    return path
