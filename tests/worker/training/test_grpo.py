"""Method grpo on the worker (worker/training/grpo.py, worker/training/generation.py,
worker/data/prompts.py): the worker's own build_training and grpo_step on a tiny model, sampling,
grading and updating, at the ZeRO stages whose generation differs (3 gathers the partitions), full
and LoRA."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from app.ports import free_port
from contract.run_request import RunSpec
from tests.worker.one_rank import join_one_rank_group, spawn_ranks

PROMPTS = [
    {"prompt": "market price", "answer": "up"},
    {"prompt": "storm city", "answer": "rain"},
    {"prompt": "team season", "answer": "win"},
    {"prompt": "bank vote", "answer": "yes"},
]
# A reward with spread on a random tiny model: how close the completion is to the answer.
GRADER = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}


def spec_for(model: Path, source: Path, **overrides: Any) -> RunSpec:
    method = {"type": "grpo", "grader": GRADER, "num_generations": 4}
    method.update(overrides.pop("method", {}))
    body: dict[str, Any] = {
        "run_id": "run_grpo",
        "attempt": 1,
        "storage_path": "/unused",
        "model": str(model),
        "dataset": {"source": str(source), "format": "prompt", "eval_source": str(source)},
        "method": {**method, "max_completion_tokens": 6},
        "training": {
            "max_steps": 2,
            "learning_rate": 1e-2,
            "batch_size_per_worker": 1,
            "gradient_accumulation_steps": 2,
        },
        "deepspeed": {"zero_stage": 0, "precision": "fp32"},
        "resources": {"num_workers": 1},
    }
    for key, value in overrides.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return RunSpec.model_validate(body)


def _train(rank: int, spec_json: str, port: int, out: str) -> None:
    """One rank: the worker's own build_training, two grpo steps and an evaluation."""
    import deepspeed

    from worker.training.grpo import evaluate_reward, grpo_step
    from worker.training.loop import batches_from, build_training

    join_one_rank_group(port)
    spec = RunSpec.model_validate_json(spec_json)
    training = build_training(spec, rank=0)
    trainable = [p for p in training.engine.module.parameters() if p.requires_grad]

    def snapshot() -> list[torch.Tensor]:
        with deepspeed.zero.GatheredParameters(trainable):
            return [p.detach().clone() for p in trainable]

    start = snapshot()
    batches = batches_from(training.plan, training.data.train, 0)
    steps = []
    for _ in range(spec.training.max_steps or 0):
        result = grpo_step(
            training.engine,
            batches,
            spec=spec,
            device=torch.device("cpu"),
            group=None,
            generator=training.generator,
            reference=training.reference,
        )
        metrics = result.sums.metrics(result.sums.values)
        steps.append({"loss": float(result.loss), "samples": result.samples, **metrics})
    moved = max(float((a - b).abs().max()) for a, b in zip(start, snapshot(), strict=True))
    evaluation = evaluate_reward(
        training.engine,
        training.data.eval,
        spec=spec,
        device=torch.device("cpu"),
        group=None,
        generator=training.generator,
    )
    Path(out, "result.json").write_text(
        json.dumps({"steps": steps, "moved": moved, "eval": evaluation})
    )
    # DeepSpeed's shared-memory comm op aborts the interpreter's normal exit.
    os._exit(0)


def run_ours(spec: RunSpec, tmp_path: Path) -> dict[str, Any]:
    spawn_ranks(_train, args=(spec.model_dump_json(), free_port(), str(tmp_path)), nprocs=1)
    return json.loads((tmp_path / "result.json").read_text())


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return path


@pytest.mark.parametrize(
    ("zero_stage", "lora", "beta"),
    [(3, None, 0.0), (2, {"r": 4, "target_modules": ["q_proj", "v_proj"]}, 0.04)],
    ids=["zero3-full", "zero2-lora-kl"],
)
def test_steps_sample_grade_and_update(
    zero_stage: int,
    lora: dict[str, Any] | None,
    beta: float,
    tiny_llama_dir: Path,
    prompts: Path,
    tmp_path: Path,
) -> None:
    spec = spec_for(
        tiny_llama_dir,
        prompts,
        method={"beta": beta},
        deepspeed={"zero_stage": zero_stage},
        lora=lora,
    )
    result = run_ours(spec, tmp_path)
    steps = result["steps"]
    assert len(steps) == 2
    for step in steps:
        # Two micro-batches of one prompt, each sampled four times.
        assert step["samples"] == 8
        assert step["grade_failures"] == 0
        assert 0.0 <= step["reward"] <= 1.0
        assert 0.0 < step["completions/mean_length"] <= 6
        assert math.isfinite(step["loss"])
        assert math.isfinite(step["entropy"])
        if beta:
            assert step["kl"] >= 0.0
    assert result["moved"] > 0.0, "the policy never moved"
    assert 0.0 <= result["eval"]["eval_reward"] <= 1.0


@pytest.mark.parametrize("batch_size", [1, 2])
def test_eval_reward_counts_each_prompt_once_over_ranks(batch_size: int) -> None:
    """Three evaluation prompts over two ranks: DistributedSampler pads rank 1's share
    with a repeat of prompt 0 so that both ranks generate as often (ZeRO-3's forwards are
    collective); the repeat is generated but not graded, so each prompt counts once."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, DistributedSampler

    from worker.data.prompts import RECORD, PromptCollator
    from worker.training.generation import Completions
    from worker.training.grading_tasks import Graded
    from worker.training.grpo import evaluate_reward

    rows = [{"input_ids": [5 + i, 6 + i], RECORD: json.dumps({"answer": str(i)})} for i in range(3)]

    class EchoGenerator:
        """Answers each prompt with its own first token, as text."""

        def sample(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, **_: Any) -> Any:
            texts = [str(int(row[m.bool()][0]) - 5) for row, m in zip(ids, mask, strict=True)]
            n = len(texts)
            return Completions(
                ids=torch.zeros(n, 1, dtype=torch.long),
                mask=torch.ones(n, 1, dtype=torch.long),
                texts=texts,
                ended=torch.ones(n, dtype=torch.bool),
            )

    graded_items: list[Any] = []

    def grade(grader: dict[str, Any], texts: list[str], items: list[Any]) -> Graded:
        graded_items.extend(items)
        # Prompt 0 scores 1, the others 0: a repeat of prompt 0 graded would lift the mean.
        return Graded(rewards=[1.0 if t == "0" else 0.0 for t in texts])

    spec = RunSpec.model_validate(
        {
            "run_id": "run_eval",
            "attempt": 1,
            "storage_path": "/unused",
            "model": "/unused",
            "dataset": {"source": "/unused", "format": "prompt"},
            "method": {"type": "grpo", "grader": GRADER},
            "resources": {"num_workers": 2},
        }
    )
    engine = SimpleNamespace(module=torch.nn.Linear(1, 1), zero_optimization_stage=lambda: 0)
    rewards = []
    for rank in (0, 1):
        sampler: Any = DistributedSampler(rows, num_replicas=2, rank=rank, shuffle=False)
        loader = DataLoader(
            rows, batch_size=batch_size, sampler=sampler, collate_fn=PromptCollator(0)
        )
        result = evaluate_reward(
            engine,
            loader,
            spec=spec,
            device=torch.device("cpu"),
            group=None,
            generator=EchoGenerator(),  # type: ignore[arg-type]
            grade=grade,
        )
        rewards.append(result["eval_reward"])
    assert sorted(item["answer"] for item in graded_items) == ["0", "1", "2"]
    # Rank 0 graded prompts 0 and 2, rank 1 prompt 1 (alone: no group to add it up here).
    assert rewards == [0.5, 0.0]
