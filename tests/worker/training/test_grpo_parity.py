"""Method grpo's step over 2 DeepSpeed ranks (worker/training/grpo.py, worker/training/step_loss.py)
against TRL 1.16's GRPOTrainer `_compute_loss` on the whole batch in one process: the step's loss
(each rank's share summed) and the full gradient DeepSpeed leaves on every trainable parameter at
the accumulation boundary, equal within 1e-5, at ZeRO-2 and ZeRO-3, full fine-tuning and LoRA, for
`grpo` and `dapo`, with and without the KL term. So the ranks' weighting (a step's loss divided once
by its weight over every micro-batch and rank) and DeepSpeed's averaging over them leave exactly
TRL's per-completion (`grpo`) or per-token (`dapo`) mean over the whole batch.

Each rank runs the worker's own build_training and grpo_step, fed fixed completions and
rewards in place of sampling and grading: every group's rewards differ (a flat group leaves
tuneyard's step, not TRL's), prompts and completions are of uneven lengths, and each rank
has its own. A first step at the run's learning rate moves the policy off its reference (for
LoRA it makes B non-zero, without which A would have no gradient); the rate is then 0, so
that the four loss configurations are measured on one engine, on the policy that first step
left. TRL's reference is the starting model for full fine-tuning and the adapter switched
off for LoRA, as tuneyard's. Each configuration's gradient is also shown to differ from its
neighbours' (the other loss type, the KL term on or off) by far more than the tolerance.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from app.ports import free_port
from contract.run_request import GrpoMethod, RunSpec
from tests.worker.one_rank import join_group, spawn_ranks
from tests.worker.training.test_grpo import spec_for
from tests.worker.training.test_grpo_loss import GROUP, grads, logps_of, trl_trainer

TOLERANCE = 1e-5
# Of each parameter's gradient norm: the absolute bound alone would be loose on the smallest.
RELATIVE_TOLERANCE = 1e-4
WORLD = 2
TEMPERATURE = 0.7
# The KL term's weight when it is on; the engine is built with it, so that it has its
# reference, and measured without it too.
BETA = 0.04
CASES = [("grpo", 0.0), ("grpo", BETA), ("dapo", 0.0), ("dapo", BETA)]
WARMUP_LR = 0.02
# Of uneven lengths: prompts are left-padded in a micro-batch, and across the whole batch.
PROMPTS = [
    {"prompt": "market"},
    {"prompt": "storm over the city"},
    {"prompt": "team season opener"},
    {"prompt": "bank vote on rates today at noon"},
    {"prompt": "oil"},
    {"prompt": "the new phone sells"},
    {"prompt": "rain again"},
    {"prompt": "league final score was close"},
]
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


class Script:
    """Stands in for sampling and grading on a rank: for whatever prompts a micro-batch
    brings, preset completions (random tokens, uneven lengths, eos where one ends) and
    preset rewards (random: no group's are all equal), recorded for the reference."""

    def __init__(self, rank: int, *, vocab: int, pad: int, eos: int) -> None:
        self.random = torch.Generator().manual_seed(100 + rank)
        self.vocab, self.pad, self.eos = vocab, pad, eos
        self.micro: list[dict[str, torch.Tensor]] = []
        self.rewards: list[float] = []

    def sample(
        self,
        model: Any,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float,
        greedy: bool = False,
    ) -> Any:
        from worker.training.generation import Completions

        rows = prompt_ids.shape[0]
        # As generate's: as wide as the longest row, which may end before max_new_tokens.
        width = int(torch.randint(2, max_new_tokens + 1, (1,), generator=self.random))
        lengths = torch.randint(1, width + 1, (rows,), generator=self.random)
        lengths[int(torch.randint(0, rows, (1,), generator=self.random))] = width
        ids = torch.randint(self.eos + 2, self.vocab, (rows, width), generator=self.random)
        mask = (torch.arange(width) < lengths[:, None]).long()
        ended = lengths < width
        ids[ended, lengths[ended] - 1] = self.eos
        ids = ids.masked_fill(mask == 0, self.pad)
        self.micro.append(
            {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "ids": ids, "mask": mask}
        )
        return Completions(
            ids=ids, mask=mask, texts=[f"completion {i}" for i in range(rows)], ended=ended
        )

    def grade(self, grader: dict[str, Any], texts: list[str], items: list[Any]) -> Any:
        from worker.training.grading_tasks import Graded

        self.rewards = torch.rand(len(texts), generator=self.random).tolist()
        return Graded(rewards=list(self.rewards))

    def take(self) -> dict[str, Any]:
        """The step's rollouts on this rank, in its row order."""
        taken = {"micro": self.micro, "rewards": torch.tensor(self.rewards)}
        self.micro, self.rewards = [], []
        return taken


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered under ZeRO-3: every rank enters)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _measure(rank: int, spec_json: str, port: int, out: str) -> None:
    """One rank: the worker's engine, a step that moves the policy, then the four loss
    configurations at learning rate 0, each step's loss summed over the ranks and the full
    gradients read at the accumulation boundary, before the optimizer step."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from worker.training.grpo import grpo_step
    from worker.training.loop import batches_from, build_training

    torch.set_num_threads(1)  # two ranks on the machine's cores
    join_group(rank, WORLD, port)
    spec = RunSpec.model_validate_json(spec_json)
    training = build_training(spec, rank=rank)
    engine, tokenizer = training.engine, training.tokenizer
    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    read: dict[str, torch.Tensor] = {}
    optimizer_step = engine.step

    def step_reading_grads(*args: Any, **kwargs: Any) -> Any:
        if engine.is_gradient_accumulation_boundary():
            # Collective on every rank, in the same order: at ZeRO-2 each rank's partition
            # of the reduced gradient is all-reduced into the whole (param.grad is cleared
            # at the boundary, so none is read from a rank's own unreduced one), at ZeRO-3
            # the fp32 gradient partitions are all-gathered.
            for name, param in trainable:
                read[name] = safe_get_full_grad(param).detach().clone()
        return optimizer_step(*args, **kwargs)

    engine.step = step_reading_grads
    script = Script(
        rank, vocab=len(tokenizer), pad=tokenizer.pad_token_id, eos=tokenizer.eos_token_id
    )
    batches = batches_from(training.plan, training.data.train, 0)

    def one_step(step_spec: RunSpec) -> dict[str, Any]:
        read.clear()
        result = grpo_step(
            engine,
            batches,
            spec=step_spec,
            device=torch.device("cpu"),
            group=None,
            generator=script,  # type: ignore[arg-type]  # HfGenerator's sample(), scripted
            reference=training.reference,
            grade=script.grade,
        )
        loss = result.loss.detach().clone()
        dist.all_reduce(loss)  # each rank's share of the step's loss
        return {"loss": float(loss), "grads": dict(read), **script.take()}

    one_step(spec)  # at spec's learning rate: the policy leaves its reference
    # From here on no step moves a weight: torch's AdamW scales its update and its decay by
    # the rate (param *= 1 - lr * wd; param -= lr / bias_correction * m / denom), ZeRO then
    # copies its fp32 partitions, unchanged, back into the weights, and the constant
    # scheduler keeps setting base_lr * 1. `moved` checks it.
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    engine.lr_scheduler.base_lrs = [0.0 for _ in engine.lr_scheduler.base_lrs]
    policy = _weights(engine)
    steps = []
    for loss_type, beta in CASES:
        method = spec.method.model_copy(update={"loss_type": loss_type, "beta": beta})
        steps.append(one_step(spec.model_copy(update={"method": method})))
    after = _weights(engine)
    moved = max(float((after[n] - w).abs().max()) for n, w in policy.items())
    torch.save(
        {
            "steps": steps,
            "policy": policy,
            "moved": moved,
            "lr": [float(lr) for lr in engine.get_lr()],
            "pad": tokenizer.pad_token_id,
        },
        Path(out, f"rank{rank}.pt"),
    )
    dist.barrier()
    # DeepSpeed's shared-memory comm op aborts the interpreter's normal exit.
    os._exit(0)


def run_ranks(spec: RunSpec, tmp_path: Path) -> list[dict[str, Any]]:
    """Each rank's results, saved by torch rather than as JSON: five whole gradients and
    the weights, bit for bit."""
    spawn_ranks(_measure, args=(spec.model_dump_json(), free_port(), str(tmp_path)), nprocs=WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def whole_batch(steps: list[dict[str, Any]], pad: int) -> dict[str, torch.Tensor]:
    """One step's rollouts on every rank as one batch, rank 0's rows first: prompts
    left-padded and completions right-padded to the longest, advantages from the rewards
    as TRL normalises them per group (`scale_rewards="group"`)."""
    from trl.trainer.utils import nanstd

    micro = [m for step in steps for m in step["micro"]]
    prompt = max(m["prompt_ids"].shape[1] for m in micro)
    width = max(m["ids"].shape[1] for m in micro)

    def left(t: torch.Tensor, value: int) -> torch.Tensor:
        return F.pad(t, (prompt - t.shape[1], 0), value=value)

    def right(t: torch.Tensor, value: int) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    rewards = torch.cat([step["rewards"] for step in steps])
    grouped = rewards.view(-1, GROUP)
    mean = grouped.mean(dim=1).repeat_interleave(GROUP)
    std = nanstd(grouped, dim=1).repeat_interleave(GROUP)
    return {
        "prompt_ids": torch.cat([left(m["prompt_ids"], pad) for m in micro]),
        "prompt_mask": torch.cat([left(m["prompt_mask"], 0) for m in micro]),
        "completion_ids": torch.cat([right(m["ids"], pad) for m in micro]),
        "completion_mask": torch.cat([right(m["mask"], 0) for m in micro]),
        "advantages": (rewards - mean) / (std + 1e-4),
    }


class Reference:
    """TRL's trainer in this process on the policy the ranks measured (the starting model
    with their weights), and the reference its KL term compares with."""

    def __init__(self, spec: RunSpec, policy: dict[str, torch.Tensor], model: Path, out: Path):
        from transformers import AutoModelForCausalLM

        from worker.model.lora import lora_config

        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.start = None
        if spec.lora is not None:
            from peft import get_peft_model

            module = get_peft_model(base, lora_config(spec), autocast_adapter_dtype=False)
        else:
            module = base
            self.start = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        missing, unexpected = module.load_state_dict(policy, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        module.train()
        assert isinstance(spec.method, GrpoMethod)
        self.trl = trl_trainer(
            module,
            model,
            out,
            TEMPERATURE,
            rows=len(PROMPTS) * GROUP,
            completion_length=spec.method.max_completion_tokens,
        )

    def ref_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from trl.trainer.utils import use_adapter

        with torch.no_grad():
            if self.start is not None:
                return logps_of(self.start, batch, TEMPERATURE)
            with use_adapter(self.trl.model, adapter_name=None):  # TRL's, for a new adapter
                return logps_of(self.trl.model, batch, TEMPERATURE)

    def loss_and_grads(
        self, batch: dict[str, torch.Tensor], loss_type: str, beta: float
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """`_compute_loss` on the whole batch, on-policy (no old log-probabilities, as
        TRL's default of one update per generation), and the gradient it leaves."""
        trl = self.trl
        trl.loss_type, trl.beta = loss_type, beta  # read from the trainer at each call
        inputs = {**batch, "num_items_in_batch": batch["completion_mask"].sum()}
        if beta:
            inputs["ref_per_token_logps"] = self.ref_logps(batch)
        trl.model.zero_grad(set_to_none=True)
        loss = trl._compute_loss(trl.model, inputs)
        loss.backward()
        return loss.item(), grads(trl.model)


def max_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """The largest difference of any element of any parameter's gradient."""
    assert ours.keys() == theirs.keys() and ours
    return max(float((ours[n] - theirs[n]).abs().max()) for n in ours)


def max_relative_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """The largest difference of a parameter's gradient, relative to that gradient's norm."""
    assert ours.keys() == theirs.keys() and ours
    return max(
        float((ours[n] - theirs[n]).norm() / theirs[n].norm().clamp(min=1e-30)) for n in ours
    )


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return path


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("zero_stage", [2, 3], ids=["zero2", "zero3"])
def test_step_loss_and_gradient_over_two_ranks_equal_trls(
    zero_stage: int,
    lora: dict[str, Any] | None,
    tiny_llama_dir: Path,
    prompts: Path,
    tmp_path: Path,
) -> None:
    spec = spec_for(
        tiny_llama_dir,
        prompts,
        method={
            "num_generations": GROUP,
            "beta": BETA,
            "temperature": TEMPERATURE,
            "epsilon": 0.2,
            "epsilon_high": 0.28,
        },
        training={
            "max_steps": 1 + len(CASES),
            "learning_rate": WARMUP_LR,
            "batch_size_per_worker": 2,
            "gradient_accumulation_steps": 2,
        },
        deepspeed={"zero_stage": zero_stage, "precision": "fp32"},
        resources={"num_workers": WORLD},
        lora=lora,
    )
    ranks = run_ranks(spec, tmp_path)
    first = ranks[0]
    assert first["moved"] == 0.0, "a step at learning rate 0 moved the weights"
    assert first["lr"] and set(first["lr"]) == {0.0}
    reference = Reference(spec, first["policy"], tiny_llama_dir, tmp_path / "trl")
    if lora is not None:
        # The first step made the adapters' B non-zero: A has a gradient to compare.
        assert min(float(w.abs().max()) for n, w in first["policy"].items() if "lora_B" in n) > 0

    found: dict[tuple[str, float], dict[str, float]] = {}
    for index, (loss_type, beta) in enumerate(CASES):
        steps = [rank["steps"][index] for rank in ranks]
        # Every rank read the same whole gradient and holds the same step loss.
        assert max_diff(steps[0]["grads"], steps[1]["grads"]) == 0.0
        assert steps[0]["loss"] == steps[1]["loss"]
        batch = whole_batch(steps, first["pad"])
        assert batch["prompt_mask"].sum(1).unique().numel() > 1  # prompts of uneven lengths
        assert batch["completion_mask"].sum(1).unique().numel() > 1  # and completions
        theirs, their_grads = reference.loss_and_grads(batch, loss_type, beta)
        our_grads = steps[0]["grads"]
        found[(loss_type, beta)] = {
            "loss": abs(steps[0]["loss"] - theirs),
            "grad": max_diff(our_grads, their_grads),
            "grad_relative": max_relative_diff(our_grads, their_grads),
        }
        # The comparison tells this configuration from its neighbours: the other loss type,
        # and the KL term on or off, change the gradient by far more than the tolerance.
        # (On-policy, grpo's loss without KL is 0 however it is weighted: each group's
        # advantages sum to 0 and every ratio is 1. Its gradient is what tells.)
        other_type = "dapo" if loss_type == "grpo" else "grpo"
        for neighbour in [(other_type, beta), (loss_type, BETA - beta)]:
            _, near = reference.loss_and_grads(batch, *neighbour)
            assert max_diff(near, their_grads) > 20 * TOLERANCE, neighbour
        if lora is not None:
            # With B at 0 every A's gradient would be 0. The smallest here (q and k, through
            # the attention scores) are some 1e-4: the relative bound holds them to account.
            lora_a = [float(g.abs().max()) for n, g in their_grads.items() if "lora_A" in n]
            assert min(lora_a) > 0 and max(lora_a) > 100 * TOLERANCE
    for case, diffs in found.items():
        assert diffs["loss"] < TOLERANCE, (case, found)
        assert diffs["grad"] < TOLERANCE, (case, found)
        assert diffs["grad_relative"] < RELATIVE_TOLERANCE, (case, found)
