"""The worker's log lines name their run, attempt and rank: a Ray job's log is often read
far from the run it belongs to (the dashboard, a log shipper)."""

from __future__ import annotations

import dis
import logging
import sys

LOGGER = "tuneyard.worker"


class DropDisassembly(logging.Filter):
    """Drops what the standard library's `dis` prints, which reaches the log only through
    Ray Train's print patch.

    Ray Train replaces `print` in its workers with one that also logs each print as an
    INFO record of the root logger, even a print into a stream someone captured.
    `datasets` fingerprints every map and filter function with dill, and dill finds a
    function's globals by disassembling it into a captured stdout
    (`dill.detect.nestedglobals`): through the patch, every such fingerprint wrote pages of
    bytecode into the job's log.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.pathname != dis.__file__


def configure_worker_logging(*, run_id: str, attempt: int, rank: int | None = None) -> None:
    """Idempotent per process; of the root logger (and Ray's own loggers), only keeps
    disassembly out (`DropDisassembly`)."""
    root = logging.getLogger()
    if not any(isinstance(f, DropDisassembly) for f in root.filters):
        root.addFilter(DropDisassembly())
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
