"""Direct preference optimisation: the sigmoid loss of Rafailov et al. (2023), as TRL 1.16's
DPOTrainer computes it (`loss_type="sigmoid"`), and the reference model it compares with.

A micro-batch holds B pairs as 2B rows, chosen rows first (worker/data/preference.py), so the
policy runs one forward over both halves, as TRL's does. A sequence's log-probability is
the sum of its labelled tokens' log-probs; the implicit reward of an answer is
beta * (policy log-prob - reference log-prob), and each pair's loss is
-log sigmoid(reward_chosen - reward_rejected).

The reference is the starting model. Under LoRA it is the same model with its adapters
disabled (no second copy, as TRL does for a new adapter); for full-parameter training it
is a frozen copy in its own inference-only DeepSpeed engine, partitioned like the policy
under ZeRO-3 (TRL's `prepare_deepspeed`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from worker.data.loading import IGNORE_INDEX

# What a step reports per pair is contract.eval_metrics.PAIR_METRICS, as TRL names them:
# every value is a mean over the step's pairs (metrics.py all-reduces their sums, pair_sums,
# in that order).


def sequence_logps(logits: Any, labels: Any) -> Any:
    """Per row, the sum of the log-probs of its labelled tokens: logits[:, t] predict
    labels[:, t + 1].

    Row by row in fp32: a log-softmax over the whole (rows, length, vocabulary) block in
    fp32 would hold another copy of the logits, the largest tensor of the step."""
    import torch

    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    index = targets.masked_fill(~mask, 0).unsqueeze(-1)
    sums = []
    for row_logits, row_index, row_mask in zip(logits[:, :-1], index, mask, strict=True):
        picked = row_logits.gather(-1, row_index).squeeze(-1).float()
        token_logps = picked - torch.logsumexp(row_logits.float(), dim=-1)
        sums.append((token_logps * row_mask).sum())
    return torch.stack(sums)


@dataclass(slots=True)
class PairTerms:
    """Per pair: its loss, the implicit rewards of its two answers and the policy's
    log-probabilities of them (detached: metrics only)."""

    losses: Any
    chosen_rewards: Any
    rejected_rewards: Any
    chosen_logps: Any
    rejected_logps: Any


def sigmoid_loss(
    policy_chosen: Any, policy_rejected: Any, ref_chosen: Any, ref_rejected: Any, *, beta: float
) -> PairTerms:
    """TRL's `loss_type="sigmoid"` with the reverse-KL (standard DPO) scores."""
    import torch.nn.functional as F

    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    return PairTerms(
        losses=losses,
        chosen_rewards=beta * chosen_logratios.detach(),
        rejected_rewards=beta * rejected_logratios.detach(),
        chosen_logps=policy_chosen.detach(),
        rejected_logps=policy_rejected.detach(),
    )


def pair_sums(terms: PairTerms, valid: Any) -> Any:
    """The sums over the valid pairs of what PAIR_METRICS average, as one float64 tensor."""
    import torch

    chosen, rejected = terms.chosen_rewards.double(), terms.rejected_rewards.double()
    keep = valid.double()
    per_pair = [
        chosen,
        rejected,
        (chosen > rejected).double(),
        chosen - rejected,
        terms.chosen_logps.double(),
        terms.rejected_logps.double(),
    ]
    return torch.stack([(values * keep).sum() for values in per_pair])


def valid_pairs(labels: Any) -> Any:
    """Pairs whose chosen and rejected rows both have a target. Evaluation marks the
    sampler's repeated rows as ignored; they count for nothing."""
    has_target = (labels[:, 1:] != IGNORE_INDEX).any(dim=1)
    chosen, rejected = has_target.chunk(2)
    return chosen & rejected


@dataclass(slots=True)
class DpoOutput:
    mean_loss: Any  # over the micro-batch's valid pairs (0 with the graph kept if none)
    sums: Any  # pair_sums of the valid pairs


def dpo_forward(engine: Any, batch: dict[str, Any], *, reference: Any, beta: float) -> DpoOutput:
    """The policy's and the reference's forwards over one micro-batch of pairs (on the
    device), and the pairs' DPO loss. Every rank runs both: under ZeRO-3 each forward
    gathers partitioned weights collectively."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    labels = batch["labels"]
    ref_logps = reference.logps(inputs, labels)
    # No labels to the model: the loss is computed here, and Hugging Face's own
    # cross-entropy over the logits would be wasted work.
    logits = engine(**inputs, use_cache=False).logits
    policy_chosen, policy_rejected = sequence_logps(logits, labels).chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    terms = sigmoid_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=beta)
    valid = valid_pairs(labels)
    # On the device: the pair count the callers need comes from the CPU batch
    # (worker.training.step_loss.targets_in), so no step waits here for the GPU.
    mean_loss = (terms.losses * valid).sum() / valid.sum().clamp(min=1)
    return DpoOutput(mean_loss=mean_loss, sums=pair_sums(terms, valid))


@dataclass(slots=True)
class AdapterReference:
    """LoRA: the reference is the policy with its adapters disabled."""

    engine: Any

    def logps(self, inputs: dict[str, Any], labels: Any) -> Any:
        return sequence_logps(self.logits(inputs), labels)

    def logits(self, inputs: dict[str, Any]) -> Any:
        return _reference_logits(self.engine, inputs, self.engine.module.disable_adapter())


@dataclass(slots=True)
class FrozenReference:
    """Full-parameter training: a frozen copy of the starting model in its own engine."""

    engine: Any
    zero3_config: Any = None  # kept alive as worker.model.loading.LoadedModel's is

    def logps(self, inputs: dict[str, Any], labels: Any) -> Any:
        return sequence_logps(self.logits(inputs), labels)

    def logits(self, inputs: dict[str, Any]) -> Any:
        return _reference_logits(self.engine, inputs, nullcontext())


def _reference_logits(
    engine: Any, inputs: dict[str, Any], context: AbstractContextManager[Any]
) -> Any:
    import torch

    with torch.no_grad(), context:
        return engine(**inputs, use_cache=False).logits


def reference_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """An inference-only DeepSpeed config for the reference, as TRL's prepare_deepspeed
    makes it: no optimizer or its offload; ZeRO-3 kept, so the copy is partitioned like the
    policy; other stages 0 (a whole copy per rank, which ZeRO-1/2 would not shard anyway:
    they partition optimizer state and gradients, which a frozen model has none of)."""
    import copy

    config = copy.deepcopy(ds_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config["zero_optimization"]
    zero.pop("offload_optimizer", None)
    if zero["stage"] != 3:
        zero["stage"] = 0
    return config


def build_reference(
    spec: Any, tokenizer: Any, *, engine: Any, ds_config: dict[str, Any], precision: str
) -> Any:
    """The reference for `spec`'s DPO run (or GRPO run with a KL term), beside the policy
    `engine`."""
    if spec.lora is not None:
        return AdapterReference(engine)
    import deepspeed

    from worker.model.loading import build_model

    config = reference_config(ds_config)
    # Under ZeRO-3 build_model creates the copy inside zero.Init with its own
    # HfDeepSpeedConfig, which replaces the policy's as transformers' global one; both
    # describe stage 3, which is all later transformers calls read from it.
    loaded = build_model(spec, tokenizer, None, ds_config=config, precision=precision)
    disable_dropout(loaded.module)
    loaded.module.requires_grad_(False)
    ref_engine, *_ = deepspeed.initialize(model=loaded.module, config=config)
    ref_engine.eval()
    return FrozenReference(engine=ref_engine, zero3_config=loaded.zero3_config)


def disable_dropout(model: Any) -> None:
    """Dropout off, as TRL's DPOConfig.disable_dropout (default True) does: with it the
    policy's log-probs would be noisy against a reference that runs without."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
