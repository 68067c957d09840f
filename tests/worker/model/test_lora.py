"""LoRA runs (worker/model/lora.py): the worker's training, exports and resume against peft.

Ours: worker.model.loading.build_model (which applies the adapters) and build_optimizer in a
real one-rank DeepSpeed engine on CPU (gloo), in a spawned process as a Ray Train rank
runs. The reference: peft's get_peft_model on the same base with torch's AdamW, stepped by
hand on the same batches from the same adapter weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from app.ports import free_port
from contract.run_request import RunSpec
from tests.worker.one_rank import join_one_rank_group, spawn_ranks

STEPS = 4
SAVED_AT = 2
LEARNING_RATE = 5e-3
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
# Dropout off: the two sides draw from different random streams.
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


def spec_for(
    model: Path,
    storage: Path,
    *,
    stage: int,
    export: str,
    targets: Any = "all-linear",
    offload: str = "none",
) -> RunSpec:
    return RunSpec.model_validate(
        {
            "run_id": "run_lora",
            "attempt": 1,
            "storage_path": str(storage),
            "model": str(model),
            "dataset": {"source": "/unused.jsonl"},
            "lora": {**LORA, "target_modules": targets, "export": export},
            "training": {
                "max_steps": STEPS,
                "learning_rate": LEARNING_RATE,
                "weight_decay": WEIGHT_DECAY,
                "decay_bias_and_norm": True,
                "max_grad_norm": MAX_GRAD_NORM,
                "batch_size_per_worker": 2,
                "seq_length": 16,
            },
            "deepspeed": {"zero_stage": stage, "precision": "fp32", "offload_optimizer": offload},
            "resources": {"num_workers": 1},
        }
    )


def batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    """The same batch every step: random tokens are unlearnable as a stream, but a
    repeated batch is memorised, so a working adapter must lower its loss."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 16), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # a padded row: the probe checks only real positions
    labels = ids.masked_fill(mask == 0, -100)
    return [
        {"input_ids": ids.clone(), "attention_mask": mask.clone(), "labels": labels.clone()}
        for _ in range(STEPS)
    ]


def _engine(spec: RunSpec, tokenizer: Any) -> tuple[Any, Any]:
    import deepspeed

    from contract.deepspeed_config import resolve_deepspeed_config
    from worker.model.loading import build_model
    from worker.training.optimizer import build_optimizer

    config = resolve_deepspeed_config(spec, bf16_supported=False, hidden_size=32)
    loaded = build_model(spec, tokenizer, None, ds_config=config, precision="fp32")
    optimizer, scheduler = build_optimizer(spec, loaded.module, total_steps=STEPS)
    engine, *_ = deepspeed.initialize(
        model=loaded.module, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    return engine, loaded


def _step(engine: Any, batch: dict[str, Any]) -> float:
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def _whole(module: Any) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _train_ours(rank: int, spec_json: str, port: int, out: str) -> None:
    """One rank: STEPS steps, a checkpoint at SAVED_AT, the export, then a fresh engine
    resumed from the checkpoint for the remaining steps."""
    from worker.model.checkpoints import export_hf_model
    from worker.model.loading import load_tokenizer

    join_one_rank_group(port)
    spec = RunSpec.model_validate_json(spec_json)
    tokenizer = load_tokenizer(spec)
    data = batches(len(tokenizer))
    engine, loaded = _engine(spec, tokenizer)
    start = _whole(engine.module)
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    losses = []
    for step, batch in enumerate(data, start=1):
        losses.append(_step(engine, batch))
        if step == SAVED_AT:
            engine.save_checkpoint(str(Path(out, "ckpt")), tag="step_2")
    torch.save({"start": start, "end": _whole(engine.module)}, Path(out, "weights.pt"))
    exports = export_hf_model(
        engine, tokenizer, spec, rank=0, probe=data[0], zero3_config=loaded.zero3_config
    )
    del engine
    resumed, _ = _engine(spec, tokenizer)
    resumed.load_checkpoint(str(Path(out, "ckpt")), tag="step_2")
    resumed_losses = [_step(resumed, batch) for batch in data[SAVED_AT:]]
    Path(out, "result.json").write_text(
        json.dumps(
            {
                "losses": losses,
                "resumed_losses": resumed_losses,
                "trainable": trainable,
                "exports": [[e.kind, e.path, e.max_diff] for e in exports],
            }
        )
    )
    # DeepSpeed's shared-memory comm op aborts the interpreter's normal exit.
    os._exit(0)


def reference_model(model_dir: Path, spec: RunSpec, start: dict[str, torch.Tensor]) -> Any:
    """peft's own model, from the engine's starting adapters (the same names: both are a
    PeftModel of the same base)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from worker.model.lora import lora_config

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, lora_config(spec))
    model.load_state_dict(start)
    return model


def train_reference(model: Any, data: list[dict[str, Any]]) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    losses = []
    model.train()
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def logits_of(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.float()


def assert_same_logits(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> None:
    diff = float((a - b).abs()[mask.bool()].max())
    assert diff < 1e-4 * float(b.abs().max()), diff


@pytest.mark.parametrize(
    ("stage", "export", "offload"),
    [(0, "adapter", "none"), (2, "merged", "none"), (3, "both", "none"), (3, "adapter", "cpu")],
    ids=str,
)
def test_lora_run_matches_peft_exports_and_resumes(
    stage: int, export: str, offload: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = spec_for(
        tiny_llama_dir, tmp_path / "storage", stage=stage, export=export, offload=offload
    )
    spawn_ranks(_train_ours, args=(spec.model_dump_json(), free_port(), str(tmp_path)), nprocs=1)
    result = json.loads((tmp_path / "result.json").read_text())
    weights = torch.load(tmp_path / "weights.pt")
    start, end = weights["start"], weights["end"]
    data = batches(len(AutoTokenizer.from_pretrained(tiny_llama_dir)))

    # Only the adapters train, every targeted layer has them, and the base stays as loaded.
    assert result["trainable"] and all("lora_" in n for n in result["trainable"])
    reference = reference_model(tiny_llama_dir, spec, start)
    peft_trainable = [n for n, p in reference.named_parameters() if p.requires_grad]
    assert sorted(result["trainable"]) == sorted(peft_trainable)
    for name in start:
        if name in result["trainable"]:
            if ".lora_B." in name:  # lora_A moves too, but B starts at zero
                assert not torch.equal(start[name], end[name]), name
        else:
            assert torch.equal(start[name], end[name]), name

    # Step for step, peft with torch's AdamW on the same batches.
    theirs = train_reference(reference, data)
    assert result["losses"] == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    assert theirs[-1] < theirs[0]
    # A fresh engine loaded from the step-2 checkpoint continues as the run did.
    assert result["resumed_losses"] == pytest.approx(result["losses"][SAVED_AT:], rel=1e-6)

    # The exports, reloaded as a user would, answer as peft's trained model does.
    expected = logits_of(reference, data[0])
    out = tmp_path / "storage" / "run_lora" / "export"
    kinds = [kind for kind, _, _ in result["exports"]]
    assert kinds == {"adapter": ["adapter"], "merged": ["hf"], "both": ["adapter", "hf"]}[export]
    paths = dict((kind, Path(path)) for kind, path, _ in result["exports"])
    if "adapter" in paths:
        folder = paths["adapter"]
        assert folder == (out / "adapter" if export == "both" else out)
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tiny_llama_dir)
        assert (folder / "adapter_model.safetensors").is_file()
        assert not (folder / "model.safetensors").exists()
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        adapter = PeftModel.from_pretrained(base, folder)
        assert_same_logits(logits_of(adapter, data[0]), expected, data[0]["attention_mask"])
    if "hf" in paths:
        assert paths["hf"] == out
        merged = AutoModelForCausalLM.from_pretrained(out)
        assert not any("lora" in n for n, _ in merged.named_parameters())
        assert_same_logits(logits_of(merged, data[0]), expected, data[0]["attention_mask"])
    assert (tmp_path / "storage" / "run_lora" / "export_check.pt").is_file()


def test_an_adapter_names_the_model_as_the_run_gave_it(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # A model in object storage trains from the node's temporary copy; the adapter must name
    # the URI the run was given, which is what its users can load the base from.
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from worker.data.remote_sources import cache_root
    from worker.model.lora import lora_config, save_adapter

    given = "s3://models/run_1/export"
    copy = cache_root() / "0123abcd" / "export"
    spec = spec_for(tiny_llama_dir, tmp_path, stage=0, export="adapter").model_copy(
        update={"model": str(copy), "model_name": given}
    )
    module = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), lora_config(spec))
    save_adapter(module, module.state_dict(), tmp_path / "adapter", spec=spec)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == given
