"""DeepSpeed, imported on a rank without two imports it would otherwise make for features
tuneyard does not use.

- MLflow: `import deepspeed` imports its autotuner (deepspeed/runtime/config.py →
  deepspeed/autotuning), which tries `import mlflow` at module level to log autotuning
  experiments. tuneyard never autotunes, but MLflow is installed for the runs that track to
  it (worker/reporting/tracking.py), and importing it (with its GenAI and gateway modules,
  FastAPI among them) costs every rank about 1.4 CPU seconds of its start, twice a run on
  the default 2 workers.
- TorchInductor: every ZeRO engine imports DeepSpeed's Muon optimizer to ask whether the
  run's optimizer is one (deepspeed/runtime/zero/utils.py `is_zero_supported_optimizer`,
  stage3.py, stage_1_and_2.py, bf16_optimizer.py), and that module decorates three
  functions with `torch.compile` as it loads. `torch.compile` compiles only at a function's
  first call, but the decoration itself imports Inductor's compiler (torch/__init__.py
  `get_compiler_config`): about 0.9 CPU seconds of every rank's start, for functions only
  a Muon run calls.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any


def import_deepspeed() -> None:
    """Import DeepSpeed with MLflow hidden from it, unless either is imported already, and
    have its `torch.compile` decorations wait for their function's first call.

    A module set to None in `sys.modules` makes its import raise ImportError, which the
    autotuner takes as "no MLflow". The entry is removed at once, so the rank 0 of a run
    that asks for MLflow still imports the real one when its tracker starts."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
        try:
            import deepspeed  # noqa: F401
        finally:
            del sys.modules["mlflow"]
    from deepspeed.runtime import compiler

    compiler.compile = compile_on_first_call


def compile_on_first_call() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """What `deepspeed.runtime.compiler.compile()` gives (its robust `@torch.compile`),
    with `torch.compile` called when the function is first called rather than when it is
    decorated: the same compiled function, from the same first call, without Inductor's
    import in a process that never calls it. Only DeepSpeed's Muon module decorates with
    it (DeepSpeed 0.19.8)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        compiled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                import torch

                compiled = torch.compile(fn) if hasattr(torch, "compile") else fn
            return compiled(*args, **kwargs)

        return call

    return decorate
