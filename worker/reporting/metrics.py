"""The worker's metrics: one interface (`log_step`, `log_eval`, `event`, `flush`, `close`)
in front of the reductions every rank joins and the service and experiment trackers, which
rank 0 posts to."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from contract.callbacks import EventType, StartupPhase
from contract.run_request import RunSpec
from worker.reporting.host_group import host_group
from worker.reporting.service_client import MetricsSender, ServiceClient
from worker.reporting.tracking import Trackers

log = logging.getLogger("tuneyard.worker")


@dataclass(slots=True)
class StepResult:
    loss: Any  # this rank's part of the step's mean loss (a tensor: no sync here)
    tokens: int  # input tokens this rank trained on
    samples: int
    # Method dpo: this rank's sums of contract.eval_metrics.PAIR_METRICS over its pairs (a float64
    # tensor), and how many pairs; metrics.py averages them over the step's pairs.
    pair_sums: Any = None
    pairs: int = 0
    # Method grpo: its step's sums and the metrics they make (worker.training.grpo.StepSums).
    sums: Any = None


class MetricSinks:
    """Rank 0 sends metrics to the service; every rank joins the reductions they need.

    A step's reduction runs in the background while the next step trains, and its metrics
    go out when the next step is logged (or at `flush`): a blocking all-reduce would make
    every rank wait for the slowest once more per step.
    """

    def __init__(self, spec: RunSpec, *, rank: int) -> None:
        import psutil

        self.spec = spec
        # Made here because every rank builds its sinks at the same point (a collective).
        self.group = host_group()
        self._latest: dict[str, float] = {}
        self.client: ServiceClient | None = None
        self.sender: MetricsSender | None = None
        # The run's MLflow / W&B runs (worker/reporting/tracking.py): rank 0's, when the run asks.
        self.trackers: Trackers | None = None
        self._progress: dict[str, Any] = {}
        self._process = psutil.Process()
        # A logged step whose all-reduce is still in flight.
        self._pending: _PendingStep | None = None
        # Process CPU time at the previous logged step: CPU seconds per step count every
        # thread of this rank (training, communication, metric posting) and, unlike
        # wall-clock time, not the time others' processes hold the cores.
        self._cpu_mark: tuple[int, float] | None = None
        if rank == 0:
            self.client = ServiceClient.from_env(run_id=spec.run_id, attempt=spec.attempt)
            self.sender = MetricsSender(self.client)
            self.trackers = Trackers.for_rank(
                spec,
                rank=rank,
                on_failure=lambda message: self.event(EventType.TRACKING_FAILED, message),
            )

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
        result: StepResult,
        total_steps: int,
        tokens_since_log: int | None = None,
    ) -> None:
        """`tokens_since_log`: this rank's input tokens over the steps since the last
        logged one, this one included (default: this step's); summed over ranks, the
        `tokens` metric, whose sum over the logged steps is every token trained."""
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
        # One all-reduce for all: each rank holds its part of the step's mean loss
        # (worker/training/step_loss.py), so their sum is the step's loss over every rank. DPO adds
        # its pairs' metric sums and pair count (every rank of a run has them, or none does).
        parts = [
            result.loss.to(torch.float64).cpu().reshape(1),
            torch.tensor(
                [
                    float(result.tokens),
                    float(result.samples),
                    float(result.tokens if tokens_since_log is None else tokens_since_log),
                ],
                dtype=torch.float64,
            ),
        ]
        if result.pair_sums is not None:
            parts.append(result.pair_sums.to(torch.float64).cpu())
            parts.append(torch.tensor([float(result.pairs)], dtype=torch.float64))
        if result.sums is not None:
            # Method grpo's: its names are the same, in the same order, on every rank.
            parts.append(torch.tensor(list(result.sums.values.values()), dtype=torch.float64))
        totals = torch.cat(parts)
        self._complete_pending()
        work = None
        if dist.is_initialized():
            work = dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._pending = _PendingStep(
            work=work,
            totals=totals,
            local=local,
            progress={"step": step, "total_steps": total_steps, "epoch": epoch},
            sums=result.sums,
        )

    def _complete_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.work is not None:
            pending.work.wait()
        totals = pending.totals
        # The ranks of a tensor-parallel group train on the same batch: count it once.
        tp = self.spec.deepspeed.tensor_parallel_size
        elapsed = pending.local["step_time_seconds"]
        sums = pending.sums
        tail = totals[4 : len(totals) - len(sums.values)] if sums is not None else totals[4:]
        metrics = {
            "loss": float(totals[0]) / tp,
            "tokens_per_second": float(totals[1]) / tp / elapsed,
            "samples_per_second": float(totals[2]) / tp / elapsed,
            "tokens": float(totals[3]) / tp,
            **_pair_means(tail),
            **pending.local,
        }
        if sums is not None:
            reduced = totals[len(totals) - len(sums.values) :].tolist()
            metrics.update(sums.metrics(dict(zip(sums.values, reduced, strict=True))))
        self._latest = metrics
        self._progress = pending.progress
        self._post(metrics, step=pending.progress["step"], progress=self._progress)

    def log_eval(self, metrics: dict[str, float], *, step: int) -> None:
        self._complete_pending()
        self._latest = {**self._latest, **metrics}
        self._post(metrics, step=step, progress=self._progress or {"step": step})

    def _post(self, metrics: dict[str, float], *, step: int, progress: dict[str, Any]) -> None:
        """Where rank 0's metric points leave: to the service and to the trackers."""
        if self.sender is not None:
            self.sender.log(metrics, step=step, progress=progress)
        if self.trackers is not None:
            self.trackers.log(metrics, step=step)

    def exported(self, path: str, kind: str) -> None:
        """An exported model (rank 0, after the service has it): the trackers record where."""
        if self.trackers is not None:
            self.trackers.exported(path, kind)

    def event(self, type: EventType, message: str) -> None:
        """One try, no retries: these are informational and must not delay training."""
        if self.client is not None:
            self.client.event(type, message, attempts=1)

    def startup_phase(self, phase: StartupPhase, seconds: float) -> None:
        """Rank 0's: one try, as an event (worker/reporting/startup.py)."""
        if self.client is not None:
            self.client.startup_phase(phase, seconds)

    def record(self, type: EventType, message: str) -> None:
        """An event that is part of the run's history, which users read to see what happened
        (a restart from a checkpoint): retried with backoff as a status is. One try was
        lost whenever the service was slow for a moment, and a restart then went unseen.
        At most once per attempt, so the wait is rare and bounded."""
        if self.client is not None and not self.client.event(type, message):
            log.error("the %s event did not reach the service: %s", type, message)

    def flush(self) -> None:
        """Before a checkpoint: every step up to it is delivered, so a restart from that
        checkpoint (which re-trains and re-logs what came after) loses no step's metrics."""
        self._complete_pending()
        if self.sender is not None and not self.sender.flush():
            # Training goes on (the metrics are not the model), but not silently.
            log.error(
                "metrics up to step %s did not all reach the service (see above)",
                self._progress.get("step", "?"),
            )

    def close(self, *, failed: bool | None = None) -> None:
        """`failed`: how the run ended, for the trackers' runs (FAILED or FINISHED); unset,
        whether an exception is on its way out, as when called from a `finally`."""
        if failed is None:
            failed = sys.exc_info()[1] is not None
        # A reduction still in flight here belongs to a failed run (a clean end flushes
        # first); waiting on it could hang on a peer that is gone, so it is dropped.
        self._pending = None
        if self.trackers is not None:
            self.trackers.close(failed=failed)
        if self.sender is not None:
            self.sender.close()
        if self.client is not None:
            self.client.close()


def _pair_means(sums: Any) -> dict[str, float]:
    """DPO's pair metrics (contract.eval_metrics.PAIR_METRICS, then the pair count), the means over
    the step's pairs on every rank (tensor-parallel repeats cancel out of the ratio);
    nothing for other methods."""
    if len(sums) == 0:
        return {}
    from contract.eval_metrics import PAIR_METRICS

    pairs = max(float(sums[-1]), 1.0)
    return {name: float(value) / pairs for name, value in zip(PAIR_METRICS, sums[:-1], strict=True)}


@dataclass(slots=True)
class _PendingStep:
    work: Any  # the all-reduce's handle, or None without a process group
    totals: Any  # loss, tokens, samples: summed over ranks once `work` completes
    local: dict[str, float]
    progress: dict[str, Any]
    sums: Any = None  # method grpo's worker.training.grpo.StepSums, whose values end `totals`
