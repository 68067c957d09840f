"""worker/training/evaluation.py (eval metrics) and worker/model/checkpoints.py (refusing a bad
resume)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from contract.run_request import RunSpec
from worker.model.checkpoints import MANIFEST, restore_checkpoint
from worker.training.evaluation import _f1, evaluate


class StandInEngine(torch.nn.Module):
    """What `evaluate` uses of a DeepSpeed engine: `.module`, eval/train and a forward.

    Each batch carries the logits the model is to answer with, and the loss is computed
    from them as a Hugging Face model does (shifted by one for a causal LM).
    """

    def __init__(self, task: str) -> None:
        super().__init__()
        self.task = task
        self.module = torch.nn.Linear(1, 1)
        self.modes_seen: list[bool] = []

    def forward(self, *, logits: torch.Tensor, labels: torch.Tensor, **_: Any) -> Any:
        self.modes_seen.append(self.training)
        if self.task == "sequence_classification":
            loss = F.cross_entropy(logits, labels)
        else:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return SimpleNamespace(loss=loss, logits=logits)


def classification_batch(predicted: list[int], labels: list[int], classes: int) -> dict[str, Any]:
    """Logits whose argmax is `predicted`, not all equally confident, so the loss varies."""
    scale = torch.arange(1, len(predicted) + 1, dtype=torch.float32).unsqueeze(1)
    logits = F.one_hot(torch.tensor(predicted), classes).float() * scale
    return {
        "input_ids": torch.zeros(len(labels), 3, dtype=torch.long),
        "logits": logits,
        "labels": torch.tensor(labels),
    }


def run_evaluate(batches: list[dict[str, Any]], *, task: str, num_labels: int) -> dict[str, float]:
    engine = StandInEngine(task)
    engine.train()
    metrics = evaluate(engine, batches, task=task, num_labels=num_labels)
    # Forward passes ran in eval mode; training mode is back afterwards.
    assert engine.modes_seen == [False] * len(batches)
    assert engine.training and engine.module.training
    return metrics


class TestF1:
    @pytest.mark.parametrize(
        ("tp", "fp", "fn", "expected"),
        [(2, 1, 1, 2 / 3), (5, 0, 0, 1.0), (1, 0, 3, 0.4), (0, 3, 2, 0.0), (0, 0, 0, 0.0)],
    )
    def test_f1(self, tp: float, fp: float, fn: float, expected: float) -> None:
        assert _f1(tp, fp, fn) == pytest.approx(expected)


class TestEvaluateClassification:
    # Predictions 0 1 0 | 1 0 against labels 0 1 1 | 0 0: 3 of 5 right.
    # Class 1: tp 1, fp 1, fn 1 -> F1 1/2. Class 0: tp 2, fp 1, fn 1 -> F1 2/3.
    BINARY = (([0, 1, 0], [0, 1, 1]), ([1, 0], [0, 0]))
    # Predictions 0 1 1 | 1 2 0 against labels 0 0 1 | 1 2 2: 4 of 6 right.
    # F1 per class: 0 -> 1/2, 1 -> 4/5, 2 -> 2/3.
    THREE = (([0, 1, 1], [0, 0, 1]), ([1, 2, 0], [1, 2, 2]))

    def batches(self, pairs: tuple[tuple[list[int], list[int]], ...], classes: int) -> list[Any]:
        return [classification_batch(p, y, classes) for p, y in pairs]

    def example_mean_loss(self, batches: list[dict[str, Any]]) -> float:
        logits = torch.cat([b["logits"] for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        return float(F.cross_entropy(logits, labels))

    def test_binary_reports_f1_of_the_positive_class(self) -> None:
        batches = self.batches(self.BINARY, 2)

        metrics = run_evaluate(batches, task="sequence_classification", num_labels=2)

        assert set(metrics) == {"eval_loss", "eval_accuracy", "eval_f1"}
        assert metrics["eval_accuracy"] == pytest.approx(3 / 5)
        assert metrics["eval_f1"] == pytest.approx(1 / 2)
        assert metrics["eval_loss"] == pytest.approx(self.example_mean_loss(batches))

    def test_three_classes_report_macro_f1(self) -> None:
        batches = self.batches(self.THREE, 3)

        metrics = run_evaluate(batches, task="sequence_classification", num_labels=3)

        assert metrics["eval_accuracy"] == pytest.approx(4 / 6)
        assert metrics["eval_f1"] == pytest.approx((1 / 2 + 4 / 5 + 2 / 3) / 3)
        assert metrics["eval_loss"] == pytest.approx(self.example_mean_loss(batches))

    def test_a_class_never_seen_counts_zero_in_the_macro_f1(self) -> None:
        batches = self.batches(self.THREE, 4)

        metrics = run_evaluate(batches, task="sequence_classification", num_labels=4)

        assert metrics["eval_f1"] == pytest.approx((1 / 2 + 4 / 5 + 2 / 3 + 0) / 4)

    def test_tensor_parallel_duplicates_leave_the_metrics_unchanged(self) -> None:
        batches = self.batches(self.THREE, 3)
        once = run_evaluate(batches, task="sequence_classification", num_labels=3)

        # The two ranks of a tensor-parallel group evaluate the same batches.
        doubled = [b for b in batches for _ in range(2)]
        metrics = run_evaluate(doubled, task="sequence_classification", num_labels=3)

        assert metrics == pytest.approx(once)


class TestEvaluateCausalLM:
    @pytest.fixture
    def batches(self) -> list[dict[str, Any]]:
        """Batches with different numbers of targets: prompts, padding, plain text."""
        generator = torch.Generator().manual_seed(0)
        vocab = 11

        def batch(labels: list[list[int]]) -> dict[str, Any]:
            label_tensor = torch.tensor(labels)
            ids = label_tensor.clamp(min=0)
            logits = torch.randn(*label_tensor.shape, vocab, generator=generator) * 3
            return {"input_ids": ids, "labels": label_tensor, "logits": logits}

        return [
            # A prompt_completion batch: prompt and padding ignored; 5 targets.
            batch([[-100, -100, 4, 5, 0], [-100, -100, -100, 7, -100]]),
            # Plain text: every token after the first is a target; 2 targets.
            batch([[3, 8, 2]]),
            # A long row and a short one: 6 targets.
            batch([[1, 2, 3, 4, 5, 6], [9, 10, -100, -100, -100, -100]]),
        ]

    def token_mean_loss(self, batches: list[dict[str, Any]]) -> float:
        logits = torch.cat([b["logits"][:, :-1].reshape(-1, 11) for b in batches])
        targets = torch.cat([b["labels"][:, 1:].reshape(-1) for b in batches])
        return float(F.cross_entropy(logits, targets, ignore_index=-100))

    def test_loss_is_the_mean_over_every_target_token(self, batches: Any) -> None:
        engine = StandInEngine("causal_lm")
        batch_losses = [float(engine(**b).loss) for b in batches]
        expected = self.token_mean_loss(batches)
        # Weighing batches equally would give another number.
        assert abs(sum(batch_losses) / len(batch_losses) - expected) > 1e-3

        metrics = run_evaluate(batches, task="causal_lm", num_labels=1)

        assert set(metrics) == {"eval_loss", "eval_perplexity"}
        assert metrics["eval_loss"] == pytest.approx(expected)
        assert metrics["eval_perplexity"] == pytest.approx(math.exp(expected))

    def test_tensor_parallel_duplicates_leave_the_metrics_unchanged(self, batches: Any) -> None:
        once = run_evaluate(batches, task="causal_lm", num_labels=1)

        doubled = [b for b in batches for _ in range(2)]
        metrics = run_evaluate(doubled, task="causal_lm", num_labels=1)

        assert metrics == pytest.approx(once)
        assert metrics["eval_loss"] == pytest.approx(self.token_mean_loss(batches))

    def test_a_batch_without_targets_adds_nothing(self, batches: Any) -> None:
        """Packed prompt_completion data can hold a block that is all prompt."""
        all_prompt = {
            "input_ids": torch.tensor([[1, 2, 3]]),
            "labels": torch.tensor([[-100, -100, -100]]),
            "logits": torch.zeros(1, 3, 11),
        }

        metrics = run_evaluate([*batches, all_prompt], task="causal_lm", num_labels=1)

        assert metrics["eval_loss"] == pytest.approx(self.token_mean_loss(batches))


def run_spec(tmp_path: Path, *, zero_stage: int = 2, tensor_parallel_size: int = 1) -> RunSpec:
    return RunSpec.model_validate(
        {
            "run_id": "run_resume",
            "attempt": 2,
            "storage_path": str(tmp_path / "storage"),
            "model": "/models/tiny-gpt2",
            "dataset": {"source": "/data/train.jsonl"},
            "deepspeed": {"zero_stage": zero_stage, "tensor_parallel_size": tensor_parallel_size},
            "resources": {"num_workers": 2},
        }
    )


def checkpoint_folder(tmp_path: Path, *, zero_stage: int, tensor_parallel_size: int) -> Path:
    """A checkpoint as `save_and_report_checkpoint` leaves it: DeepSpeed's files and the
    manifest beside them."""
    folder = tmp_path / "checkpoint_step_00000040"
    (folder / "step_40").mkdir(parents=True)
    (folder / "latest").write_text("step_40")
    manifest = {
        "step": 40,
        "epoch": 1.5,
        "zero_stage": zero_stage,
        "tensor_parallel_size": tensor_parallel_size,
        "attempt": 1,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


class EngineThatMustNotLoad:
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the engine was asked to load a checkpoint")


class LoadingEngine:
    """Answers `load_checkpoint` as DeepSpeed does: (path, client_state)."""

    def __init__(self) -> None:
        self.loaded_from: list[Path] = []

    def load_checkpoint(self, folder: str) -> tuple[str, dict[str, Any]]:
        self.loaded_from.append(Path(folder))
        return str(Path(folder) / "step_40"), {"step": 40}


def use_checkpoint(monkeypatch: pytest.MonkeyPatch, folder: Path | None) -> None:
    """What Ray Train hands a worker: its latest checkpoint, or None on a first attempt."""
    import ray.train

    checkpoint = ray.train.Checkpoint.from_directory(str(folder)) if folder else None
    monkeypatch.setattr("ray.train.get_checkpoint", lambda: checkpoint)


class TestRestoreCheckpoint:
    def test_no_checkpoint_starts_at_step_zero(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        use_checkpoint(monkeypatch, None)

        assert restore_checkpoint(EngineThatMustNotLoad(), run_spec(tmp_path)).step == 0

    def test_compatible_checkpoint_is_loaded_and_gives_its_step(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        folder = checkpoint_folder(tmp_path, zero_stage=2, tensor_parallel_size=1)
        use_checkpoint(monkeypatch, folder)
        engine = LoadingEngine()

        step = restore_checkpoint(engine, run_spec(tmp_path, zero_stage=2)).step

        assert step == 40
        assert len(engine.loaded_from) == 1
        assert (engine.loaded_from[0] / MANIFEST).is_file()

    @pytest.mark.parametrize(
        ("written", "asked", "message"),
        [
            ((3, 1), (2, 1), r"deepspeed\.zero_stage=3, this run asks for 2"),
            ((1, 1), (3, 1), r"deepspeed\.zero_stage=1, this run asks for 3"),
            ((2, 2), (2, 1), r"deepspeed\.tensor_parallel_size=2, this run asks for 1"),
            ((2, 1), (2, 2), r"deepspeed\.tensor_parallel_size=1, this run asks for 2"),
        ],
    )
    def test_incompatible_checkpoint_is_refused_before_the_engine_loads(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        written: tuple[int, int],
        asked: tuple[int, int],
        message: str,
    ) -> None:
        folder = checkpoint_folder(tmp_path, zero_stage=written[0], tensor_parallel_size=written[1])
        use_checkpoint(monkeypatch, folder)
        spec = run_spec(tmp_path, zero_stage=asked[0], tensor_parallel_size=asked[1])

        with pytest.raises(ValueError, match=rf"cannot resume.*{message}"):
            restore_checkpoint(EngineThatMustNotLoad(), spec)


class TestEvalShards:
    """An unshuffled DistributedSampler repeats examples so every rank runs as many
    forwards; a repeat must not count twice in the split's metrics."""

    @staticmethod
    def real_rows(size: int, ranks: int, rank: int, batch: int) -> list[int]:
        from torch.utils.data import DataLoader, DistributedSampler

        from worker.training.evaluation import real_rows

        examples = list(range(size))
        sampler: DistributedSampler[int] = DistributedSampler(
            examples, num_replicas=ranks, rank=rank, shuffle=False, drop_last=False
        )
        loader = DataLoader(examples, batch_size=batch, sampler=sampler)
        seen = [(len(b), real) for b, real in zip(loader, real_rows(loader), strict=False)]
        # The rows counted over every rank are each example once.
        return [real for _, real in seen]

    def test_the_repeated_tail_is_left_out(self) -> None:
        # 5 examples over 2 ranks: rank 0 holds 0, 2, 4; rank 1 holds 1, 3 and a repeat of 0.
        assert self.real_rows(5, 2, 0, batch=2) == [2, 1]
        assert self.real_rows(5, 2, 1, batch=2) == [2, 0]

    def test_every_example_counts_once_over_all_ranks(self) -> None:
        for size, ranks, batch in [(7, 3, 2), (10, 4, 3), (8, 2, 4)]:
            counted = sum(sum(self.real_rows(size, ranks, r, batch)) for r in range(ranks))
            assert counted == size

    def test_a_padded_row_is_left_out_of_the_loss_and_the_scores(self) -> None:
        from torch.utils.data import DataLoader, DistributedSampler

        logits = torch.tensor([[4.0, 0.0], [0.0, 4.0], [4.0, 0.0]])
        rows = [
            {"logits": logits[i], "labels": torch.tensor(label), "input_ids": torch.tensor([1])}
            for i, label in enumerate([0, 0, 1])
        ]
        # Rank 1 of 2 holds row 1 and a repeat of row 0.
        sampler: DistributedSampler[Any] = DistributedSampler(
            rows, num_replicas=2, rank=1, shuffle=False
        )
        loader = DataLoader(rows, batch_size=2, sampler=sampler)
        metrics = evaluate(
            StandInEngine("sequence_classification"),
            loader,
            task="sequence_classification",
            num_labels=2,
        )
        # Only row 1 counts: label 0, predicted 1.
        assert metrics["eval_accuracy"] == 0.0
        assert metrics["eval_loss"] == pytest.approx(
            float(F.cross_entropy(logits[1:2], torch.tensor([0])))
        )
