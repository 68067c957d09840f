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
