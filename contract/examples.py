"""Example `POST /v1/runs` bodies for the tutorial setups, as a user would write them.

One place for them: the OpenAPI document offers them in `/docs` (the example dropdown of
`POST /v1/runs` and `POST /v1/runs/validate`), and tests check that each one is a valid
request. Plain dicts, so this module imports nothing of the service.
"""

from __future__ import annotations

from typing import Any

GPT2_ZERO3: dict[str, Any] = {
    "model": "gpt2",
    "task": "causal_lm",
    "dataset": {"source": "fancyzhx/ag_news", "split": "train", "text_field": "text"},
    "training": {
        "max_steps": 200,
        "learning_rate": 1e-5,
        "batch_size_per_worker": 4,
        "seq_length": 512,
    },
    "deepspeed": {"zero_stage": 3},
    "resources": {"num_workers": 2},
    "metadata": {"tutorial": "gpt2-zero3"},
}

# AutoTP: tensor_parallel_size 2 splits each layer over 2 ranks; 4 workers make
# 2 tensor-parallel groups, so the data-parallel size is 2.
QWEN_AUTOTP: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-0.5B",
    "task": "causal_lm",
    "dataset": {
        "source": "Salesforce/wikitext",
        "config": "wikitext-2-raw-v1",
        "split": "train",
        "text_field": "text",
        "eval_split": "validation",
    },
    "training": {
        "max_steps": 500,
        "learning_rate": 2e-5,
        "batch_size_per_worker": 4,
        "seq_length": 1024,
        "lr_scheduler": "cosine",
        "warmup_steps": 50,
    },
    "deepspeed": {"zero_stage": 1, "tensor_parallel_size": 2},
    "resources": {"num_workers": 4, "use_gpu": True},
    "checkpointing": {"every_n_steps": 100},
    "metadata": {"tutorial": "qwen-autotp"},
}

BERT_MRPC_ZERO3: dict[str, Any] = {
    "model": "bert-base-uncased",
    "task": "sequence_classification",
    "dataset": {
        "source": "nyu-mll/glue",
        "config": "mrpc",
        "split": "train",
        "eval_split": "validation",
        "text_field": "sentence1",
        "text_pair_field": "sentence2",
        "label_field": "label",
    },
    "training": {
        "epochs": 3,
        "learning_rate": 2e-5,
        "batch_size_per_worker": 16,
        "seq_length": 128,
        "lr_scheduler": "linear",
    },
    "deepspeed": {"zero_stage": 3},
    "resources": {"num_workers": 2},
    "metadata": {"tutorial": "bert-mrpc"},
}

# Chat SFT with LoRA: OpenAI-format conversations (`messages`; an uploaded file works the
# same), rendered with the model's own chat template; the loss is on assistant turns only.
QWEN_CHAT_LORA: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "dataset": {"source": "HuggingFaceH4/ultrachat_200k", "split": "train_sft", "format": "chat"},
    "training": {
        "epochs": 2,
        "learning_rate": 2e-4,
        "batch_size_per_worker": 4,
        "seq_length": 2048,
        "lr_scheduler": "cosine",
        "warmup_steps": 20,
        "packing": True,
        "gradient_checkpointing": True,
    },
    "lora": {
        "r": 16,
        "alpha": 32,
        "dropout": 0.05,
        "target_modules": "all-linear",
        "export": "both",
    },
    "deepspeed": {"zero_stage": 2, "precision": "bf16"},
    "resources": {"num_workers": 8, "use_gpu": True},
    "metadata": {"tutorial": "qwen-chat-lora"},
}

# DPO: preference pairs (a prompt, a chosen and a rejected answer); with LoRA the reference
# is the starting model with the adapter disabled. `model` may also name an earlier run
# ("run_..."), to start from its exported model.
DPO_LORA: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "method": {"type": "dpo", "beta": 0.1},
    "dataset": {
        "source": "Intel/orca_dpo_pairs",
        "format": "preference",
        "prompt_field": "question",
    },
    "training": {
        "epochs": 1,
        "learning_rate": 5e-6,
        "batch_size_per_worker": 2,
        "gradient_accumulation_steps": 4,
        "seq_length": 1024,
    },
    "lora": {"r": 16, "alpha": 32, "export": "both"},
    "deepspeed": {"zero_stage": 3, "precision": "bf16"},
    "resources": {"num_workers": 8, "use_gpu": True},
    "metadata": {"tutorial": "dpo-lora"},
}

# FastAPI's `openapi_examples`: name → {summary, description, value}; /docs lists them by name.
RUN_REQUEST_EXAMPLES: dict[str, dict[str, Any]] = {
    "gpt2-zero3": {
        "summary": "GPT-2 with ZeRO stage 3",
        "description": "Causal LM fine-tuning of `gpt2` on AG News, parameters, gradients "
        "and optimizer states partitioned over 2 workers.",
        "value": GPT2_ZERO3,
    },
    "qwen2.5-0.5b-autotp": {
        "summary": "Qwen2.5-0.5B with AutoTP (tp=2, dp=2) on WikiText-2",
        "description": "Tensor parallelism of 2 over 4 GPU workers, so two data-parallel "
        "replicas; the hub dataset's config is named in `dataset.config`.",
        "value": QWEN_AUTOTP,
    },
    "bert-mrpc-zero3": {
        "summary": "BERT sequence classification on GLUE MRPC with ZeRO stage 3",
        "description": "Sentence pairs (`sentence1`, `sentence2`) classified by `label`, "
        "evaluated on the validation split.",
        "value": BERT_MRPC_ZERO3,
    },
    "qwen2.5-7b-chat-lora": {
        "summary": "Chat fine-tuning of Qwen2.5-7B-Instruct with LoRA under ZeRO-2",
        "description": "OpenAI-format conversations (an uploaded file with purpose chat "
        "works the same); "
        "the loss is on assistant turns only; rank-16 adapters on every linear layer, "
        "packed sequences that never attend across conversations; exports the adapter "
        "and the merged model (a later run may start from either).",
        "value": QWEN_CHAT_LORA,
    },
    "dpo-lora": {
        "summary": "DPO with LoRA on preference pairs",
        "description": "Preference pairs (prompt, chosen, rejected) against the starting "
        "model as reference (the adapter disabled: no second copy); exports both the "
        "adapter and the merged model. `model` may name an earlier run (`run_...`) to "
        "start from its exported model.",
        "value": DPO_LORA,
    },
}
