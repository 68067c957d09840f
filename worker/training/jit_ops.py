"""DeepSpeed's JIT ops, built ahead of the first run that loads them (`make setup` runs this).

DeepSpeed compiles an op the first time a process loads it, into torch's extensions cache
(`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions), and every later load on the
machine reuses the build. Two are loaded by runs: CPU Adam, by any run whose optimizer is
offloaded (`deepspeed.offload_optimizer`; DeepSpeed builds the same CPU op for GPU runs), and
the shared-memory collectives, by every CPU run (`deepspeed.init_distributed` on DeepSpeed's
CPU accelerator, which tuneyard gives every CPU run, app/cluster/runtime_env.py). Building them
here takes about 40 s on 2 cores once, instead of inside a user's first run (its start-up
phases show it) or the test suite's first test that offloads.

`python -m worker.training.jit_ops` builds both on the CPU accelerator (or the one
`DS_ACCELERATOR` names). An op that cannot be built (no compiler) is reported and left: a run
that needs it fails then with DeepSpeed's own error, and one that does not never knew.
"""

from __future__ import annotations

import logging
import os
import sys

from contract.job_env import path_with_this_environment
from worker.training.deepspeed_import import import_deepspeed
from worker.training.jit_lock import clear_stale_jit_locks

log = logging.getLogger("tuneyard.worker")

# DeepSpeed's builder names (deepspeed/ops/op_builder/<accelerator>/): the accelerator says
# which it has, and gives none for an op it does not have.
OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def prebuild() -> dict[str, str | None]:
    """Each op this accelerator has, built (or found built): its name and the error that
    stopped its build (None when built)."""
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    clear_stale_jit_locks()
    accelerator = get_accelerator()
    outcome: dict[str, str | None] = {}
    for name in OPS:
        builder = accelerator.create_op_builder(name)
        if builder is None:
            continue
        try:
            builder.load(verbose=False)
        except Exception as exc:  # a compiler error, a missing toolkit: reported, not fatal
            outcome[name] = f"{type(exc).__name__}: {exc}"
        else:
            outcome[name] = None
    return outcome


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Built with the `ninja` the runs use (the embedded head gives its jobs the same PATH).
    os.environ["PATH"] = path_with_this_environment(os.environ.get("PATH"))
    # The accelerator CPU runs load their ops on, even on a GPU machine (whose own, CUDA,
    # has no shared-memory collectives and builds the same CPU Adam).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name, error in prebuild().items():
        if error is None:
            log.info("DeepSpeed op %s: built", name)
        else:
            log.warning(
                "DeepSpeed op %s not built (a run that needs it will say so): %s", name, error
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
