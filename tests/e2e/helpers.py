"""Assertions shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.e2e.conftest import Service


def assert_succeeded(service: Service, run: dict[str, Any]) -> None:
    assert run["status"] == "succeeded", (run["error"], service.log_path.read_text()[-2000:])


def metric_series(service: Service, run_id: str, name: str) -> dict[int, float]:
    page = service.http.get(f"/v1/runs/{run_id}/metrics", params={"name": name}).json()
    return {m["step"]: m["value"] for m in page["data"]}


def checkpoints(service: Service, run_id: str, kind: str) -> list[dict[str, Any]]:
    data = service.http.get(f"/v1/runs/{run_id}/checkpoints").json()["data"]
    return [c for c in data if c["kind"] == kind]


def assert_export_matches_engine(
    run: dict[str, Any], *, auto: Any, export: Path | None = None, check: Path | None = None
) -> Any:
    """Load the export as a user would and compare its logits with the trained engine's
    top logits on the probe row the worker saved; returns the loaded model. `export` and
    `check`: local copies of the export and its check file (object storage)."""
    export = export or Path(run["output"]["model_path"])
    probe = torch.load(check or export.parent / "export_check.pt", weights_only=True)
    assert "logits" not in probe  # the check keeps the top few per position, never all
    assert probe["input_ids"].shape[0] == 1 and probe["input_ids"].shape[1] <= 128
    model = auto.from_pretrained(export).eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    at_top = logits.float().gather(-1, probe["top_ids"])
    diff = (at_top - probe["top_logits"]).abs()
    if logits.dim() == 3:
        diff = diff[probe["attention_mask"].bool()]
    assert float(diff.max()) <= 1e-3 * float(probe["top_logits"].abs().max()), float(diff.max())
    return model


def trainer_losses(
    model_dir: Path,
    rows: list[dict[str, Any]],
    out: Path,
    *,
    steps: int,
    learning_rate: float,
) -> list[float]:
    """The reference: Hugging Face Trainer in one process, every row in one batch (so the
    order it samples them in does not matter), constant learning rate, no weight decay,
    clipping at 1.0; its logged loss of each of `steps` steps."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        if "position_ids" in batch[0]:
            # Packed blocks (all one length): the model finds each block's rows from the
            # restarting positions, with no mask and no cache, as tuneyard feeds them.
            return {
                **{k: torch.tensor([r[k] for r in batch]) for k in batch[0]},
                "use_cache": False,
            }
        longest = max(len(r["input_ids"]) for r in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        labels = torch.full((len(batch), longest), -100, dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            mask[i, :n] = 1
            labels[i, :n] = torch.tensor(r["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=len(rows),
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=42,
        remove_unused_columns=False,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=collate
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == steps
    return losses


# -- shared by the modules that run what users write (documented examples, defaults) --------

# ChatML as Qwen's instruct models write it: a model family users fine-tune with chat data.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_chat_llama(root: Path, *, max_positions: int = 2048) -> Path:
    """A tiny Llama whose tokenizer has a chat template of its own, as an instruct model's
    has, and `max_positions` positions; built once under `root` (the session's tiny-model
    folder), then reused by every module that asks for the same one."""
    from transformers import AutoTokenizer

    from app.cli.tiny_assets import build_tiny_llama

    folder = root / f"llama-chat-{max_positions}"
    if not (folder / "config.json").exists():
        build_tiny_llama(folder, max_positions=max_positions)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.save_pretrained(folder)
    return folder


def chat_records(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """OpenAI-format conversations of news-like text: a system turn now and then, one or
    two user/assistant exchanges."""
    from app.cli.tiny_assets import news_lines

    lines = news_lines(4 * n, seed=seed)
    records = []
    for i in range(n):
        messages = [{"role": "system", "content": "Answer with the news."}] if i % 3 == 0 else []
        for turn in range(1 + i % 2):
            messages.append({"role": "user", "content": lines[4 * i + 2 * turn].split(" in ")[0]})
            messages.append({"role": "assistant", "content": lines[4 * i + 2 * turn + 1]})
        records.append({"messages": messages})
    return records


def preference_records(
    n: int, *, prompt_field: str = "prompt", chat_prompts: bool = True, seed: int = 0
) -> list[dict[str, Any]]:
    """DPO pairs: a prompt (chat messages, or plain text), a chosen and a rejected answer."""
    from app.cli.tiny_assets import news_lines

    lines = news_lines(3 * n, seed=seed)
    records = []
    for i in range(n):
        prompt = lines[3 * i].split(" in ")[0]
        records.append(
            {
                prompt_field: [{"role": "user", "content": prompt}] if chat_prompts else prompt,
                "chosen": lines[3 * i + 1],
                "rejected": lines[3 * i + 2],
            }
        )
    return records


# A grpo grader whose scores spread on a random tiny model (so that steps learn): how close
# the completion is to the record's `answer` (prompt_records' word).
CLOSE_TO_ANSWER = {
    "type": "text_similarity",
    "name": "answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}


def prompt_records(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """GRPO prompts as OpenAI's RFT data has them (a user turn to answer) and the word a
    string check grader looks for in the answer."""
    from app.cli.tiny_assets import news_lines

    records = []
    for line in news_lines(n, seed=seed):
        words = line.split()
        records.append(
            {"prompt": [{"role": "user", "content": " ".join(words[:4])}], "answer": words[-1]}
        )
    return records


def rft_records(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """OpenAI's RFT data: prompt_records' conversations as `messages` (every other one
    with a `developer` turn first, as OpenAI's RFT examples write the instructions) and
    the `answer` a grader reads."""
    developer = {"role": "developer", "content": "Answer with one word."}
    return [
        {"messages": [developer] * (i % 2) + r["prompt"], "answer": r["answer"]}
        for i, r in enumerate(prompt_records(n, seed=seed))
    ]


def small_grpo_request(models_root: Path, data: Path) -> dict[str, Any]:
    """A grpo run of few, short completions on the tiny chat Llama, prompt_records' `data`
    split into training and evaluation prompts, graded by CLOSE_TO_ANSWER: the groups the
    tests add to their own."""
    return {
        "model": str(tiny_chat_llama(models_root)),
        "dataset": {
            "source": str(data),
            "format": "prompt",
            "split": "train[:75%]",
            "eval_split": "train[75%:]",
        },
        "method": {
            "type": "grpo",
            "grader": CLOSE_TO_ANSWER,
            "num_generations": 4,
            "max_completion_tokens": 8,
        },
    }


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_events(service: Service, run_id: str) -> list[dict[str, Any]]:
    page = service.http.get(f"/v1/runs/{run_id}/events", params={"limit": 1000}).json()
    events: list[dict[str, Any]] = page["data"]
    return events


def assert_adapter_loads(adapter: Path, base: Path | str, *, auto: Any) -> Any:
    """A LoRA export is an adapter folder that peft loads onto the base model, as users
    load it; returns the adapted model."""
    import json

    from peft import PeftModel

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA", config
    assert config["base_model_name_or_path"] == str(base), config
    model = PeftModel.from_pretrained(auto.from_pretrained(base), adapter).eval()
    assert any(".lora_A." in name for name, _ in model.named_parameters())
    return model
