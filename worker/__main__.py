"""Ray job entry point: `python -m worker`. Trains one attempt of one run.

The spec, the callback URL and the per-run token arrive as environment variables set in
the job's runtime_env. Whatever happens, the service hears how the attempt ended.
"""

from __future__ import annotations

import logging
import sys
import time

from contract.callbacks import EventType, FailureCode, StartupPhase
from contract.run_request import RunSpec
from worker.reporting.failures import describe_failure, failure_code
from worker.reporting.logs import configure_worker_logging
from worker.reporting.nodes import alive_nodes, lost_nodes_note
from worker.reporting.placement import check_before_fit
from worker.reporting.service_client import ServiceClient
from worker.reporting.startup import StartupClock, process_started_at, submitted_at
from worker.training.preemption import preempted_in


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    spec = RunSpec.from_env()
    configure_worker_logging(run_id=spec.run_id, attempt=spec.attempt)
    log = logging.getLogger("tuneyard.worker")
    client = ServiceClient.from_env(run_id=spec.run_id, attempt=spec.attempt)
    nodes_at_start: dict[str, str] = {}
    # Each part of the attempt's start, as an event with its duration (the ranks post theirs).
    started, submitted = process_started_at(), submitted_at()
    startup = StartupClock(client.startup_phase, since=submitted or started)
    try:
        client.status("running")
        if submitted is not None:
            startup.lap(StartupPhase.JOB, at=started)
        # A run the cluster can never hold fails here, not after Ray Train's placement wait.
        check_before_fit(spec, post_event=client.event)
        from worker.training.trainer import build_trainer

        nodes_at_start = alive_nodes()
        fit_at = time.time()
        startup.lap(StartupPhase.DRIVER, at=fit_at)
        result = build_trainer(spec, fit_started_at=fit_at).fit()
        log.info("finished, checkpoint %s", result.checkpoint)
    except BaseException as exc:
        message, code = describe_failure(exc), failure_code(exc)
        # A failure that was not the training code's own, after a node died: whatever Ray
        # Train said after (a worker died, no room to restart), the cause is the node, and
        # a resume can go on once the cluster has room again. (An error the training code
        # raised stays its own: an autoscaler removing an idle node is no cause.)
        if code != FailureCode.TRAINING_ERROR and (lost := lost_nodes_note(nodes_at_start)):
            message, code = f"{lost}: {message}", FailureCode.CLUSTER_ERROR
        log.error("failed (%s): %s", code, message)
        client.status("failed", error=message, code=code)
        client.close()
        return 1
    if (preempted := preempted_in(result.metrics, attempt=spec.attempt)) is not None:
        # The attempt saved its checkpoint and stopped because the scheduler asked: not an
        # end of the run. The service requeues it on this event (a status would end it),
        # and the next attempt resumes from that checkpoint. Retried as a status is; if it
        # never arrives, the service requeues the run when it sees the job has ended.
        log.info("preempted: %s", preempted.message)
        client.event(EventType.PREEMPTED, preempted.message, attempts=8)
        client.close()
        return 0
    client.status("succeeded")
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
