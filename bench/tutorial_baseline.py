"""Fine-tuning the way the Ray Train + DeepSpeed tutorial does it, with no service around it.

The tutorial's shape: a `train_func` that every worker of a `TorchTrainer` runs; it
tokenizes with `padding="max_length"` (every sample padded to `seq_length`), builds a
`DataLoader` that `ray.train.torch.prepare_data_loader` shards with a DistributedSampler,
hands the model to `deepspeed.initialize` with a ZeRO config that names the optimizer,
and loops `engine(**batch)`, `engine.backward(loss)`, `engine.step()`. The only additions
are the timers: the wall-clock interval between consecutive step ends, the process CPU
time in the same interval, and the count of non-padding tokens in each step's batch.

`--client-optimizer` passes `torch.optim.AdamW` to `deepspeed.initialize` instead, with
tuneyard's two parameter groups (no weight decay on biases and norms), to tell what that
recipe difference costs from what the service costs.

Runs as a Ray job on an existing cluster (`RAY_ADDRESS`), on CPU with gloo:

    python -m bench.tutorial_baseline --model DIR --data FILE.jsonl --out result.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def deepspeed_config(*, batch_size: int, num_workers: int, zero_stage: int, lr: float) -> dict:
    """The tutorial's DeepSpeed config, with the values tuneyard resolves for a CPU run.

    The tutorial names the optimizer in the config; `torch_adam` makes DeepSpeed build
    `torch.optim.AdamW` (what tuneyard passes in) instead of JIT-building its fused Adam.
    """
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "train_batch_size": batch_size * num_workers,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": zero_stage, "overlap_comm": False},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
    }


def tutorial_dataset(tokenizer: Any, data: str, seq_length: int) -> Any:
    """The tutorial's preprocessing: every sample padded to seq_length, as torch tensors."""
    from datasets import load_dataset

    def tokenize(batch: dict[str, list[str]]) -> dict[str, Any]:
        encoded = tokenizer(
            batch["text"], padding="max_length", max_length=seq_length, truncation=True
        )
        # Labels are the inputs; padded positions carry no loss.
        encoded["labels"] = [
            [tok if keep else -100 for tok, keep in zip(ids, mask, strict=True)]
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
        ]
        return dict(encoded)

    dataset = load_dataset("json", data_files=data, split="train")
    dataset = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
    dataset.set_format("torch")
    return dataset


def tutorial_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tutorial_engine(config: dict[str, Any]) -> Any:
    """`deepspeed.initialize` on the model, with the optimizer named in the config (or, with
    `client_optimizer`, tuneyard's two parameter groups passed in)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config["model"])
    ds_config = deepspeed_config(
        batch_size=config["batch_size"],
        num_workers=config["num_workers"],
        zero_stage=config["zero_stage"],
        lr=config["lr"],
    )
    optimizer = None
    if config.get("client_optimizer"):
        import torch

        params = ds_config.pop("optimizer")["params"]
        # tuneyard's grouping: no weight decay on biases and norms.
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
        rest = [p for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": params["weight_decay"]}, {"params": rest}],
            lr=params["lr"],
            weight_decay=0.0,
        )
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, config=ds_config
    )
    return engine


def tutorial_step(engine: Any, batch: dict[str, Any]) -> Any:
    """The tutorial's training step."""
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    return loss


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from transformers import set_seed

    set_seed(config["seed"])
    tokenizer = tutorial_tokenizer(config["model"])
    dataset = tutorial_dataset(tokenizer, config["data"], config["seq_length"])
    loader = DataLoader(dataset, batch_size=config["batch_size"], shuffle=True, drop_last=True)
    loader = ray.train.torch.prepare_data_loader(loader)
    engine = tutorial_engine(config)

    step_times: list[float] = []
    cpu_times: list[float] = []
    tokens: list[int] = []
    loss = None
    epoch = 0
    last, last_cpu = time.perf_counter(), time.process_time()
    while len(step_times) < config["steps"]:
        if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            loss = tutorial_step(engine, batch)
            now, now_cpu = time.perf_counter(), time.process_time()
            step_times.append(now - last)
            cpu_times.append(now_cpu - last_cpu)
            last, last_cpu = now, now_cpu
            tokens.append(int(batch["attention_mask"].sum()))
            if len(step_times) == config["steps"]:
                break
        epoch += 1

    # Every rank's timings and token counts, so the result covers the whole step.
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"step_times": step_times, "tokens": tokens})
    if ray.train.get_context().get_world_rank() == 0:
        result = {
            # Rank 0's clock, as tuneyard's step times are: the ranks meet in every step's
            # gradient reduction, so their intervals agree.
            "step_times": step_times,
            # CPU seconds of rank 0's process per step: all its threads, and not the time
            # other processes hold the cores.
            "cpu_times": cpu_times,
            "tokens": [sum(t) for t in zip(*(g["tokens"] for g in gathered), strict=True)],
            "final_loss": float(loss) if loss is not None else None,
        }
        Path(config["out"]).write_text(json.dumps(result))
    ray.train.report({"steps": len(step_times)})


def run(
    *,
    model: str,
    data: str,
    out: str,
    storage: str,
    steps: int,
    batch_size: int,
    seq_length: int,
    zero_stage: int = 2,
    num_workers: int = 2,
    lr: float = 3e-3,
    seed: int = 42,
    client_optimizer: bool = False,
) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init()
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={
                "model": model,
                "data": data,
                "out": out,
                "steps": steps,
                "batch_size": batch_size,
                "seq_length": seq_length,
                "zero_stage": zero_stage,
                "num_workers": num_workers,
                "lr": lr,
                "seed": seed,
                "client_optimizer": client_optimizer,
            },
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False),
            run_config=RunConfig(storage_path=storage, name=Path(out).stem),
        )
        trainer.fit()
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a jsonl file with a `text` field")
    parser.add_argument("--out", required=True, help="where rank 0 writes the timings (json)")
    parser.add_argument("--storage", required=True, help="Ray Train's storage_path")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--client-optimizer", action="store_true")
    args = parser.parse_args()
    run(
        model=args.model,
        data=args.data,
        out=args.out,
        storage=args.storage,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_length=args.seq_length,
        zero_stage=args.zero_stage,
        num_workers=args.num_workers,
        client_optimizer=args.client_optimizer,
    )


if __name__ == "__main__":
    main()
