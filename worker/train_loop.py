"""The per-rank training function that Ray Train runs on every worker."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from worker.checkpoints import export_hf_model, restore_checkpoint, save_and_report_checkpoint
from worker.host_group import host_group
from worker.logs import configure_worker_logging
from worker.spec import CALLBACK_URL_ENV, TOKEN_ENV, RunSpec

log = logging.getLogger("tuneyard.worker")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import torch.distributed as dist

    spec = RunSpec.from_dict(config["spec"])
    rank = ray.train.get_context().get_world_rank()
    configure_worker_logging(run_id=spec.run_id, attempt=spec.attempt, rank=rank)
    sinks = MetricSinks(spec, rank=rank)
    # With "engine_ready" below: when each start-up stage ended, as events on the service's
    # clock, for users asking where a slow start went (and for bench/dispatch_latency.py).
    sinks.event("worker_started", f"training workers started ({spec.resources.num_workers})")
    try:
        _train(spec, rank=rank, sinks=sinks)
    finally:
        sinks.close()
        if dist.is_initialized():
            dist.barrier()


@dataclass(slots=True)
class Training:
    """One rank's engine and what feeds it."""

    engine: Any
    tokenizer: Any
    data: Any  # worker.model_setup.Data
    plan: StepPlan
    device: Any


def build_training(spec: RunSpec, *, rank: int) -> Training:
    """Tokenizer, data, model, optimizer, scheduler and the DeepSpeed engine, as a run
    trains with them (bench/step_overhead.py builds the same to time the step alone)."""
    import deepspeed
    import torch
    from transformers import set_seed

    from worker.deepspeed_config import resolve_deepspeed_config
    from worker.model_setup import build_data, build_model, build_optimizer, load_tokenizer

    set_seed(spec.training.seed)
    device = _device(spec)
    tokenizer = load_tokenizer(spec)
    data = build_data(spec, tokenizer, rank=rank)
    plan = StepPlan(spec, micro_batches_per_epoch=len(data.train))
    model = build_model(spec, tokenizer, data.labels)
    optimizer, scheduler = build_optimizer(spec, model, total_steps=plan.total_steps)
    bf16_ok = bool(spec.resources.use_gpu and torch.cuda.is_bf16_supported())
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=resolve_deepspeed_config(spec, bf16_supported=bf16_ok),
    )
    return Training(engine=engine, tokenizer=tokenizer, data=data, plan=plan, device=device)


def _train(spec: RunSpec, *, rank: int, sinks: MetricSinks) -> None:
    from worker.evaluation import evaluate

    setup_started = time.perf_counter()
    training = build_training(spec, rank=rank)
    engine, data, plan = training.engine, training.data, training.plan
    sinks.event(
        "engine_ready",
        f"tokenizer, data, model and DeepSpeed engine ready in "
        f"{time.perf_counter() - setup_started:.1f}s",
    )
    step = restore_checkpoint(engine, spec)
    if step and sinks.client is not None:
        sinks.client.event(
            "resumed", f"attempt {spec.attempt}: resumed from the checkpoint at step {step}"
        )
    log.info("training steps %d..%d", step, plan.total_steps)

    def run_eval(at: int) -> None:
        if data.eval is not None:
            metrics = evaluate(
                engine,
                data.eval,
                task=spec.task,
                num_labels=len(data.labels or []) or 1,
                group=sinks.group,
            )
            sinks.log_eval(metrics, step=at)

    batches = plan.batches_from(data.train, step)
    tr = spec.training
    while step < plan.total_steps:
        started = time.perf_counter()
        loss_sum, tokens, samples = train_step(
            engine, batches, accum=tr.gradient_accumulation_steps, device=training.device
        )
        step += 1
        if step % tr.log_every_n_steps == 0 or step == plan.total_steps:
            sinks.log_step(
                engine,
                step=step,
                epoch=plan.epoch_at(step),
                elapsed=time.perf_counter() - started,
                loss_sum=loss_sum,
                tokens=tokens,
                samples=samples,
                total_steps=plan.total_steps,
            )
        if tr.eval_every_n_steps and step % tr.eval_every_n_steps == 0 and step < plan.total_steps:
            run_eval(step)
        every = spec.checkpointing.every_n_steps
        if every and step % every == 0 and step < plan.total_steps:
            sinks.flush()
            save_and_report_checkpoint(
                engine, spec, step=step, epoch=plan.epoch_at(step), metrics=sinks.latest
            )

    run_eval(step)
    sinks.flush()
    save_and_report_checkpoint(
        engine, spec, step=step, epoch=plan.epoch_at(step), metrics=sinks.latest
    )
    if spec.checkpointing.export_hf:
        probe = next(iter(data.train))
        export = export_hf_model(engine, training.tokenizer, spec, rank=rank, probe=probe)
        if rank == 0 and sinks.client is not None:
            sinks.client.checkpoint(
                step=step,
                epoch=plan.epoch_at(step),
                path=export.path,
                kind="hf",
                metrics={"export_max_logit_diff": export.max_diff},
            )


def train_step(
    engine: Any, batches: Iterator[dict[str, Any]], *, accum: int, device: Any
) -> tuple[Any, int, int]:
    """One optimizer step of `accum` micro-batches: their summed loss (a tensor, so no
    sync here), and the tokens and samples they held."""
    import torch

    loss_sum, tokens, samples = torch.zeros((), device=device), 0, 0
    for _ in range(accum):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().float()
        tokens += int(batch["attention_mask"].sum())
        samples += batch["input_ids"].shape[0]
    return loss_sum, tokens, samples


def _device(spec: RunSpec) -> Any:
    import torch

    if spec.resources.use_gpu:
        import ray.train.torch

        return ray.train.torch.get_device()
    return torch.device("cpu")


class StepPlan:
    """Maps optimizer steps to epochs and data positions, so a resume continues exactly."""

    def __init__(self, spec: RunSpec, *, micro_batches_per_epoch: int) -> None:
        accum = spec.training.gradient_accumulation_steps
        self.accum = accum
        self.steps_per_epoch = micro_batches_per_epoch // accum
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset gives {micro_batches_per_epoch} batches per worker per epoch, fewer "
                f"than gradient_accumulation_steps ({accum}): add data or lower "
                "batch_size_per_worker, gradient_accumulation_steps or num_workers"
            )
        epochs = spec.training.epochs or 1
        self.total_steps = spec.training.max_steps or epochs * self.steps_per_epoch

    def epoch_at(self, step: int) -> float:
        return round(step / self.steps_per_epoch, 4)

    def batches_from(self, loader: Any, step: int) -> Iterator[dict[str, Any]]:
        """Micro-batches from the position of `step` on, cycling epochs with a fresh shuffle."""
        epoch, done_in_epoch = divmod(step, self.steps_per_epoch)
        skip = done_in_epoch * self.accum
        while True:
            loader.sampler.set_epoch(epoch)
            # Only whole optimizer steps per epoch, so epochs line up with steps on resume.
            usable = self.steps_per_epoch * self.accum
            yield from itertools.islice(loader, skip, usable)
            skip = 0
            epoch += 1


class MetricSinks:
    """Rank 0 sends metrics to the service; every rank joins the reductions they need.

    A step's reduction runs in the background while the next step trains, and its metrics
    go out when the next step is logged (or at `flush`): a blocking all-reduce would make
    every rank wait for the slowest once more per step.
    """

    def __init__(self, spec: RunSpec, *, rank: int) -> None:
        import psutil

        from worker.service_client import MetricsSender, ServiceClient

        self.spec = spec
        # Made here because every rank builds its sinks at the same point (a collective).
        self.group = host_group()
        self._latest: dict[str, float] = {}
        self.client: ServiceClient | None = None
        self.sender: MetricsSender | None = None
        self._progress: dict[str, Any] = {}
        self._process = psutil.Process()
        # A logged step whose all-reduce is still in flight.
        self._pending: _PendingStep | None = None
        # Process CPU time at the previous logged step: CPU seconds per step count every
        # thread of this rank (training, communication, metric posting) and, unlike
        # wall-clock time, not the time others' processes hold the cores.
        self._cpu_mark: tuple[int, float] | None = None
        if rank == 0:
            self.client = ServiceClient(
                base_url=os.environ[CALLBACK_URL_ENV],
                token=os.environ[TOKEN_ENV],
                run_id=spec.run_id,
                attempt=spec.attempt,
            )
            self.sender = MetricsSender(self.client)

    @property
    def latest(self) -> dict[str, float]:
        """The metrics of the last logged step, complete."""
        self._complete_pending()
        return self._latest

    def log_step(
        self,
        engine: Any,
        *,
        step: int,
        epoch: float,
        elapsed: float,
        loss_sum: Any,
        tokens: int,
        samples: int,
        total_steps: int,
    ) -> None:
        import torch
        import torch.distributed as dist

        cpu_now = time.process_time()
        # What only this rank knows now; the reduced sums follow when the reduction lands.
        local = {
            "learning_rate": float(engine.get_lr()[0]),
            "step_time_seconds": elapsed,
            "epoch": epoch,
            "memory_rss_bytes": float(self._process.memory_info().rss),
        }
        if self._cpu_mark is not None and step > self._cpu_mark[0]:
            last_step, last_cpu = self._cpu_mark
            local["cpu_seconds_per_step"] = (cpu_now - last_cpu) / (step - last_step)
        self._cpu_mark = (step, cpu_now)
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is not None:
            local["grad_norm"] = float(grad_norm)
        if torch.cuda.is_available():
            local["gpu_memory_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
        # One all-reduce for all three, so the logged loss is the global mean, not rank 0's.
        totals = torch.stack(
            [
                loss_sum.to(torch.float64).cpu(),
                torch.tensor(float(tokens), dtype=torch.float64),
                torch.tensor(float(samples), dtype=torch.float64),
            ]
        )
        self._complete_pending()
        work, world = None, 1
        if dist.is_initialized():
            work = dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            world = dist.get_world_size()
        self._pending = _PendingStep(
            work=work,
            totals=totals,
            world=world,
            local=local,
            progress={"step": step, "total_steps": total_steps, "epoch": epoch},
        )

    def _complete_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.work is not None:
            pending.work.wait()
        totals = pending.totals
        accum = self.spec.training.gradient_accumulation_steps
        # The ranks of a tensor-parallel group train on the same batch: count it once.
        tp = self.spec.deepspeed.tensor_parallel_size
        elapsed = pending.local["step_time_seconds"]
        metrics = {
            "loss": float(totals[0]) / (accum * pending.world),
            "tokens_per_second": float(totals[1]) / tp / elapsed,
            "samples_per_second": float(totals[2]) / tp / elapsed,
            **pending.local,
        }
        self._latest = metrics
        self._progress = pending.progress
        if self.sender is not None:
            self.sender.log(metrics, step=pending.progress["step"], progress=self._progress)

    def log_eval(self, metrics: dict[str, float], *, step: int) -> None:
        self._complete_pending()
        self._latest = {**self._latest, **metrics}
        if self.sender is not None:
            self.sender.log(metrics, step=step, progress=self._progress or {"step": step})

    def event(self, type: str, message: str) -> None:
        """One try, no retries: these are informational and must not delay training."""
        if self.client is not None:
            self.client.post("/events", {"type": type, "message": message}, attempts=1)

    def flush(self) -> None:
        """Before a checkpoint: every step up to it is delivered, so a restart from that
        checkpoint (which re-trains and re-logs what came after) loses no step's metrics."""
        self._complete_pending()
        if self.sender is not None:
            self.sender.flush()

    def close(self) -> None:
        # A reduction still in flight here belongs to a failed run (a clean end flushes
        # first); waiting on it could hang on a peer that is gone, so it is dropped.
        self._pending = None
        if self.sender is not None:
            self.sender.close()
        if self.client is not None:
            self.client.close()


@dataclass(slots=True)
class _PendingStep:
    work: Any  # the all-reduce's handle, or None without a process group
    totals: Any  # loss, tokens, samples: summed over ranks once `work` completes
    world: int
    local: dict[str, float]
    progress: dict[str, Any]
