"""Which parameters get weight decay: biases and norms are kept out unless asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.training.optimizer import optimizer_groups


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def test_biases_and_norms_get_no_decay_by_default(model: object) -> None:
    decay, no_decay = optimizer_groups(model, weight_decay=0.01, all_decay=False)
    names = {id(p): n for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 and "ln" not in names[id(p)] for p in decay["params"])
    assert any(names[id(p)].endswith("bias") for p in no_decay["params"])
    assert any(".ln_" in names[id(p)] for p in no_decay["params"])
    total = sum(1 for p in model.parameters() if p.requires_grad)  # type: ignore[attr-defined]
    assert len(decay["params"]) + len(no_decay["params"]) == total


@pytest.mark.parametrize(("weight_decay", "all_decay"), [(0.01, True), (0.0, False)])
def test_one_group_when_nothing_needs_keeping_apart(
    model: object, weight_decay: float, all_decay: bool
) -> None:
    (group,) = optimizer_groups(model, weight_decay=weight_decay, all_decay=all_decay)
    assert group["weight_decay"] == weight_decay
    assert len(group["params"]) == sum(1 for _ in model.parameters())  # type: ignore[attr-defined]


def test_a_lora_model_gets_no_empty_group(tiny_model_dir: Path) -> None:
    # A LoRA model's trainable parameters are all matrices: an empty no-decay group would
    # leave DeepSpeed's optimizer with fewer groups than the scheduler was built over, and
    # the first step fails in torch's `_update_lr` (the default weight decay is 0.01).
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, get_scheduler

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lora = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear"))
    groups = optimizer_groups(lora, weight_decay=0.01, all_decay=False)
    assert groups and all(group["params"] for group in groups)
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert sum(len(group["params"]) for group in groups) == len(trainable)
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=4)
    optimizer.step()
    scheduler.step()


@pytest.mark.parametrize(("use_gpu", "fused"), [(True, True), (False, None)])
def test_a_gpu_run_steps_with_torchs_fused_adamw(
    model: object, tiny_model_dir: Path, use_gpu: bool, fused: bool | None
) -> None:
    """Fused on a GPU (one kernel over each flat partition); the default on CPU. The device
    check of `fused` runs at the first step, on ZeRO's partitions, which DeepSpeed has then
    moved to the GPU: built here on CPU parameters, it does not run."""
    import torch

    from contract.run_request import RunRequest, RunSpec
    from worker.training.optimizer import build_optimizer

    request = RunRequest.model_validate(
        {
            "model": str(tiny_model_dir),
            "dataset": {"source": "ag_news"},
            "resources": {"num_workers": 1, "use_gpu": use_gpu},
        }
    )
    spec = RunSpec.for_attempt(request.worker_fields(), run_id="r", attempt=1, storage_path="/s")
    optimizer, _ = build_optimizer(spec, model, total_steps=10)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["fused"] is fused
    assert all(group["fused"] is fused for group in optimizer.param_groups)
