"""A hold at a chosen step, so that a test can act on a run at a known point of its
training (stop a rank after a checkpoint and before the last step) on a fast machine and
on one whose cores are busy alike: a wall-clock wait cannot promise where training is.

Off unless the worker's environment names a folder in STEP_GATE_ENV (the end-to-end
tests' service sets it; Ray's workers inherit the head's environment). Then, after step
N, a rank of run R holds when `<folder>/<R>.hold` reads N and `<folder>/<R>.held` does not
exist yet: it writes `.held` and waits until `.hold` is removed (the test lets it go on) or
it is killed. Its peers wait for it at the next collective. A restarted worker group
passes, since `.held` exists.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

STEP_GATE_ENV = "TUNEYARD_STEP_GATE"
# Never forever: a test that forgot its run is not left holding a cluster.
HOLD_LIMIT_S = 600

log = logging.getLogger("tuneyard.worker")


def hold_if_asked(run_id: str, step: int) -> None:
    folder = os.environ.get(STEP_GATE_ENV)
    if not folder:
        return
    asked, held = Path(folder, f"{run_id}.hold"), Path(folder, f"{run_id}.held")
    try:
        if held.exists() or asked.read_text().strip() != str(step):
            return
    except OSError:
        return
    held.write_text(str(step))
    log.info("held at step %d by %s", step, asked)
    deadline = time.monotonic() + HOLD_LIMIT_S
    while asked.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
