"""worker/training/jit_ops.py: DeepSpeed's CPU ops built ahead by `make setup`, and an op
that cannot be built reported without failing the setup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker.training.jit_ops import OPS


def _prebuild(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter: DeepSpeed keeps the ops a process loaded, whatever the cache says.
    return subprocess.run(
        [sys.executable, "-m", "worker.training.jit_ops"],
        capture_output=True,
        text=True,
        timeout=600,
        # DS_ACCELERATOR unset, as `make setup` runs it: the module picks the CPU's.
        env={**{k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}, **env},
    )


def test_setup_leaves_the_cpu_ops_built_for_every_run() -> None:
    # The machine's own cache, as `make setup` left it: every op loads from there.
    done = _prebuild({})
    assert done.returncode == 0, done.stderr
    for name in OPS:
        assert f"DeepSpeed op {name}: built" in done.stderr, done.stderr


def test_an_op_that_cannot_be_built_is_named_and_setup_goes_on(tmp_path: Path) -> None:
    # An empty cache and no working compiler: each build fails as it would on a machine
    # without one.
    done = _prebuild({"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false"})
    assert done.returncode == 0, done.stderr
    for name in OPS:
        assert f"DeepSpeed op {name} not built (a run that needs it will say so)" in done.stderr
