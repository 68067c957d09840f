"""worker/training/deepspeed_import.py: DeepSpeed on a rank without MLflow, MLflow still there
for the runs that track to it, and without TorchInductor until a compiled function is called."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from worker.training.deepspeed_import import compile_on_first_call

PROBE = """
import sys
from worker.training.deepspeed_import import import_deepspeed
import_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
print("mlflow imported with deepspeed:", "mlflow" in sys.modules, autotuner.has_mlflow)
# What every ZeRO engine imports to ask whether the optimizer is Muon.
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
print("inductor imported with muon:", "torch._inductor.compile_fx" in sys.modules)
# torch.compile's own wrapper carries _torchdynamo_orig_callable; the deferred one not yet.
deferred = original_muon.zeropower_via_newtonschulz5
print("muon's function deferred:", not hasattr(deferred, "_torchdynamo_orig_callable"))
import mlflow
print("mlflow later:", mlflow.__name__)
"""


def test_deepspeed_comes_without_mlflow_or_inductor_and_mlflow_still_imports_after() -> None:
    # A fresh interpreter: this process may hold any of these modules already.
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert "mlflow imported with deepspeed: False False" in out, out
    assert "inductor imported with muon: False" in out, out
    assert "muon's function deferred: True" in out, out
    assert "mlflow later: mlflow" in out, out


def test_a_deferred_function_is_compiled_once_at_its_first_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    compiled: list[Any] = []

    def fake_compile(fn: Any) -> Any:
        compiled.append(fn)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    monkeypatch.setattr(torch, "compile", fake_compile)

    @compile_on_first_call()
    def double(x: int, *, times: int = 2) -> int:
        """Doubles."""
        return x * times

    assert compiled == []  # decorating compiles nothing
    assert double(3) == ("compiled", 6)
    assert double(4, times=3) == ("compiled", 12)
    assert len(compiled) == 1  # once, at the first call
    assert double.__name__ == "double" and double.__doc__ == "Doubles."
