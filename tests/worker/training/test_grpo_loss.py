"""GRPO's loss pieces (worker/training/grpo_loss.py) against TRL 1.16's GRPOTrainer on the same
tiny Llama, prompts, completions and advantages: the loss TRL's `_compute_loss` returns and
the gradient it leaves on every parameter, for `grpo` and `dapo`, with and without the KL
term, sampled at temperature 1 and 0.7, split into micro-batches as a trainer splits them.
And the advantages against TRL's group normalisation, NaN rewards included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from worker.training.grpo_loss import PolicyLoss, completion_logps, group_advantages, policy_loss

TOLERANCE = 1e-5
GROUP = 4
PROMPT_LEN, COMPLETION_LEN = 5, 6


@pytest.fixture(scope="module", params=[1.0, 0.7], ids=["t1", "t0.7"])
def trl(request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: Any) -> Any:
    """TRL's trainer on a tiny Llama of its own, sampling at one temperature (TRL wraps the
    model's head for it); the loss type and beta are set per test on the trainer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.train()
    return trl_trainer(model, tiny_llama_dir, tmp_path_factory.mktemp("trl"), request.param)


def batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two prompts, four completions each, left-padded prompts, right-padded completions."""
    generator = torch.Generator().manual_seed(1)
    rows = 2 * GROUP
    prompt_ids = torch.randint(3, vocab, (rows, PROMPT_LEN), generator=generator)
    prompt_mask = torch.ones(rows, PROMPT_LEN, dtype=torch.long)
    prompt_mask[GROUP:, :2] = 0  # the second prompt is shorter
    completion_ids = torch.randint(3, vocab, (rows, COMPLETION_LEN), generator=generator)
    completion_mask = torch.ones(rows, COMPLETION_LEN, dtype=torch.long)
    for row, length in enumerate([6, 3, 5, 1, 6, 2, 4, 6]):
        completion_mask[row, length:] = 0
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.9, 0.1])
    advantages, _ = group_advantages(rewards, GROUP)
    noise = torch.randn(rows, COMPLETION_LEN, generator=generator)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        # A policy a little off the one that sampled (so that clipping happens) and a
        # reference further off.
        "old_shift": 0.3 * noise,
        "ref_shift": 0.5 * noise.flip(0),
    }


def logps_of(model: Any, inputs: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """The completion tokens' log-probabilities under `model`, prompts and completions as
    TRL's batches hold them (prompts left-padded, completions right-padded)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits
    prompt_length = inputs["prompt_ids"].shape[1]
    predicting = logits[:, prompt_length - 1 : -1]  # each completion token's logits
    logps, _ = completion_logps(predicting, inputs["completion_ids"], temperature)
    return logps


def trl_trainer(
    model: Any,
    tokenizer_dir: Path,
    out: Path,
    temperature: float,
    *,
    rows: int = 2 * GROUP,
    completion_length: int = COMPLETION_LEN,
) -> Any:
    """TRL's GRPOTrainer on `model` (a PeftModel too), one process, its batch `rows`
    completions in groups of GROUP; `_compute_loss` is called on it directly."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=rows,
        num_generations=GROUP,
        max_completion_length=completion_length,
        temperature=temperature,
        epsilon=0.2,
        epsilon_high=0.28,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * rows}),
        processing_class=AutoTokenizer.from_pretrained(tokenizer_dir),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def grads(model: Any) -> dict[str, torch.Tensor]:
    found = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_equal_trls(trl: Any, loss_type: str, beta: float) -> None:
    # What TRL reads of these it reads from the trainer at each call.
    trl.loss_type, trl.beta = loss_type, beta
    policy, temperature = trl.model, trl.temperature
    inputs = batch(policy.config.vocab_size)
    with torch.no_grad():
        current = logps_of(policy, inputs, temperature)
    old = current + inputs["old_shift"]
    ref = current + inputs["ref_shift"]
    mask = inputs["completion_mask"]

    trl_inputs = {
        key: inputs[key]
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    }
    trl_inputs |= {
        "advantages": inputs["advantages"],
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    if beta:
        trl_inputs["ref_per_token_logps"] = ref
    policy.zero_grad(set_to_none=True)
    theirs = trl._compute_loss(policy, trl_inputs)
    theirs.backward()
    their_grads = grads(policy)

    # Ours in two micro-batches of a prompt each, summed and divided once, as a step is.
    parts: list[PolicyLoss] = []
    for rows in (slice(0, GROUP), slice(GROUP, 2 * GROUP)):
        part = {k: v[rows] for k, v in inputs.items()}
        parts.append(
            policy_loss(
                logps_of(policy, part, temperature),
                old[rows],
                inputs["advantages"][rows],
                mask[rows],
                loss_type=loss_type,  # type: ignore[arg-type]
                epsilon_low=0.2,
                epsilon_high=0.28,
                beta=beta,
                ref_logps=ref[rows],
            )
        )
    weight = sum(p.weight for p in parts)
    ours = sum(p.loss_sum / weight for p in parts)
    assert isinstance(ours, torch.Tensor)
    ours.backward()
    our_grads = grads(policy)

    assert abs(ours.item() - theirs.item()) < TOLERANCE, (ours.item(), theirs.item())
    assert their_grads.keys() == our_grads.keys() and their_grads
    for name, theirs_grad in their_grads.items():
        assert torch.allclose(our_grads[name], theirs_grad, atol=TOLERANCE, rtol=0), name
    # Some tokens were clipped at each end: the clipped branch was exercised.
    assert sum(p.clipped_low_sum + p.clipped_high_sum for p in parts) > 0


def test_advantages_equal_trls_group_normalisation() -> None:
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, float("nan"), 0.3, 0.3, 0.3, 0.3, 2.0, -1.0, 0.0, 4.0])
    ours, flat = group_advantages(rewards, GROUP)
    grouped = rewards.view(-1, GROUP)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(GROUP)
    std = nanstd(grouped, dim=1).repeat_interleave(GROUP)
    theirs = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert ours[3] == 0.0  # a failed grade moves nothing
    assert flat.tolist() == [False, True, False]  # the group of equal rewards
    unscaled, _ = group_advantages(rewards, GROUP, scale=False)
    assert torch.allclose(unscaled, torch.nan_to_num(rewards - mean, nan=0.0))
