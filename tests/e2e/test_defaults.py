"""The defaults users take: each fine-tuning method in full, and each LoRA path, at every
default, from a request that sets only what it must — the model, the data (and the fields its
format needs), `method` for DPO, `task` for classification, `lora: {}` — and
`training.max_steps`. Everything else is the contract's default: 2 workers, ZeRO-3,
precision auto, weight_decay 0.01, learning rate, LoRA r/alpha/dropout/all-linear/adapter
export, and no seq_length, which the worker then chooses from the data and says so.

This is where every LoRA run once failed at its first step (the default weight decay made
an empty optimizer group) and an OpenAI job on a short-context model was refused (the old
fixed seq_length 512) while the suite, which always set those fields, stayed green.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Service
from tests.e2e.helpers import (
    CLOSE_TO_ANSWER,
    assert_adapter_loads,
    assert_succeeded,
    chat_records,
    metric_series,
    preference_records,
    prompt_records,
    run_events,
    tiny_chat_llama,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

STEPS = 2
WAIT_S = 840  # within pytest's per-test timeout (pyproject: 900 s)
CHOICE = re.compile(r"training\.seq_length was not set: chose (\d+) ")


@dataclass(frozen=True)
class Case:
    method: str  # text, prompt_completion, chat, dpo, grpo, classification
    lora: bool

    @property
    def id(self) -> str:
        return f"{self.method}-{'lora' if self.lora else 'full'}"


METHODS = ["text", "prompt_completion", "chat", "dpo", "grpo", "classification"]
# LoRA on a causal LM is one path whatever the data's format (prompt/completion and chat
# differ only in their labels, which the full runs check) and model family: chat stands for
# Llama's, text for GPT-2's (its Conv1D layers). DPO (its reference is the base with the
# adapter off), GRPO and classification (a new head trained in full beside the adapter)
# are LoRA paths of their own.
LORA_METHODS = {"text", "chat", "dpo", "grpo", "classification"}
CASES = [
    Case(method, lora)
    for method in METHODS
    for lora in (False, True)
    if not lora or method in LORA_METHODS
]


@dataclass
class Models:
    gpt2: Path  # plain text
    llama: Path  # prompt/completion: no chat template needed
    chat_llama: Path  # chat and DPO: its tokenizer has a chat template of its own
    bert: Path  # classification


def _model(case: Case, models: Models) -> Path:
    return {
        "text": models.gpt2,
        "prompt_completion": models.llama,
        "chat": models.chat_llama,
        "dpo": models.chat_llama,
        "grpo": models.chat_llama,
        "classification": models.bert,
    }[case.method]


def _dataset(case: Case, data_dir: Path) -> dict[str, Any]:
    """The dataset group a user must write for the method, over a local file of its
    format: the source, and the fields (or format) the default would not read."""
    from app.cli.tiny_assets import (
        news_lines,
        write_jsonl_dataset,
        write_prompt_completion_dataset,
    )

    path = data_dir / f"defaults-{case.method}.jsonl"
    if case.method == "text":
        return {"source": str(write_jsonl_dataset(path, rows=32))}
    if case.method == "prompt_completion":
        write_prompt_completion_dataset(path, rows=32)
        return {"source": str(path), "format": "prompt_completion"}
    if case.method == "chat":
        return {"source": str(write_jsonl(path, chat_records(16))), "format": "chat"}
    if case.method == "dpo":
        return {"source": str(write_jsonl(path, preference_records(16))), "format": "preference"}
    if case.method == "grpo":
        return {"source": str(write_jsonl(path, prompt_records(16))), "format": "prompt"}
    lines = news_lines(32, seed=3)
    rows = [{"text": line, "label": int("shares" in line or "Markets" in line)} for line in lines]
    return {"source": str(write_jsonl(path, rows)), "label_field": "label"}


def request_for(case: Case, models: Models, data_dir: Path) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": str(_model(case, models)),
        "dataset": _dataset(case, data_dir),
        "training": {"max_steps": STEPS},
    }
    if case.method == "dpo":
        body["method"] = {"type": "dpo"}
    if case.method == "grpo":
        body["method"] = {"type": "grpo", "grader": CLOSE_TO_ANSWER}
    if case.method == "classification":
        body["task"] = "sequence_classification"
    if case.lora:
        body["lora"] = {}
    return body


@pytest.fixture(scope="module")
def models(
    tiny_models_root: Path, tiny_model_dir: Path, tiny_llama_dir: Path, tiny_bert_dir: Path
) -> Models:
    return Models(
        gpt2=tiny_model_dir,
        llama=tiny_llama_dir,
        chat_llama=tiny_chat_llama(tiny_models_root),
        bert=tiny_bert_dir,
    )


@pytest.fixture(scope="module")
def submitted(service: Service, models: Models) -> dict[str, str]:
    """Every case's run, submitted before any is waited for: the queue never idles."""
    return {
        case.id: service.submit(request_for(case, models, service.data_dir))["id"] for case in CASES
    }


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_run_on_the_defaults_succeeds(
    case: Case, service: Service, models: Models, submitted: dict[str, str]
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    run = service.wait_terminal(submitted[case.id], timeout_s=WAIT_S)
    assert_succeeded(service, run)

    # It ran on the defaults this module is about, not on something set for it.
    spec = run["spec"]
    assert spec["training"]["seq_length"] is None
    assert spec["training"]["weight_decay"] == 0.01
    assert spec["deepspeed"]["zero_stage"] == 3
    assert spec["resources"]["num_workers"] == 2
    if case.lora:
        assert spec["lora"]["r"] == 16 and spec["lora"]["export"] == "adapter", spec["lora"]

    # The worker chose seq_length from the data, and said what and why in an event.
    notes = [
        e["message"]
        for e in run_events(service, run["id"])
        if e["message"] and CHOICE.search(e["message"])
    ]
    assert len(notes) == 1, notes
    chosen = int(CHOICE.search(notes[0]).group(1))  # type: ignore[union-attr]
    base = _model(case, models)
    cap = AutoConfig.from_pretrained(base).max_position_embeddings
    assert 2 <= chosen <= cap and (chosen % 64 == 0 or chosen == cap), notes[0]
    if case.method == "grpo":
        # The prompt's share: the default completion's 256 tokens are left free.
        assert spec["method"]["num_generations"] == 8, spec["method"]
        assert spec["method"]["max_completion_tokens"] == 256, spec["method"]
        limit = f"less method.max_completion_tokens (256), {cap - 256}"
        assert f"at most the model's maximum positions {limit}" in notes[0], notes[0]
        _assert_rewarded(service, run["id"])
    else:
        assert f"at most the model's maximum positions, {cap}" in notes[0], notes[0]
    # The examples here are all shorter than the models' positions: none is cut.
    assert "no example is truncated" in notes[0], notes[0]

    auto = (
        AutoModelForSequenceClassification
        if case.method == "classification"
        else AutoModelForCausalLM
    )
    export = Path(run["output"]["model_path"])
    if case.lora:
        # The default export is the adapter alone, which peft loads onto the base model.
        assert not (export / "config.json").exists(), sorted(p.name for p in export.iterdir())
        assert_adapter_loads(export, base, auto=auto)
    else:
        model = auto.from_pretrained(export)
        assert model.config.model_type == AutoConfig.from_pretrained(base).model_type


def _assert_rewarded(service: Service, run_id: str) -> None:
    """Each step of a grpo run reports what its completions were graded, TRL's names."""
    rewards = metric_series(service, run_id, "reward")
    assert sorted(rewards) == list(range(1, STEPS + 1)), rewards
    assert all(0.0 <= r <= 1.0 for r in rewards.values()), rewards
    assert set(metric_series(service, run_id, "grade_failures").values()) == {0.0}
    # 2 workers x 1 prompt x 8 completions of at most 256 tokens.
    lengths = metric_series(service, run_id, "completions/mean_length").values()
    assert all(0 < n <= 256 for n in lengths), lengths
    flat = metric_series(service, run_id, "frac_reward_zero_std")
    assert sorted(flat) == sorted(rewards), flat
    # What the learned completions measure, at the steps that learned from any.
    learned = sorted(step for step, frac in flat.items() if frac < 1.0)
    assert learned, flat
    for name in ("kl", "entropy", "clip_ratio/region_mean"):
        assert sorted(metric_series(service, run_id, name)) == learned, name
