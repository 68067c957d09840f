"""The worker's log lines name their run, attempt and rank: a Ray job's log is often read
far from the run it belongs to (the dashboard, a log shipper)."""

from __future__ import annotations

import logging
import sys

LOGGER = "tuneyard.worker"


def configure_worker_logging(*, run_id: str, attempt: int, rank: int | None = None) -> None:
    """Idempotent per process; leaves the root logger (and Ray's own loggers) alone."""
    logger = logging.getLogger(LOGGER)
    if any(getattr(h, "tuneyard", False) for h in logger.handlers):
        return
    where = f" rank={rank}" if rank is not None else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s %(name)s run_id={run_id} attempt={attempt}{where}: "
            "%(message)s"
        )
    )
    handler.tuneyard = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
