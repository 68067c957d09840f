"""worker/model/loading.py's build_model: the dtype a run trains in, and ZeRO-3's partitioned load.

The partitioned load runs in two real processes with a gloo group, as two Ray Train ranks
would, so that what each rank holds after `from_pretrained` can be measured.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.deepspeed_config import resolve_deepspeed_config, resolve_precision
from contract.run_request import RunSpec
from tests.worker.one_rank import spawn_ranks
from worker.model.loading import build_model


@pytest.fixture(scope="module")
def bf16_llama(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved in bf16, as Qwen2.5 and Llama 3 ship."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("bf16-llama")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    return folder


def spec_for(model: Path, **deepspeed: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "run_id": "run_load",
            "attempt": 1,
            "storage_path": "/unused",
            "model": str(model),
            "dataset": {"source": "/unused.jsonl"},
            "deepspeed": deepspeed,
        }
    )


def load(spec: RunSpec) -> Any:
    precision = resolve_precision(spec, bf16_supported=False)
    config = resolve_deepspeed_config(spec, bf16_supported=False, hidden_size=64)
    return build_model(spec, None, None, ds_config=config, precision=precision)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("fp32", torch.float32), ("auto", torch.float32), ("bf16", torch.bfloat16)],
)
def test_weights_load_in_the_precision_the_run_trains_in(
    bf16_llama: Path, precision: str, dtype: torch.dtype
) -> None:
    # transformers 5 would load this bf16 checkpoint in bf16 whatever the run asked for.
    loaded = load(spec_for(bf16_llama, zero_stage=2, precision=precision))
    assert {p.dtype for p in loaded.module.parameters()} == {dtype}
    assert loaded.zero3_config is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load_partitioned(rank: int, model: str, port: int, out: str) -> None:
    """One rank: load under ZeRO-3 and record what it holds, then the gathered weights."""
    import deepspeed
    import torch.distributed as dist

    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=2)
    loaded = load(spec_for(Path(model), zero_stage=3, precision="fp32"))
    params = dict(loaded.module.named_parameters())
    report: dict[str, Any] = {
        "all_partitioned": all(hasattr(p, "ds_id") for p in params.values()),
        "held_in_module": sum(p.numel() for p in params.values()),
        "held_in_partitions": sum(p.ds_tensor.numel() for p in params.values()),
        "full_size": sum(p.ds_numel for p in params.values()),
        "dtypes": sorted({str(p.ds_tensor.dtype) for p in params.values()}),
    }
    # The partitions hold the checkpoint's weights: gather one matrix and compare.
    weight = params["model.layers.0.mlp.up_proj.weight"]
    with deepspeed.zero.GatheredParameters([weight]):
        report["up_proj_sum"] = float(weight.detach().double().sum())
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    # DeepSpeed's shared-memory comm op aborts the interpreter's normal exit.
    os._exit(0)


def test_zero3_creates_the_model_partitioned_across_ranks(
    bf16_llama: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    spawn_ranks(_load_partitioned, args=(str(bf16_llama), _free_port(), str(tmp_path)), nprocs=2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.float32)
    full = sum(p.numel() for p in expected.parameters())
    up_proj_sum = float(expected.model.layers[0].mlp.up_proj.weight.detach().double().sum())
    for report in reports:
        assert report["all_partitioned"]
        # Nothing whole in the module: each rank keeps only its partition, about half.
        assert report["held_in_module"] == 0
        assert report["full_size"] == full
        assert report["held_in_partitions"] <= full // 2 + 64 * len(list(expected.parameters()))
        assert report["dtypes"] == ["torch.float32"]
        assert report["up_proj_sum"] == pytest.approx(up_proj_sum, rel=1e-6)
