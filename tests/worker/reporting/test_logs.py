"""Worker log lines carry run, attempt and rank."""

from __future__ import annotations

import io
import logging

from worker.reporting.logs import LOGGER, configure_worker_logging


def test_lines_name_run_attempt_and_rank() -> None:
    logger = logging.getLogger(LOGGER)
    saved = logger.handlers[:], logger.propagate, logger.level
    logger.handlers[:] = []
    try:
        configure_worker_logging(run_id="run_abc", attempt=2, rank=1)
        configure_worker_logging(run_id="run_abc", attempt=2, rank=1)  # idempotent
        assert len(logger.handlers) == 1
        stream = io.StringIO()
        logger.handlers[0].setStream(stream)  # type: ignore[attr-defined]
        logging.getLogger("tuneyard.worker").info("step %d", 5)
        assert stream.getvalue().rstrip().endswith("run_id=run_abc attempt=2 rank=1: step 5")
    finally:
        logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]
