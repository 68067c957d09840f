"""The GPU check's other side: the same model, data and DeepSpeed config as a tuneyard run,
trained by a plain DeepSpeed script in one process, with no service, Ray or tuneyard loop.

What it shares with the run on purpose, so that only the training machinery differs:
the request it is given (validated by the same contract), the packed examples
(worker.data.preparation.prepare_examples), the DeepSpeed config (contract.deepspeed_config), the
checkpoint's weights loaded in the dtype the run trains in, AdamW with one parameter group
(the request sets weight_decay 0, which gives tuneyard one group too) and a
DistributedSampler with the run's seed (one replica), so both see the same batches in the
same order. The loop is the DeepSpeed tutorial's: `engine(**batch)`, `engine.backward`,
`engine.step`, timed from one step's end to the next with the device synchronised.

    python -m bench.gpu_check_plain --request REQUEST.json --out RESULT.json --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def _init_single_process_group(backend: str) -> None:
    """A world of one, started by torch itself rather than a launcher."""
    import torch.distributed as dist

    from app.ports import free_port

    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(name, value)
    dist.init_process_group(backend=backend, rank=0, world_size=1)


def train(request: dict[str, Any], *, steps: int) -> dict[str, Any]:
    import deepspeed
    import psutil
    import torch
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
    from transformers.data.data_collator import default_data_collator

    from contract.deepspeed_config import (
        hidden_size_of,
        resolve_deepspeed_config,
        resolve_precision,
        torch_dtype_name,
    )
    from contract.run_request import RunRequest, RunSpec
    from worker.data.preparation import prepare_examples

    spec = RunSpec.for_attempt(
        RunRequest.model_validate(request).worker_fields(),
        run_id="gpu-check-plain",
        attempt=1,
        storage_path=str(Path.cwd()),
    )
    use_gpu = spec.resources.use_gpu
    if use_gpu:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(max(1, int(spec.resources.cpus_per_worker)))
    _init_single_process_group("nccl" if use_gpu else "gloo")
    set_seed(spec.training.seed)

    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    examples, _ = prepare_examples(spec, tokenizer, split=None)
    tr = spec.training
    sampler: DistributedSampler[Any] = DistributedSampler(
        examples, num_replicas=1, rank=0, shuffle=True, seed=tr.seed, drop_last=True
    )
    loader = DataLoader(
        examples,
        batch_size=tr.batch_size_per_worker,
        sampler=sampler,
        collate_fn=default_data_collator,
        drop_last=True,
    )

    bf16_ok = bool(use_gpu and torch.cuda.is_bf16_supported(including_emulation=False))
    hidden = hidden_size_of(AutoConfig.from_pretrained(spec.model).to_dict())
    ds_config = resolve_deepspeed_config(spec, bf16_supported=bf16_ok, hidden_size=hidden)
    precision = resolve_precision(spec, bf16_supported=bf16_ok)
    keep_alive = None
    if ds_config["zero_optimization"]["stage"] == 3:
        # What DeepSpeed's Hugging Face guide asks of a script without Trainer: this object
        # alive while the model is created, so that it is created partitioned.
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(ds_config)
    model = AutoModelForCausalLM.from_pretrained(
        spec.model, dtype=getattr(torch, torch_dtype_name(precision))
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=tr.learning_rate, weight_decay=tr.weight_decay
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")

    def synchronize() -> None:
        if use_gpu:
            torch.cuda.synchronize()

    step_times: list[float] = []
    tokens: list[int] = []
    losses: list[float] = []
    process = psutil.Process()
    peak_rss = 0
    epoch = 0
    synchronize()
    last = time.perf_counter()
    while len(step_times) < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = engine(**{k: v.to(device) for k, v in batch.items()}).loss
            engine.backward(loss)
            engine.step()
            synchronize()
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
            tokens.append(int(batch["input_ids"].numel()))
            losses.append(float(loss))
            # As the worker's memory_rss_bytes metric: resident memory at each step's end.
            peak_rss = max(peak_rss, process.memory_info().rss)
            if len(step_times) == steps:
                break
        epoch += 1

    result: dict[str, Any] = {
        "step_times": step_times,
        "tokens": tokens,
        "losses": losses,
        "precision": precision,
        "zero_stage": ds_config["zero_optimization"]["stage"],
    }
    if use_gpu:
        result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
        result["memory_kind"] = "gpu_allocated"
        result["device_name"] = torch.cuda.get_device_name(0)
    else:
        result["peak_memory_bytes"] = peak_rss
        result["memory_kind"] = "rss"
        result["device_name"] = "cpu"
    del engine, keep_alive
    import torch.distributed as dist

    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="the run request, a JSON file")
    parser.add_argument("--out", required=True, help="where the result goes, as JSON")
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    request = json.loads(Path(args.request).read_text())
    result = train(request, steps=args.steps)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
