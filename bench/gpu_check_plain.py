"""The GPU check's other side: the same model, data and DeepSpeed config as a tuneyard run,
trained by a plain DeepSpeed script in one process, with no service, Ray or tuneyard loop.

What it shares with the run on purpose, so that both sides train the same thing and only
the machinery around the step differs: the request it is given (validated by the same
contract); the run's data loader (worker.data.preparation.build_data: the packed examples,
the sampler with the run's seed, the collator), walked epoch by epoch as the run walks it;
the model's inputs (worker.data.loading.model_inputs: a packed block's examples attend only
to themselves, as in the run; with the attention mask left in, they would attend across
examples whose positions restart); the DeepSpeed config (contract.deepspeed_config); the
checkpoint's weights loaded in the dtype the run trains in; the optimizer, its parameter
groups and its schedule (worker.training.optimizer.build_optimizer). The loop is the
DeepSpeed tutorial's: `engine(**inputs)`, `engine.backward`, `engine.step`, timed from one
step's end to the next with the device synchronised. What it leaves out is tuneyard's: Ray
Train, the service, the step's loss shared across ranks and accumulation
(worker/training/step_loss.py), metrics, preemption votes.

    python -m bench.gpu_check_plain --request REQUEST.json --out RESULT.json --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
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


@dataclass
class Engine:
    """One rank's DeepSpeed engine and what feeds it, built as a run builds them."""

    spec: Any  # contract.run_request.RunSpec
    engine: Any
    loader: Any
    plan: Any  # contract.steps.StepPlan
    device: Any
    precision: str
    zero_stage: int
    one_row: bool  # worker.data.loading.packs_in_one_row_for the model
    keep_alive: Any = None  # ZeRO-3: transformers' HfDeepSpeedConfig, alive with the model

    @property
    def use_gpu(self) -> bool:
        return bool(self.spec.resources.use_gpu)

    def synchronize(self) -> None:
        if self.use_gpu:
            import torch

            torch.cuda.synchronize()

    def close(self) -> None:
        import torch.distributed as dist

        self.engine = self.keep_alive = None
        dist.destroy_process_group()


def setup(request: dict[str, Any], *, run_id: str = "gpu-check-plain") -> Engine:
    """A world of one, and the engine the request trains with (see the module's notes)."""
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed

    from contract.deepspeed_config import (
        hidden_size_of,
        resolve_deepspeed_config,
        resolve_precision,
        torch_dtype_name,
    )
    from contract.run_request import RunRequest, RunSpec
    from contract.steps import StepPlan
    from worker.data.loading import packs_in_one_row_for
    from worker.data.preparation import build_data
    from worker.training.optimizer import build_optimizer

    spec = RunSpec.for_attempt(
        RunRequest.model_validate(request).worker_fields(),
        run_id=run_id,
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
    loader = build_data(spec, tokenizer, rank=0).train
    plan = StepPlan.for_examples(spec, examples=len(loader.dataset))

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
    optimizer, scheduler = build_optimizer(spec, model, total_steps=plan.total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    return Engine(
        spec=spec,
        engine=engine,
        loader=loader,
        plan=plan,
        device=torch.device("cuda", 0) if use_gpu else torch.device("cpu"),
        precision=precision,
        zero_stage=int(ds_config["zero_optimization"]["stage"]),
        one_row=packs_in_one_row_for(engine.module),
        keep_alive=keep_alive,
    )


def train(request: dict[str, Any], *, steps: int) -> dict[str, Any]:
    import psutil
    import torch

    from worker.data.loading import model_inputs
    from worker.training.loop import batches_from

    built = setup(request)
    engine, loader, device, one_row = built.engine, built.loader, built.device, built.one_row
    synchronize = built.synchronize

    step_times: list[float] = []
    tokens: list[int] = []
    losses: list[float] = []
    process = psutil.Process()
    peak_rss = 0
    # The run's walk of its data: epochs reshuffled, each cut to whole steps.
    batches = batches_from(built.plan, loader, 0)
    accumulation = built.spec.training.gradient_accumulation_steps
    synchronize()
    last = time.perf_counter()
    while len(step_times) < steps:
        step_loss = 0.0
        step_tokens = 0
        for _ in range(accumulation):
            batch = next(batches)
            on_device = {k: v.to(device) for k, v in batch.items()}
            loss = engine(**model_inputs(on_device, one_row=one_row)).loss
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary
            step_loss += float(loss) / accumulation
            step_tokens += int(batch["input_ids"].numel())
        synchronize()
        now = time.perf_counter()
        step_times.append(now - last)
        last = now
        tokens.append(step_tokens)
        losses.append(step_loss)
        # As the worker's memory_rss_bytes metric: resident memory at each step's end.
        peak_rss = max(peak_rss, process.memory_info().rss)

    result: dict[str, Any] = {
        "step_times": step_times,
        "tokens": tokens,
        "losses": losses,
        "precision": built.precision,
        "zero_stage": built.zero_stage,
    }
    if built.use_gpu:
        result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
        result["memory_kind"] = "gpu_allocated"
        result["device_name"] = torch.cuda.get_device_name(0)
    else:
        result["peak_memory_bytes"] = peak_rss
        result["memory_kind"] = "rss"
        result["device_name"] = "cpu"
    built.close()
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
