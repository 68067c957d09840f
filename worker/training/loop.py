"""The per-rank training function that Ray Train runs on every worker."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from contract.callbacks import EventType, StartupPhase
from contract.run_request import RunSpec
from contract.steps import StepPlan
from worker.data.remote_sources import with_local_sources
from worker.model.checkpoints import (
    export_hf_model,
    load_weights_of_step,
    restore_checkpoint,
    save_and_report_checkpoint,
)
from worker.reporting.logs import configure_worker_logging
from worker.reporting.metrics import MetricSinks, StepResult
from worker.reporting.nodes import check_worker_nodes
from worker.reporting.startup import StartupClock, process_started_at
from worker.training.deepspeed_import import import_deepspeed
from worker.training.eval_watch import EvalWatch
from worker.training.jit_lock import clear_stale_jit_locks
from worker.training.preemption import Preemption
from worker.training.step_gate import hold_if_asked

log = logging.getLogger("tuneyard.worker")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import torch.distributed as dist

    entered = time.time()
    spec = RunSpec.model_validate(config["spec"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    configure_worker_logging(run_id=spec.run_id, attempt=spec.attempt, rank=rank)
    place_rank(spec, local_world_size=context.get_local_world_size())
    import_deepspeed()
    sinks = MetricSinks(spec, rank=rank)
    # This rank's part of the attempt's start (worker/reporting/startup.py); rank 0 posts it.
    fit_started_at = config.get("fit_started_at")
    started = process_started_at()
    startup = StartupClock(sinks.startup_phase, since=fit_started_at or started)
    if fit_started_at is not None:
        startup.lap(StartupPhase.WORKERS, at=started)
    startup.lap(StartupPhase.PROCESS_GROUP, at=entered)
    startup.lap(StartupPhase.IMPORTS)
    # Rank 0 asks the service, from now on, whether the scheduler wants the attempt to
    # stop; every rank votes on it at each step boundary (worker/training/preemption.py).
    preemption = Preemption(attempt=spec.attempt, client=sinks.client, group=sinks.group)
    # With "engine_ready" below: when each start-up stage ended, as events on the service's
    # clock, for users asking where a slow start went (and for bench/dispatch_latency.py).
    sinks.event(
        EventType.WORKER_STARTED, f"training workers started ({spec.resources.num_workers})"
    )
    try:
        check_worker_nodes(spec, rank=rank, post_event=sinks.event)
        # An upload or an earlier run's export in object storage: read from local disk.
        _train(
            with_local_sources(spec),
            rank=rank,
            sinks=sinks,
            preemption=preemption,
            startup=startup,
        )
    finally:
        preemption.close()
        sinks.close()
    # Only after success: a rank that raised must not wait in a barrier its peers, stuck in
    # the step's collective, never reach. It returns its error at once, and Ray Train ends
    # the run (worker.training.trainer.TrainingErrorStop), tearing the blocked peers down.
    if dist.is_initialized():
        dist.barrier()


def place_rank(spec: RunSpec, *, local_world_size: int) -> None:
    """Device and threads for this rank, before DeepSpeed or torch start using either.

    DeepSpeed picks its GPU from `LOCAL_RANK`; Ray Train gives each worker the device
    `ray.train.torch.get_device()`: its GPU's position in the node's CUDA_VISIBLE_DEVICES,
    which Ray sorts as strings (ray/train/v2/_internal/callbacks/accelerators.py), so on a
    node of more than 10 GPUs "10" comes before "2" and the position is not the local
    rank. Both must name the same device, so LOCAL_RANK is set from Ray's.

    Ray sets OMP_NUM_THREADS to the worker's CPUs (1 by default), which leaves DeepSpeed's
    CPU Adam and the host-side work of a GPU rank on one thread.
    """
    import os

    import torch

    if spec.resources.use_gpu:
        import ray.train.torch

        device = ray.train.torch.get_device()
        if device.type == "cuda" and device.index is not None:
            os.environ["LOCAL_RANK"] = str(device.index)
            torch.cuda.set_device(device)
    threads = cpu_threads(spec, node_cpus=os.cpu_count() or 1, local_world_size=local_world_size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def cpu_threads(spec: RunSpec, *, node_cpus: int, local_world_size: int) -> int:
    """`resources.cpu_threads_per_worker`, or: a CPU run's own CPUs; a GPU run's share of
    the node's cores (its GPUs' ranks split them evenly), at least its CPUs."""
    res = spec.resources
    if res.cpu_threads_per_worker is not None:
        return res.cpu_threads_per_worker
    own = max(1, int(res.cpus_per_worker))
    if not res.use_gpu:
        return own
    return max(own, node_cpus // max(local_world_size, 1))


@dataclass(slots=True)
class Training:
    """One rank's engine and what feeds it."""

    engine: Any
    tokenizer: Any
    data: Any  # worker.data.preparation.Data
    plan: StepPlan
    device: Any
    zero3_config: Any = None  # kept alive for transformers (worker.model.loading.LoadedModel)
    # Method dpo (and grpo with a KL term): what the policy is compared with
    # (worker/training/dpo.py).
    reference: Any = None
    generator: Any = (
        None  # method grpo: what samples its completions (worker/training/generation.py)
    )
    # Method grpo with a score_model grader: grading that asks its judges on this rank first
    # (worker/training/judge.py); None grades as worker/training/grpo.py does by default.
    grade: Any = None


def build_training(spec: RunSpec, *, rank: int, startup: StartupClock | None = None) -> Training:
    """Tokenizer, data, model, optimizer, scheduler and the DeepSpeed engine, as a run
    trains with them (bench/step_overhead.py builds the same to time the step alone);
    `startup` laps its data, model and deepspeed phases."""
    lap = startup.lap if startup is not None else lambda phase: None
    # Before DeepSpeed builds or loads its JIT ops (shared-memory comm in init_distributed,
    # CPU Adam when the optimizer is offloaded): a build lock a killed worker left behind
    # would make this rank wait for it forever.
    clear_stale_jit_locks()
    import deepspeed
    import torch
    from transformers import set_seed

    from contract.deepspeed_config import resolve_deepspeed_config, resolve_precision
    from worker.data.preparation import build_data
    from worker.model.loading import build_model, load_tokenizer
    from worker.training.optimizer import build_optimizer

    set_seed(spec.training.seed)
    device = _device(spec)
    tokenizer = load_tokenizer(spec)
    data = build_data(spec, tokenizer, rank=rank)
    lap(StartupPhase.DATA)
    # The count /v1/runs/validate gives for the same examples (contract/steps.py).
    plan = StepPlan.for_examples(spec, examples=len(data.train.dataset))
    # Native bf16 only: V100 and T4 report emulated bf16 as supported, and run it slowly.
    bf16_ok = bool(
        spec.resources.use_gpu and torch.cuda.is_bf16_supported(including_emulation=False)
    )
    ds_config = resolve_deepspeed_config(
        spec, bf16_supported=bf16_ok, hidden_size=model_hidden_size(spec)
    )
    precision = resolve_precision(spec, bf16_supported=bf16_ok)
    loaded = build_model(spec, tokenizer, data.labels, ds_config=ds_config, precision=precision)
    lap(StartupPhase.MODEL)
    if spec.method.type == "dpo":
        from worker.training.dpo import disable_dropout

        disable_dropout(loaded.module)
    optimizer, scheduler = build_optimizer(spec, loaded.module, total_steps=plan.total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=loaded.module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    reference = None
    if spec.method.type == "dpo" or (spec.method.type == "grpo" and spec.method.beta > 0):
        from worker.training.dpo import build_reference

        # After the policy on every rank, in the same order: under ZeRO-3 loading the
        # copy is collective.
        reference = build_reference(
            spec, tokenizer, engine=engine, ds_config=ds_config, precision=precision
        )
    training = Training(
        engine=engine,
        tokenizer=tokenizer,
        data=data,
        plan=plan,
        device=device,
        zero3_config=loaded.zero3_config,
        reference=reference,
        generator=_generator(spec, tokenizer),
        grade=_judged_grading(spec, device=device, zero3_config=loaded.zero3_config),
    )
    lap(StartupPhase.DEEPSPEED)
    return training


def _generator(spec: RunSpec, tokenizer: Any) -> Any:
    if spec.method.type != "grpo":
        return None
    from worker.training.generation import HfGenerator

    return HfGenerator(tokenizer)


def _judged_grading(spec: RunSpec, *, device: Any, zero3_config: Any) -> Any:
    from contract.graders.score_model import judged_leaves

    if spec.method.type != "grpo" or not judged_leaves(spec.method.grader):
        return None
    from worker.training.judge import Judges

    return Judges(device=device, zero3_config=zero3_config).grade


def model_hidden_size(spec: RunSpec) -> int | None:
    from transformers import AutoConfig

    from contract.deepspeed_config import hidden_size_of

    return hidden_size_of(AutoConfig.from_pretrained(spec.model).to_dict())


def _train(
    spec: RunSpec,
    *,
    rank: int,
    sinks: MetricSinks,
    preemption: Preemption,
    startup: StartupClock,
) -> None:
    attempt = Attempt.start(spec, rank=rank, sinks=sinks, startup=startup)
    if attempt.train(preemption):
        # Stopped for the scheduler, its checkpoint saved: no final evaluation, no export and
        # no "succeeded". The driver tells the service, which requeues the run.
        log.info("stopped at step %d for the scheduler; checkpoint saved", attempt.step)
        return
    attempt.finish()
    attempt.export()


@dataclass(slots=True)
class Attempt:
    """One rank's part of one attempt: the engine, the step it is at, the last step it
    saved, and the evaluation watch (which checkpoint is best, whether to stop early: the
    same on every rank)."""

    spec: RunSpec
    rank: int
    sinks: MetricSinks
    training: Training
    watch: EvalWatch
    step: int
    saved_at: int | None
    # Until the attempt's first step ends, which is its start's last phase.
    startup: StartupClock | None = None

    @classmethod
    def start(
        cls, spec: RunSpec, *, rank: int, sinks: MetricSinks, startup: StartupClock | None = None
    ) -> Attempt:
        """Built, and restored from the run's latest checkpoint where it has one."""
        setup_started = time.perf_counter()
        training = build_training(spec, rank=rank, startup=startup)
        sinks.event(
            EventType.ENGINE_READY,
            f"tokenizer, data, model and DeepSpeed engine ready in "
            f"{time.perf_counter() - setup_started:.1f}s",
        )
        for note in training.data.notes:
            sinks.event(EventType.DATA_FITTED, note)
        restored = restore_checkpoint(training.engine, spec)
        step = restored.step
        if step:
            # Every rank restored; rank 0 says from where, retried: it is the run's record.
            sinks.record(
                EventType.RESUMED,
                f"attempt {spec.attempt}: resumed from the checkpoint at step {step}",
            )
        log.info("training steps %d..%d", step, training.plan.total_steps)
        watch = EvalWatch(spec)
        watch.load_state_dict(restored.watch)
        return cls(
            spec,
            rank,
            sinks,
            training,
            watch,
            step,
            saved_at=step if step else None,
            startup=startup,
        )

    def train(self, preemption: Preemption) -> bool:
        """Steps to the plan's end or an early stop; True when stopped for the scheduler."""
        plan, tr = self.training.plan, self.spec.training
        batches = batches_from(plan, self.training.data.train, self.step)
        tokens_since_log = 0
        while self.step < plan.total_steps and self.watch.state.stopped is None:
            step = self.step + 1
            logged = step % tr.log_every_n_steps == 0 or step == plan.total_steps
            result, elapsed = self._step(batches, timed=logged)
            self.step = step
            if self.startup is not None:
                # Once: a GPU step may still be running when the host has queued it.
                _synchronize(self.training.device)
                self.startup.lap(StartupPhase.FIRST_STEP)
                self.startup = None
            tokens_since_log += result.tokens
            # Once per optimizer step, on every rank alike. The last step is never
            # preempted: the run ends there anyway.
            asked = step < plan.total_steps and preemption.agreed()
            if logged or asked:
                # A step the attempt may stop at is logged even off the logging grid, so
                # that `tokens` (summed since the last logged step) loses no step.
                self.sinks.log_step(
                    self.training.engine,
                    step=step,
                    epoch=plan.epoch_at(step),
                    elapsed=elapsed,
                    result=result,
                    total_steps=plan.total_steps,
                    tokens_since_log=tokens_since_log,
                )
                tokens_since_log = 0
            evaluated = _on_grid(step, tr.eval_every_n_steps, plan.total_steps)
            if evaluated:
                # Before a preemption's checkpoint too, as an uninterrupted run evaluates.
                self.evaluate()
            # An early stop decided at this step ends the run here, export and all: nothing
            # would be left to resume.
            preempted = asked and self.watch.state.stopped is None
            periodic = _on_grid(step, self.spec.checkpointing.every_n_steps, plan.total_steps)
            # One checkpoint per step at most: a ranked evaluation's, which keeps its weights
            # (the best checkpoint is one of these, and a stop decided here resumes as a
            # stop), a periodic one, or the preemption's. That one carries the marker the
            # driver reads, and is Ray Train's latest, where the next attempt resumes.
            if preempted or (evaluated and self.watch.active) or (periodic and not self.saved):
                self.checkpoint(marker=preemption.marker() if preempted else None)
            if preempted:
                return True
            hold_if_asked(self.spec.run_id, step)  # a test's hold; off unless configured
        return False

    def _step(self, batches: Iterator[dict[str, Any]], *, timed: bool) -> tuple[StepResult, float]:
        """One optimizer step and its wall time. A GPU runs behind the host: a timed step is
        measured from an idle device to an idle device; other steps never wait for it."""
        if timed:
            _synchronize(self.training.device)
        started = time.perf_counter()
        if self.spec.method.type == "grpo":
            from worker.training.grpo import grpo_step

            result = grpo_step(
                self.training.engine,
                batches,
                spec=self.spec,
                device=self.training.device,
                group=self.sinks.group,
                generator=self.training.generator,
                reference=self.training.reference,
                grade=self.training.grade,
            )
        else:
            result = train_step(
                self.training.engine,
                batches,
                spec=self.spec,
                device=self.training.device,
                group=self.sinks.group,
                reference=self.training.reference,
            )
        if timed:
            _synchronize(self.training.device)
        return result, time.perf_counter() - started

    @property
    def saved(self) -> bool:
        return self.saved_at == self.step

    def evaluate(self) -> None:
        """On the eval split, at the current step; the watch ranks and may stop the run."""
        from worker.training.evaluation import evaluate

        data = self.training.data
        if data.eval is None:
            return
        if self.spec.method.type == "grpo":
            from worker.training.grpo import evaluate_reward

            metrics = evaluate_reward(
                self.training.engine,
                data.eval,
                spec=self.spec,
                device=self.training.device,
                group=self.sinks.group,
                generator=self.training.generator,
                grade=self.training.grade,
            )
            self.sinks.log_eval(metrics, step=self.step)
            self.watch.observe(metrics, step=self.step)
            return
        metrics = evaluate(
            self.training.engine,
            data.eval,
            task=self.spec.task,
            num_labels=len(data.labels or []) or 1,
            group=self.sinks.group,
            method=self.spec.method,
            reference=self.training.reference,
        )
        self.sinks.log_eval(metrics, step=self.step)
        self.watch.observe(metrics, step=self.step)

    def checkpoint(self, *, marker: dict[str, Any] | None = None) -> None:
        """A DeepSpeed checkpoint of the current step, reported to Ray Train (and by it to
        the service), after every metric up to it is delivered."""
        self.sinks.flush()
        save_and_report_checkpoint(
            self.training.engine,
            self.spec,
            step=self.step,
            epoch=self.training.plan.epoch_at(self.step),
            # With the ranking metric of this step, NaN between evaluations (see `ranked`).
            metrics=self.watch.ranked({**self.sinks.latest, **(marker or {})}, step=self.step),
            watch=self.watch.state_dict(),
        )
        self.saved_at = self.step

    def finish(self) -> None:
        """The end of a run that was not preempted: said if it stopped early, else evaluated
        at its last step; its last step checkpointed either way."""
        if self.watch.state.stopped is not None:
            if self.sinks.client is not None:
                # Retried, unlike informational events: the run's result is made of it.
                self.sinks.client.event(EventType.EARLY_STOPPED, self.watch.state.stopped)
        elif not self.saved:
            self.evaluate()
        if not self.saved:
            self.checkpoint()

    def export(self) -> None:
        """The model as `from_pretrained` loads it (and the adapter, for LoRA), from the last
        step or the best one; rank 0 reports each export to the service."""
        spec, engine, sinks = self.spec, self.training.engine, self.sinks
        if not spec.checkpointing.export_hf:
            return
        export_step = self.step
        best = self.watch.state.best_step
        if spec.export.from_ == "best" and best is not None and best != self.step:
            load_weights_of_step(engine, spec, step=best)
            export_step = best
            sinks.event(EventType.EXPORT_FROM_BEST, f"exporting the best checkpoint, step {best}")
        exports = export_hf_model(
            engine,
            self.training.tokenizer,
            spec,
            rank=self.rank,
            probe=next(iter(self.training.data.train)),
            zero3_config=self.training.zero3_config,
        )
        if self.rank == 0 and sinks.client is not None:
            # The adapter first: a full model posted after it is the run's model_path.
            for export in exports:
                sinks.client.checkpoint(
                    step=export_step,
                    epoch=self.training.plan.epoch_at(export_step),
                    path=export.path,
                    kind=export.kind,
                    metrics={"export_max_logit_diff": export.max_diff},
                )
                sinks.exported(export.path, export.kind)


def _on_grid(step: int, every: int | None, total_steps: int) -> bool:
    """Whether `step` is one of every `every` steps, short of the last (which the end of the
    run evaluates and checkpoints anyway)."""
    return bool(every and step % every == 0 and step < total_steps)


def train_step(
    engine: Any,
    batches: Iterator[dict[str, Any]],
    *,
    spec: RunSpec,
    device: Any,
    group: Any,
    reference: Any = None,
) -> StepResult:
    """One optimizer step over `gradient_accumulation_steps` micro-batches, its loss the
    mean over all the step's targets on every rank (worker/training/step_loss.py); for method dpo
    the targets are pairs, scored against `reference` (worker/training/dpo.py)."""
    import torch

    from worker.data.loading import model_inputs, packs_in_one_row_for, tokens_in
    from worker.training import step_loss

    method = spec.method
    one_row = packs_in_one_row_for(engine.module)
    micro_batches = [next(batches) for _ in range(spec.training.gradient_accumulation_steps)]
    counts = [step_loss.targets_in(b, task=spec.task, method=method.type) for b in micro_batches]
    total = step_loss.step_targets(
        sum(counts), group=group, tensor_parallel_size=spec.deepspeed.tensor_parallel_size
    )
    result = StepResult(loss=torch.zeros((), device=device), tokens=0, samples=0)
    if method.type == "dpo":
        from contract.eval_metrics import PAIR_METRICS

        result.pair_sums = torch.zeros(len(PAIR_METRICS), dtype=torch.float64, device=device)
    for batch, targets in zip(micro_batches, counts, strict=True):
        result.tokens += tokens_in(batch)
        on_device = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if method.type == "dpo":
            from worker.training.dpo import dpo_forward

            result.samples += batch["input_ids"].shape[0] // 2
            dpo = dpo_forward(engine, on_device, reference=reference, beta=method.beta)
            mean_loss = dpo.mean_loss
            result.pair_sums += dpo.sums
            result.pairs += targets
        else:
            result.samples += batch["input_ids"].shape[0]
            mean_loss = engine(**model_inputs(on_device, one_row=one_row)).loss
        share = step_loss.step_share(mean_loss, targets=targets, step_targets=total)
        step_loss.backward(engine, share, data_parallel_size=spec.data_parallel_size)
        engine.step()
        result.loss += share.detach().float()
    return result


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(spec: RunSpec) -> Any:
    import torch

    if spec.resources.use_gpu:
        import ray.train.torch

        return ray.train.torch.get_device()
    return torch.device("cpu")


def batches_from(plan: StepPlan, loader: Any, step: int) -> Iterator[dict[str, Any]]:
    """Micro-batches from the position of `step` on, cycling epochs with a fresh shuffle."""
    epoch, skip = plan.position(step)
    while True:
        loader.sampler.set_epoch(epoch)
        yield from itertools.islice(loader, skip, plan.micro_batches_per_epoch_used)
        skip = 0
        epoch += 1
