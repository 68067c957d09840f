"""The best checkpoint and early stopping (worker/training/eval_watch.py), against Hugging Face's
Trainer with its EarlyStoppingCallback as the reference."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from contract.run_request import RunSpec
from worker.reporting.metrics import MetricSinks
from worker.training.eval_watch import EvalWatch
from worker.training.preemption import Preemption


def spec(**fields: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "run_id": "run_watch",
            "attempt": 1,
            "storage_path": "/tmp/storage",
            "model": "/models/tiny-gpt2",
            "dataset": {"source": "/data/train.jsonl", "eval_split": "train[:10%]"},
            "training": {"max_steps": 100, "eval_every_n_steps": 1},
            **fields,
        }
    )


def feed(watch: EvalWatch, values: list[float], metric: str = "eval_loss") -> int | None:
    """The step (1-based) at which the watch stops, or None."""
    for step, value in enumerate(values, start=1):
        if watch.observe({metric: value}, step=step) is not None:
            return step
    return None


class TestEarlyStopping:
    def test_stops_after_patience_evaluations_without_improvement(self) -> None:
        watch = EvalWatch(spec(early_stopping={"patience": 2}))

        assert feed(watch, [1.0, 0.8, 0.9, 0.85, 0.7]) == 4
        assert watch.state.stopped is not None and "step 4" in watch.state.stopped
        assert (watch.state.best_step, watch.state.best_value) == (2, 0.8)

    def test_an_improvement_restarts_the_count(self) -> None:
        watch = EvalWatch(spec(early_stopping={"patience": 2}))

        assert feed(watch, [1.0, 1.1, 0.9, 1.0, 0.95, 0.96]) == 5

    def test_min_delta_counts_small_improvements_as_none(self) -> None:
        # Each beats the best by 0.05, not more than min_delta 0.1.
        watch = EvalWatch(spec(early_stopping={"patience": 3, "min_delta": 0.1}))

        assert feed(watch, [1.0, 0.95, 0.9, 0.85, 0.8]) == 4
        # The best checkpoint still follows every improvement.
        assert watch.state.best_step == 4

    def test_mode_max_for_accuracy(self) -> None:
        watch = EvalWatch(
            spec(task="sequence_classification", early_stopping={"metric": "eval_accuracy"})
        )
        assert watch.mode == "max"

        assert feed(watch, [0.5, 0.6, 0.6, 0.55, 0.58], metric="eval_accuracy") == 5
        # A tie takes the best place (Ray Train's retention ranks the later one higher).
        assert watch.state.best_step == 3

    def test_nan_is_never_an_improvement(self) -> None:
        watch = EvalWatch(spec(early_stopping={"patience": 1}))

        assert feed(watch, [1.0, float("nan")]) == 2
        assert watch.state.best_step == 1

    def test_state_survives_a_restart(self) -> None:
        first = EvalWatch(spec(early_stopping={"patience": 3}))
        assert feed(first, [1.0, 1.2, 1.3]) is None

        resumed = EvalWatch(spec(early_stopping={"patience": 3}))
        resumed.load_state_dict(first.state_dict())

        # The third evaluation in a row without improvement: patience is not granted anew.
        assert resumed.observe({"eval_loss": 1.1}, step=4) is not None
        assert resumed.state.best_step == 1

    def test_no_criterion_watches_nothing(self) -> None:
        watch = EvalWatch(spec())

        assert not watch.active
        assert watch.observe({"eval_loss": 1.0}, step=1) is None


class TestBestWithoutStopping:
    def test_best_metric_ranks_but_never_stops(self) -> None:
        watch = EvalWatch(spec(checkpointing={"best_metric": "eval_perplexity"}))

        assert feed(watch, [5.0, 4.0, 6.0, 7.0, 8.0, 9.0], metric="eval_perplexity") is None
        assert (watch.state.best_step, watch.state.best_value) == (2, 4.0)

    def test_export_from_best_ranks_by_eval_loss(self) -> None:
        watch = EvalWatch(spec(export={"from": "best"}))

        assert (watch.metric, watch.mode) == ("eval_loss", "min")


class TestCheckpointRanking:
    """What a checkpoint reports for Ray Train's retention to rank it by: the ranking
    metric of its own step, NaN between evaluations (the full retention, against Ray's own
    checkpoint manager and the service's list, is tests/app/test_checkpoint_retention.py)."""

    def test_a_preemption_checkpoint_between_evaluations_ranks_lowest(self) -> None:
        watch = EvalWatch(spec(export={"from": "best"}))
        watch.observe({"eval_loss": 0.5}, step=10)
        # The preemption's step is logged, so the latest metrics are that step's alone.
        marker = Preemption(attempt=1, client=None, group=None).marker()

        reported = watch.ranked({"loss": 1.2, **marker}, step=13)

        # Absent, Ray would score it -inf x (-1) for min: above the best at step 10.
        assert math.isnan(reported["eval_loss"])
        assert reported["loss"] == 1.2
        assert reported["preempted"] == 1 and reported["preempted_attempt"] == 1

    def test_a_ranked_checkpoint_sorts_below_the_best_as_ray_scores_it(self) -> None:
        from ray.train import CheckpointConfig
        from ray.train._internal.checkpoint_manager import _CheckpointManager
        from ray.train._internal.session import _TrainingResult

        watch = EvalWatch(spec(export={"from": "best"}))
        watch.observe({"eval_loss": 0.5}, step=10)
        ray = _CheckpointManager(
            CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute="eval_loss", checkpoint_score_order="min"
            )
        )

        def score(metrics: dict[str, Any]) -> Any:
            return ray._get_checkpoint_score(_TrainingResult(checkpoint=None, metrics=metrics))

        best = score(watch.ranked({"loss": 1.0}, step=10))
        assert score(watch.ranked({"loss": 1.2}, step=13)) < best
        # The same report without the metric, as workers sent it before: Ray's very best.
        assert score({"loss": 1.2}) > best

    def test_an_earlier_evaluations_value_is_not_carried_over(self) -> None:
        run = spec(export={"from": "best"})
        watch, sinks = EvalWatch(run), MetricSinks(run, rank=1)
        watch.observe({"eval_loss": 0.5}, step=10)
        sinks.log_eval({"eval_loss": 0.5}, step=10)
        # No step logged since: the latest metrics still hold step 10's evaluation, which a
        # periodic checkpoint at step 12 must not report as its own (a tie with the best,
        # which Ray breaks for the later one).
        assert sinks.latest["eval_loss"] == 0.5

        assert math.isnan(watch.ranked(sinks.latest, step=12)["eval_loss"])
        assert watch.ranked(sinks.latest, step=10)["eval_loss"] == 0.5

    def test_a_resumed_watch_has_no_evaluation_of_its_own_yet(self) -> None:
        first = EvalWatch(spec(export={"from": "best"}))
        first.observe({"eval_loss": 0.5}, step=10)
        resumed = EvalWatch(spec(export={"from": "best"}))
        resumed.load_state_dict(first.state_dict())

        assert math.isnan(resumed.ranked({"eval_loss": 0.5}, step=11)["eval_loss"])

    def test_the_metric_of_mode_max_too(self) -> None:
        watch = EvalWatch(
            spec(checkpointing={"best_metric": "eval_perplexity", "best_mode": "max"})
        )
        watch.observe({"eval_perplexity": 7.0}, step=4)

        assert watch.ranked({}, step=4) == {"eval_perplexity": 7.0}
        assert math.isnan(watch.ranked({}, step=5)["eval_perplexity"])

    def test_without_a_ranking_metric_the_metrics_are_left_alone(self) -> None:
        watch = EvalWatch(spec())

        assert watch.ranked({"loss": 1.0}, step=3) == {"loss": 1.0}


@pytest.mark.parametrize(("patience", "threshold"), [(2, 0.0), (2, 0.02), (3, 0.005)])
def test_stops_where_hugging_face_trainer_stops(
    tiny_model_dir: Path, tmp_path: Path, patience: int, threshold: float
) -> None:
    """A real Trainer with EarlyStoppingCallback trains a tiny model, evaluating every step;
    the watch, fed the same evaluation losses, stops at the same step with the same best."""
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        EarlyStoppingCallback,
        Trainer,
        TrainingArguments,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    texts = [f"line {i} of the tiny corpus, with words {i * 7 % 13}" for i in range(48)]
    rows = Dataset.from_dict({"text": texts}).map(
        lambda r: tokenizer(r["text"], truncation=True, max_length=24), remove_columns=["text"]
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=40,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        # Large steps: the evaluation loss falls, then wobbles and rises.
        learning_rate=5e-2,
        lr_scheduler_type="constant",
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows.select(range(40)),
        eval_dataset=rows.select(range(40, 48)),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=[
            EarlyStoppingCallback(
                early_stopping_patience=patience, early_stopping_threshold=threshold
            )
        ],
    )
    trainer.train()
    losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    hf_stop = trainer.state.global_step
    assert hf_stop < args.max_steps, "the reference run must stop early to compare with"

    watch = EvalWatch(
        spec(early_stopping={"patience": patience, "min_delta": threshold, "mode": "min"})
    )

    assert feed(watch, losses) == hf_stop
    assert watch.state.stop_best == pytest.approx(trainer.state.best_metric)
