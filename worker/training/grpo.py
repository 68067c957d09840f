"""Method grpo's optimizer step and evaluation: sample each prompt's group of completions
from the current policy (worker/training/generation.py), grade them off the rank
(worker/training/grading_tasks.py), and learn from each completion's reward relative to its
group's with the clipped policy loss (worker/training/grpo_loss.py).

A step's micro-batches are all sampled first, under one gathering of the weights, then
graded in one task, then trained on one by one: the policy does not change within an
optimizer step, so every micro-batch's completions are on-policy (TRL's default of one
update per generation: the ratio is 1 and the clip bounds only its gradient).

A group whose rewards are all equal teaches nothing (no advantage); its completions leave
the step before their forward, and count in no weight. The loss is divided once by the
step's weight over every micro-batch and rank (completion tokens for dapo, completions for
grpo), as worker/training/step_loss.py does for the other methods. A micro-batch left with nothing
still runs one row's forward and backward at zero weight: under ZeRO-3 every rank must
join every gather.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from contract.run_request import GrpoMethod, RunSpec
from worker.data.prompts import RECORD
from worker.training.generation import Completions, HfGenerator, policy_for_generation

log = logging.getLogger("tuneyard.worker")


@dataclass(slots=True)
class Rollout:
    """One micro-batch's prompts, each repeated num_generations times, and their
    completions, rewards and advantages (rows in group order)."""

    prompt_ids: Any
    prompt_mask: Any
    completions: Completions
    rewards: Any  # NaN where the grade failed
    advantages: Any
    learns: Any  # bool per row: its group's rewards differ


def grader_json(method: GrpoMethod) -> dict[str, Any]:
    return method.grader.model_dump(mode="json", by_alias=True, exclude_none=True)


def sample_groups(
    engine: Any,
    batches: list[dict[str, Any]],
    *,
    method: GrpoMethod,
    generator: HfGenerator,
    device: Any,
) -> list[tuple[Any, Any, Completions]]:
    """Every micro-batch's prompts, repeated per generation, and their completions."""
    groups = method.num_generations
    sampled = []
    with policy_for_generation(engine) as model:
        for batch in batches:
            ids = batch["input_ids"].repeat_interleave(groups, dim=0).to(device)
            mask = batch["attention_mask"].repeat_interleave(groups, dim=0).to(device)
            completions = generator.sample(
                model,
                ids,
                mask,
                max_new_tokens=method.max_completion_tokens,
                temperature=method.temperature,
            )
            sampled.append((ids, mask, completions))
    return sampled


def rollouts(
    engine: Any,
    batches: list[dict[str, Any]],
    *,
    method: GrpoMethod,
    generator: HfGenerator,
    device: Any,
    grade: Callable[[dict[str, Any], list[str], list[Any]], Any],
) -> tuple[list[Rollout], Any]:
    """The step's rollouts, and what grading said (worker.training.grading_tasks.Graded)."""
    import torch

    from worker.training.grpo_loss import group_advantages

    sampled = sample_groups(engine, batches, method=method, generator=generator, device=device)
    groups = method.num_generations
    texts = [t for _, _, c in sampled for t in c.texts]
    items = [record for batch in batches for record in batch[RECORD] for _ in range(groups)]
    graded = grade(grader_json(method), texts, items)
    out, start = [], 0
    for ids, mask, completions in sampled:
        rows = ids.shape[0]
        rewards = torch.tensor(graded.rewards[start : start + rows], dtype=torch.float32)
        start += rows
        advantages, flat = group_advantages(rewards, groups)
        out.append(
            Rollout(
                prompt_ids=ids,
                prompt_mask=mask,
                completions=completions,
                rewards=rewards,
                advantages=advantages.to(device),
                learns=(~flat).repeat_interleave(groups),
            )
        )
    return out, graded


def _sequence(rollout: Rollout, rows: Any) -> dict[str, Any]:
    """Prompt and completion as one row each, with the positions generation gave them (a
    left-padded prompt's tokens count from its first real one)."""
    import torch

    c = rollout.completions
    ids = torch.cat([rollout.prompt_ids[rows], c.ids[rows]], dim=1)
    mask = torch.cat([rollout.prompt_mask[rows], c.mask[rows]], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def _completion_logits(logits: Any, prompt_length: int) -> Any:
    # logits[:, t] predict token t + 1: the completion's tokens are predicted from the last
    # prompt position on.
    return logits[:, prompt_length - 1 : -1]


def step_weight(rollout: Rollout, loss_type: str) -> int:
    kept = rollout.learns
    if loss_type == "grpo":
        return int(kept.sum())
    return int(rollout.completions.mask[kept.to(rollout.completions.mask.device)].sum())


class StepSums:
    """What a step reports, as sums every rank adds up in one all-reduce (in the order of
    `names`, the same on every rank), and the metrics they make (`metrics`)."""

    def __init__(self, method: GrpoMethod) -> None:
        from contract.graders.models import MultiGrader

        grader = method.grader
        self.sub_graders = sorted(grader.graders) if isinstance(grader, MultiGrader) else []
        names = [
            "completions",
            "graded",
            "reward_sum",
            "reward_sq",
            "groups",
            "flat_groups",
            "length_sum",
            "truncated",
            "tokens",
            "kl_sum",
            "entropy_sum",
            "clipped_low",
            "clipped_high",
        ]
        for name in self.sub_graders:
            names += [f"sub/{name}/sum", f"sub/{name}/graded"]
        self.values = dict.fromkeys(names, 0.0)

    def add(self, name: str, value: Any) -> None:
        self.values[name] += float(value)

    def metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """TRL's names, for the step over every rank."""
        n = totals["graded"]
        mean = totals["reward_sum"] / n if n else math.nan
        variance = (totals["reward_sq"] - n * mean * mean) / (n - 1) if n > 1 else math.nan
        tokens = totals["tokens"]
        per_token = {
            "kl": totals["kl_sum"],
            "entropy": totals["entropy_sum"],
            "clip_ratio/low_mean": totals["clipped_low"],
            "clip_ratio/high_mean": totals["clipped_high"],
        }
        out = {
            "reward": mean,
            "reward_std": math.sqrt(max(variance, 0.0)) if variance == variance else math.nan,
            "frac_reward_zero_std": totals["flat_groups"] / max(totals["groups"], 1.0),
            "completions/mean_length": totals["length_sum"] / max(totals["completions"], 1.0),
            "completions/clipped_ratio": totals["truncated"] / max(totals["completions"], 1.0),
            "grade_failures": totals["completions"] - n,
        }
        if tokens:
            # Of the completions the step learned from: a step whose groups all scored
            # alike trains on none, and has no such values (rather than NaNs).
            out.update({k: v / tokens for k, v in per_token.items()})
            out["clip_ratio/region_mean"] = out["clip_ratio/low_mean"] + out["clip_ratio/high_mean"]
        for name in self.sub_graders:
            graded = totals[f"sub/{name}/graded"]
            out[f"rewards/{name}/mean"] = totals[f"sub/{name}/sum"] / graded if graded else math.nan
        return out


def _count_rewards(sums: StepSums, rewards: Any, graded: Any, *, groups: int) -> None:
    import torch

    valid = ~torch.isnan(rewards)
    sums.add("completions", rewards.numel())
    sums.add("graded", valid.sum())
    sums.add("reward_sum", rewards[valid].sum())
    sums.add("reward_sq", (rewards[valid] ** 2).sum())
    sums.add("groups", rewards.numel() // groups)
    for name in sums.sub_graders:
        values = torch.tensor(graded.sub_rewards.get(name, []), dtype=torch.float32)
        ok = ~torch.isnan(values)
        sums.add(f"sub/{name}/sum", values[ok].sum())
        sums.add(f"sub/{name}/graded", ok.sum())


def grpo_step(
    engine: Any,
    batches: Iterator[dict[str, Any]],
    *,
    spec: RunSpec,
    device: Any,
    group: Any,
    generator: HfGenerator,
    reference: Any = None,
    grade: Callable[[dict[str, Any], list[str], list[Any]], Any] | None = None,
) -> Any:
    """One optimizer step of method grpo (a worker.reporting.metrics.StepResult)."""
    import torch

    from worker.reporting.metrics import StepResult
    from worker.training import step_loss
    from worker.training.grading_tasks import grade_off_rank
    from worker.training.grpo_loss import completion_logps, policy_loss

    method = spec.method
    assert isinstance(method, GrpoMethod)
    groups = method.num_generations
    micro = [next(batches) for _ in range(spec.training.gradient_accumulation_steps)]
    steps, graded = rollouts(
        engine,
        micro,
        method=method,
        generator=generator,
        device=device,
        grade=grade or grade_off_rank,
    )
    if graded.failures:
        # Counted in the step's metrics (grade_failures); the log says why.
        log.warning("grading failed for some completions; the first: %s", graded.failures)
    sums = StepSums(method)
    all_rewards = torch.cat([r.rewards for r in steps])
    _count_rewards(sums, all_rewards, graded, groups=groups)
    weights = [step_weight(r, method.loss_type) for r in steps]
    total = step_loss.step_targets(sum(weights), group=group, tensor_parallel_size=1)
    result = StepResult(loss=torch.zeros((), device=device), tokens=0, samples=0)
    epsilon_high = method.epsilon_high if method.epsilon_high is not None else method.epsilon
    for rollout, weight in zip(steps, weights, strict=True):
        c = rollout.completions
        sums.add("flat_groups", (~rollout.learns).sum() // groups)
        sums.add("length_sum", c.mask.sum())
        sums.add("truncated", (~c.ended).sum())
        result.samples += c.ids.shape[0]
        rows = rollout.learns.nonzero().flatten()
        empty = rows.numel() == 0
        if empty:
            rows = torch.zeros(1, dtype=torch.long)  # one row at zero weight: see the module
        rows = rows.to(device)
        inputs = _sequence(rollout, rows)
        result.tokens += int(inputs["attention_mask"].sum())
        prompt_length = rollout.prompt_ids.shape[1]
        logits = _completion_logits(engine(**inputs, use_cache=False).logits, prompt_length)
        logps, entropy = completion_logps(logits, c.ids[rows], method.temperature)
        ref_logps = None
        if method.beta > 0:
            ref_logits = _completion_logits(reference.logits(inputs), prompt_length)
            ref_logps, _ = completion_logps(ref_logits, c.ids[rows], method.temperature)
        loss = policy_loss(
            logps,
            None,
            rollout.advantages[rows],
            c.mask[rows],
            loss_type=method.loss_type,
            epsilon_low=method.epsilon,
            epsilon_high=epsilon_high,
            beta=method.beta,
            ref_logps=ref_logps,
            entropy=entropy,
        )
        if empty or weight == 0:
            share = loss.loss_sum.nan_to_num(0.0) * 0.0
        else:
            share = loss.loss_sum / max(total, 1)
            sums.add("tokens", loss.tokens)
            sums.add("kl_sum", loss.kl_sum)
            sums.add("entropy_sum", loss.entropy_sum)
            sums.add("clipped_low", loss.clipped_low_sum)
            sums.add("clipped_high", loss.clipped_high_sum)
        step_loss.backward(engine, share, data_parallel_size=spec.data_parallel_size)
        engine.step()
        result.loss += share.detach().float()
    result.sums = sums
    return result


def evaluate_reward(
    engine: Any,
    loader: Any,
    *,
    spec: RunSpec,
    device: Any,
    group: Any,
    generator: HfGenerator,
    grade: Callable[[dict[str, Any], list[str], list[Any]], Any] | None = None,
) -> dict[str, float]:
    """`eval_reward`: the grader's mean reward over the evaluation prompts, one greedy
    completion each (the policy's most likely answer: sampling would add its own noise to
    a curve that is to show learning), over every rank."""
    import torch
    import torch.distributed as dist

    from worker.training.evaluation import real_rows
    from worker.training.grading_tasks import grade_off_rank

    method = spec.method
    assert isinstance(method, GrpoMethod)
    texts: list[str] = []
    items: list[Any] = []
    with policy_for_generation(engine) as model:
        for batch, real in zip(loader, real_rows(loader), strict=False):
            # Every row is generated (under ZeRO-3 each rank joins every forward), but the
            # repeats that pad the last ranks' share are not graded: each prompt counts once.
            completions = generator.sample(
                model,
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                max_new_tokens=method.max_completion_tokens,
                temperature=method.temperature,
                greedy=True,
            )
            texts += completions.texts[:real]
            items += batch[RECORD][:real]
    graded = (grade or grade_off_rank)(grader_json(method), texts, items)
    rewards = torch.tensor(graded.rewards, dtype=torch.float64)
    valid = ~torch.isnan(rewards)
    totals = torch.tensor([float(rewards[valid].sum()), float(valid.sum())], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    return {"eval_reward": float(totals[0] / totals[1]) if totals[1] else math.nan}
