"""Preemption: the scheduler asks a running attempt to save a checkpoint now and stop, so
that a run of higher priority can have its resources; the run goes back to the queue and
resumes from that checkpoint as a new attempt.

Three parts, in three places:

- Rank 0, the process that talks to the service, reads GET .../control in a daemon thread
  (`ControlPoller`) every CONTROL_POLL_ENV seconds and raises a flag when the answer says
  preempt. The training step never waits for the service.
- At every optimizer-step boundary every rank takes the same decision from that flag
  (`Preemption.agreed`, one all-reduce of one number): a stop that rank 0 took alone would
  leave its peers waiting in the next step's collectives (as worker/training/eval_watch.py explains
  for early stopping).
- The training loop then saves the step's checkpoint as a periodic one is saved, with
  `marker` in its reported metrics, and returns without an export; the job's driver reads
  the marker in `fit()`'s result (`preempted_in`) and posts the `preempted` event instead
  of a status (worker/__main__.py).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any

from contract.job_env import CONTROL_POLL_ENV
from worker.reporting.service_client import ServiceClient

log = logging.getLogger("tuneyard.worker")

# When the dispatcher did not say (an older service), or said something that is no number.
DEFAULT_POLL_S = 5.0
# The names of the marker in the preemption checkpoint's reported metrics: Ray Train's
# result of `fit()` carries the latest checkpoint's metrics (rank 0's) back to the driver.
PREEMPTED_METRIC = "preempted"
REASON_METRIC = "preempted_reason"
# Which attempt stopped: a later attempt that saves no checkpoint of its own (it resumed
# where nothing was left to train) returns the same latest checkpoint, and must not read
# its predecessor's preemption as its own.
ATTEMPT_METRIC = "preempted_attempt"


def poll_interval_s() -> float:
    """Seconds between reads of /control: CONTROL_POLL_ENV, or DEFAULT_POLL_S when it is
    absent or not a positive finite number (a bad value must not stop the run, nor turn
    the poller into a busy loop against the service)."""
    raw = os.environ.get(CONTROL_POLL_ENV)
    try:
        value = float(raw) if raw is not None else DEFAULT_POLL_S
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        log.warning(
            "%s=%r is no positive number of seconds; using %s",
            CONTROL_POLL_ENV,
            raw,
            DEFAULT_POLL_S,
        )
        return DEFAULT_POLL_S
    return value


class ControlPoller:
    """Asks the service every `interval_s` whether the scheduler wants this attempt to
    stop, from a daemon thread, starting at once. Once asked, it stops asking: the request
    stands (the service requeues the run when the attempt ends) and the flag never falls."""

    def __init__(self, client: ServiceClient, *, interval_s: float) -> None:
        self._client = client
        self._interval = interval_s
        self._requested = threading.Event()
        self._closed = threading.Event()
        # Set before the flag is raised, so whoever sees the flag sees the reason.
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="tuneyard-control", daemon=True)
        self._thread.start()

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                answer = self._client.control()
            except Exception:  # control() does not raise; the thread must outlive a bug anyway
                log.exception("reading the scheduler's control answer failed")
                answer = None
            if answer is not None and answer.get("preempt") is True:
                reason = answer.get("reason")
                self.reason = reason if isinstance(reason, str) and reason else None
                self._requested.set()
                log.info(
                    "the scheduler asks this attempt to stop: %s", self.reason or "(no reason)"
                )
                return
            self._closed.wait(self._interval)

    def close(self) -> None:
        """Stop asking. Not joined: a read in flight ends within its own short timeout, and
        the thread is a daemon."""
        self._closed.set()


class Preemption:
    """Whether this attempt stops at this step for the scheduler: the same answer on every
    rank. Rank 0 (the rank with a service `client`) polls; the others only vote."""

    def __init__(self, *, attempt: int, client: ServiceClient | None, group: Any) -> None:
        self._attempt = attempt
        # The worker's gloo group (worker/reporting/host_group.py): the vote is a CPU tensor, which
        # nccl would not reduce; on a GPU rank, a device tensor read back with .item()
        # would also wait for the device every step, where this waits only for the peers'
        # hosts. And it does not queue behind DeepSpeed's reductions on the default group.
        self._group = group
        self._poller = (
            ControlPoller(client, interval_s=poll_interval_s()) if client is not None else None
        )

    @property
    def reason(self) -> str | None:
        """The scheduler's reason, on rank 0 (None on the other ranks)."""
        return self._poller.reason if self._poller is not None else None

    def agreed(self) -> bool:
        """Whether any rank's flag is up (only rank 0's can be). A collective: every rank
        calls it at the same step boundary, once per optimizer step."""
        import torch
        import torch.distributed as dist

        asked = self._poller is not None and self._poller.requested
        vote = torch.tensor([int(asked)], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._group)
        return bool(vote.item())

    def marker(self) -> dict[str, Any]:
        """What the preemption checkpoint's reported metrics add: the flag on every rank,
        the reason from rank 0 (Ray Train keeps rank 0's metrics)."""
        reason = self.reason
        return {
            PREEMPTED_METRIC: 1,
            ATTEMPT_METRIC: self._attempt,
            **({REASON_METRIC: reason} if reason else {}),
        }

    def close(self) -> None:
        if self._poller is not None:
            self._poller.close()


@dataclass(frozen=True, slots=True)
class Preempted:
    """How an attempt that stopped for the scheduler ended, as the driver reads it."""

    step: int
    reason: str | None = None

    @property
    def message(self) -> str:
        """The `preempted` event's message."""
        said = f": {self.reason}" if self.reason else ""
        return f"checkpoint at step {self.step}; stopped for the scheduler{said}"


def preempted_in(metrics: dict[str, Any] | None, *, attempt: int) -> Preempted | None:
    """`fit()`'s result metrics (its latest checkpoint's, rank 0's): whether `attempt`
    stopped for the scheduler, and at which step."""
    if not metrics or not metrics.get(PREEMPTED_METRIC):
        return None
    if metrics.get(ATTEMPT_METRIC) != attempt:
        return None
    reason = metrics.get(REASON_METRIC)
    return Preempted(step=int(metrics["step"]), reason=reason if isinstance(reason, str) else None)
