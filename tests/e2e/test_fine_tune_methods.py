"""Chat data, LoRA and DPO end to end: the real service, a real local Ray cluster, real
DeepSpeed, tiny locally built Llamas.

- Full-parameter chat SFT under ZeRO-3 on 2 workers: its loss is Hugging Face Trainer's, step
  for step, on the rows transformers' own assistant-token mask (`{% generation %}` markers,
  `return_assistant_tokens_mask`) gives: the loss is on assistant turns only.
- Chat SFT with LoRA under ZeRO-2 (adapter and merged exports) and ZeRO-3 (adapter only):
  each export reloads as a user would (`PeftModel.from_pretrained`, `from_pretrained`) and
  gives the trained engine's logits.
- DPO with LoRA, starting from the ZeRO-2 run's merged export named by its run id: the
  trained adapter prefers the chosen answers over the rejected ones on its training pairs
  more often than not, measured here against the base model with the adapter disabled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.conftest import Service
from tests.e2e.helpers import (
    assert_export_matches_engine,
    assert_succeeded,
    checkpoints,
    metric_series,
    trainer_losses,
)

pytestmark = pytest.mark.e2e

# ChatML as Qwen writes it, with transformers' generation markers around what the assistant
# says and the end-of-turn token that stops it: the reference mask. The newline between turns
# opens the next turn, so an assistant turn ends with <|im_end|> itself.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %}\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)
STEPS = 6
# The tiny tokenizer spells ChatML's markup in many tokens: the first conversation (151
# tokens) is cut here, its first learned token at 95 kept, as the Trainer reference is.
SEQ_LENGTH = 128
LEARNING_RATE = 3e-3
TOLERANCE = 1e-4

CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "market price"},
        {"role": "assistant", "content": "up"},
        {"role": "user", "content": "storm city"},
        {"role": "assistant", "content": "rain"},
    ],
    [
        {"role": "user", "content": "team season goal"},
        {"role": "assistant", "content": "win the league this season"},
    ],
    [
        {"role": "user", "content": "bank vote"},
        {"role": "assistant", "content": "no", "weight": 0},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "yes"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "price"},
        {"role": "assistant", "content": "low price for the city market"},
    ],
]

PAIRS = [
    ("market", "up", "down"),
    ("storm", "rain", "sun"),
    ("team", "win", "lose"),
    ("bank", "vote", "storm"),
    ("price", "low", "high"),
    ("city", "market", "goal"),
    ("season", "goal", "bank"),
    ("vote", "yes", "no"),
]


@pytest.fixture(scope="module")
def chat_rows(service: Service) -> Path:
    path = service.data_dir / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return path


@pytest.fixture(scope="module")
def preference_rows(service: Service) -> Path:
    path = service.data_dir / "pairs.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": chosen,
                    "rejected": rejected,
                }
            )
            + "\n"
            for prompt, chosen, rejected in PAIRS
        )
    )
    return path


def _chat_body(model: Path | str, data: Path, **groups: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": str(model),
        "dataset": {"source": str(data), "format": "chat", "chat_template": CHAT_TEMPLATE},
        "training": {
            "max_steps": STEPS,
            "learning_rate": LEARNING_RATE,
            "seq_length": SEQ_LENGTH,
            "weight_decay": 0.0,
            "batch_size_per_worker": 1,
            "gradient_accumulation_steps": 2,
        },
        "deepspeed": {"precision": "fp32"},
        "resources": {"num_workers": 2},
        "fault_tolerance": {"max_failures": 0},
    }
    for name, values in groups.items():
        body[name] = {**body.get(name, {}), **values} if isinstance(values, dict) else values
    return body


def _run(service: Service, body: dict[str, Any]) -> dict[str, Any]:
    run = service.wait_terminal(service.submit(body)["id"])
    assert_succeeded(service, run)
    return run


# -- full-parameter chat, against Trainer on transformers' assistant mask --------------------


def _reference_rows(model_dir: Path) -> list[dict[str, list[int]]]:
    """transformers' own rendering and assistant mask, weight-0 turns unmasked by hand (the
    mask knows no weights): what tuneyard must learn from."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for messages in CONVERSATIONS:
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        out = tokenizer.apply_chat_template(
            plain,
            chat_template=CHAT_TEMPLATE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            tokenizer_kwargs={"return_offsets_mapping": True},
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        # A weight-0 turn's characters carry no loss: find its tokens by their offsets.
        text = tokenizer.apply_chat_template(plain, chat_template=CHAT_TEMPLATE, tokenize=False)
        for m in messages:
            if m.get("weight") == 0:
                start = text.index(m["content"] + "<|im_end|>")
                end = start + len(m["content"] + "<|im_end|>")
                for i, (a, b) in enumerate(out["offset_mapping"]):
                    if a >= start and b <= end and b > a:
                        mask[i] = 0
        labels = [t if keep else -100 for t, keep in zip(ids, mask, strict=True)]
        rows.append({"input_ids": ids[:SEQ_LENGTH], "labels": labels[:SEQ_LENGTH]})
    return rows


def test_full_parameter_chat_learns_assistant_turns_only_as_trainer_does(
    service: Service, tiny_llama_dir: Path, chat_rows: Path, tmp_path: Path
) -> None:
    run = _run(
        service,
        _chat_body(
            tiny_llama_dir,
            chat_rows,
            deepspeed={"zero_stage": 3},
            checkpointing={"export_hf": False},
        ),
    )
    got = metric_series(service, run["id"], "loss")
    assert sorted(got) == list(range(1, STEPS + 1))
    events = service.http.get(f"/v1/runs/{run['id']}/events").json()["data"]
    fitted = [e["message"] for e in events if e["type"] == "data_fitted"]
    assert len(fitted) == 1 and "1 of 4 conversations" in fitted[0], events
    expected = trainer_losses(
        tiny_llama_dir,
        _reference_rows(tiny_llama_dir),
        tmp_path,
        steps=STEPS,
        learning_rate=LEARNING_RATE,
    )
    for step, want in enumerate(expected, start=1):
        assert abs(got[step] - want) <= TOLERANCE * max(1.0, abs(want)), (step, got, expected)


# -- LoRA exports ----------------------------------------------------------------------------


def _assert_adapter_matches_engine(adapter: Path, base: Path, probe_file: Path) -> Any:
    """The adapter on a fresh base, loaded as peft users do, gives the engine's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    probe = torch.load(probe_file, weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    at_top = logits.float().gather(-1, probe["top_ids"])
    diff = (at_top - probe["top_logits"]).abs()[probe["attention_mask"].bool()]
    assert float(diff.max()) <= 1e-3 * float(probe["top_logits"].abs().max()), float(diff.max())
    return model


@pytest.fixture(scope="module")
def lora_zero2_run(service: Service, tiny_llama_dir: Path, chat_rows: Path) -> dict[str, Any]:
    return _run(
        service,
        _chat_body(
            tiny_llama_dir,
            chat_rows,
            deepspeed={"zero_stage": 2},
            lora={"r": 8, "alpha": 16, "dropout": 0.0, "export": "both"},
        ),
    )


def test_lora_zero2_exports_an_adapter_and_a_merged_model_that_reload(
    service: Service, tiny_llama_dir: Path, lora_zero2_run: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM

    run = lora_zero2_run
    adapters = checkpoints(service, run["id"], "adapter")
    full = checkpoints(service, run["id"], "hf")
    assert len(adapters) == 1 and len(full) == 1
    # The merged model, posted last, is the run's model.
    assert run["output"]["model_path"] == full[0]["path"]
    merged = assert_export_matches_engine(run, auto=AutoModelForCausalLM)
    # Merged means no adapter modules left: a plain model of the base's shape.
    assert not any("lora" in name for name, _ in merged.named_parameters())
    probe = Path(full[0]["path"]).parent / "export_check.pt"
    adapted = _assert_adapter_matches_engine(Path(adapters[0]["path"]), tiny_llama_dir, probe)
    # The adapter trained: the adapted model is not the base.
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    with torch.no_grad():
        assert not torch.allclose(adapted(input_ids=ids).logits, base(input_ids=ids).logits)


def test_lora_zero3_adapter_export_reloads(
    service: Service, tiny_llama_dir: Path, chat_rows: Path
) -> None:
    run = _run(
        service,
        _chat_body(
            tiny_llama_dir,
            chat_rows,
            deepspeed={"zero_stage": 3},
            lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        ),
    )
    (adapter,) = checkpoints(service, run["id"], "adapter")
    assert checkpoints(service, run["id"], "hf") == []
    assert run["output"]["model_path"] == adapter["path"]
    folder = Path(adapter["path"])
    model = _assert_adapter_matches_engine(
        folder, tiny_llama_dir, folder / ".." / "export_check.pt"
    )
    # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    targeted = {
        n.split(".lora_A.")[0].rsplit(".", 1)[-1]
        for n, _ in model.named_parameters()
        if ".lora_A." in n
    }
    assert targeted == {"q_proj", "v_proj"}


# -- DPO -------------------------------------------------------------------------------------


def _answer_logps(model: Any, tokenizer: Any, prompt: str, answer: str) -> float:
    prompt_ids = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    full = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    assert full[: len(prompt_ids)] == prompt_ids
    ids = torch.tensor([full])
    with torch.no_grad():
        logps = model(input_ids=ids).logits.log_softmax(-1)[0, :-1]
    targets = ids[0, 1:]
    picked = logps.gather(-1, targets[:, None])[:, 0]
    return float(picked[len(prompt_ids) - 1 :].sum())


def test_dpo_with_lora_from_an_earlier_run_prefers_the_chosen_answers(
    service: Service, lora_zero2_run: dict[str, Any], preference_rows: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sft = lora_zero2_run
    beta = 0.5
    body = {
        "model": sft["id"],
        "method": {"type": "dpo", "beta": beta},
        "dataset": {"source": str(preference_rows), "format": "preference"},
        "training": {
            "max_steps": 8,
            "learning_rate": 1e-2,
            "seq_length": 64,
            "weight_decay": 0.0,
            "batch_size_per_worker": 2,
            "gradient_accumulation_steps": 2,
        },
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "resources": {"num_workers": 2},
        "fault_tolerance": {"max_failures": 0},
    }
    run = _run(service, body)
    base_path = sft["output"]["model_path"]
    assert run["spec"]["model"] == base_path

    # The logged DPO metrics, every step.
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies"):
        assert sorted(metric_series(service, run["id"], name)) == list(range(1, 9)), name
    first_loss = metric_series(service, run["id"], "loss")[1]
    # Step 1: the policy is the reference (LoRA's B starts at zero), so the loss is log 2.
    assert abs(first_loss - 0.6931) < 1e-3, first_loss

    # Measured here, not read from the logs: implicit rewards of the trained adapter against
    # the base (the DPO reference) on the training pairs.
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    (adapter,) = checkpoints(service, run["id"], "adapter")
    policy = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_path), adapter["path"]
    ).eval()
    wins = 0
    for prompt, chosen, rejected in PAIRS:
        margin = (
            _answer_logps(policy, tokenizer, prompt, chosen)
            - _answer_logps(base, tokenizer, prompt, chosen)
        ) - (
            _answer_logps(policy, tokenizer, prompt, rejected)
            - _answer_logps(base, tokenizer, prompt, rejected)
        )
        wins += margin > 0
    assert wins / len(PAIRS) > 0.5, wins
