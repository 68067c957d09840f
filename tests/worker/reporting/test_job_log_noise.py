"""A training worker's log holds what a user reads, not the bytecode `datasets` hashes.

Ray Train patches `print` in its workers so that every print becomes an INFO record on
the root logger, which it sends to the job's log. `datasets` fingerprints each map and
filter function with dill, and dill finds a function's globals by disassembling it into
a captured stdout (`dill.detect.nestedglobals`): through the patch, that disassembly
became pages of `LOAD_FAST` lines in the job log.
"""

from __future__ import annotations

import builtins
import io
import logging
from collections.abc import Iterator

import pytest

from tests.worker.conftest import in_memory_dataset
from worker.data.loading import pack_sequences
from worker.reporting.logs import LOGGER, configure_worker_logging


@pytest.fixture
def ray_train_worker_logging() -> Iterator[io.StringIO]:
    """The logging a Ray Train worker runs the training loop under: Ray's own print
    patch, and a root logger at INFO writing to the job's console (here, a string)."""
    from ray.train.v2._internal.logging.patch_print import redirected_print

    root, ours = logging.getLogger(), logging.getLogger(LOGGER)
    saved_root = root.handlers[:], root.filters[:], root.level
    saved_ours = ours.handlers[:], ours.propagate, ours.level
    saved_print = builtins.print
    console = io.StringIO()
    root.handlers[:], root.filters[:] = [logging.StreamHandler(console)], []
    root.setLevel(logging.INFO)
    ours.handlers[:] = []
    builtins.print = redirected_print
    try:
        yield console
    finally:
        builtins.print = saved_print
        root.handlers[:], root.filters[:], root.level = saved_root
        ours.handlers[:], ours.propagate, ours.level = saved_ours


def test_packing_logs_no_disassembly(ray_train_worker_logging: io.StringIO) -> None:
    configure_worker_logging(run_id="run_abc", attempt=1, rank=0)
    rows = in_memory_dataset({"input_ids": [[5, 6, 7], [8, 9], [10, 11, 12, 13]]})

    # A map of a closure and a filter of a lambda over a generator: worker/data/loading.py's own.
    packed = pack_sequences(rows, seq_length=4, eos_token_id=0)
    print("a user's own print")

    assert len(packed) > 0
    log = ray_train_worker_logging.getvalue()
    assert "Disassembly of" not in log
    assert "LOAD_FAST" not in log
    # What the worker's code prints still reaches the job's log.
    assert "a user's own print" in log
