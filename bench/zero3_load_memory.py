"""ZeRO-3 load memory: each rank's peak resident memory while the model is created, before
(every rank builds the whole model, as tuneyard did) and after (the model is created
partitioned inside `deepspeed.zero.Init`, worker.model.loading.build_model), on a
~114M-parameter Llama, 2 workers.

Both sides run the same probe as a Ray job on the service's Ray head; only the loader
differs:

- before: `AutoModelForCausalLM.from_pretrained(model, dtype=float32)` with no
  `HfDeepSpeedConfig` alive, then `deepspeed.initialize` partitions the whole model (the
  old path, reproduced here only);
- after: `worker.model.loading.build_model(..., ds_config, precision="fp32")`, which keeps
  transformers' `HfDeepSpeedConfig` alive so `from_pretrained` builds each parameter
  partitioned, rank 0 alone reading the checkpoint;
- after-mmap: the same with glibc's mmap threshold fixed at 128 KiB just before loading,
  a diagnostic (not what runs do) that separates allocator retention from what the load
  itself holds.

Measured on every rank:

- peak: the high-water mark of resident memory (VmHWM, reset just before
  `from_pretrained`) when the model has been partitioned (DeepSpeed's
  `initialize_ds_offload` returns; on the old path that happens inside
  `deepspeed.initialize`), minus the RSS just before: what creating the model costs, the
  part of a run ZeRO-3 partitioned loading changes, and what the target is about. The
  optimizer buffers initialize allocates after that are the same on every side;
- anonymous: the same without file-backed pages (the mapped checkpoint's);
- process peak to the first step: ru_maxrss from the process's start through
  `deepspeed.initialize` and one training step, for context. After initialize a ZeRO-3
  rank holds its partitions of the parameters, gradients and Adam state, 2x the fp32 model
  size over 2 ranks by design, so this number cannot be under the model size on CPU,
  where device and host are the same memory.

    python -m bench.zero3_load_memory
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import record
from bench.memory_estimate import (
    BATCH_SIZE,
    MIB,
    SEQ_LENGTH,
    PhaseSampler,
    _peak_rss_since_start,
    _status,
    build_llama,
    probe,
    request_body,
    reset_peak_rss,
)
from bench.training import bench_home

TARGET_RATIO = 0.6
SIDES = ("before", "after", "after-mmap")
# glibc's M_MMAP_THRESHOLD (mallopt's -3): allocations from this size up get pages of their
# own, returned to the kernel when freed, instead of coming from a heap that keeps them.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024


def load_probe_worker(config: dict[str, Any]) -> None:
    """Load the model the `config["side"]` way, initialize DeepSpeed, take one step."""
    import ray.train
    import torch
    import torch.distributed as dist

    from contract.deepspeed_config import resolve_deepspeed_config
    from contract.run_request import RunSpec
    from worker.data.preparation import build_data
    from worker.model.loading import build_model, load_tokenizer
    from worker.training.loop import batches_from, model_hidden_size, place_rank, train_step
    from worker.training.optimizer import build_optimizer

    spec = RunSpec.model_validate(config["spec"])
    side = config["worker"]
    context = ray.train.get_context()
    rank = context.get_world_rank()
    place_rank(spec, local_world_size=context.get_local_world_size())
    import deepspeed

    ds_config = resolve_deepspeed_config(
        spec, bf16_supported=False, hidden_size=model_hidden_size(spec)
    )
    tokenizer = load_tokenizer(spec)
    data = build_data(spec, tokenizer, rank=rank)
    from contract.steps import StepPlan

    plan = StepPlan.for_examples(spec, examples=len(data.train.dataset))

    # The model is ready when DeepSpeed has partitioned it: inside deepspeed.initialize on
    # the old path, before it on the new one. Stage 3 partitions in initialize_ds_offload and
    # only then allocates its optimizer buffers (the same on both sides), so that is where
    # the window ends.
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    sampler = PhaseSampler()
    partitioned: dict[str, int] = {}
    offload = Stage3.initialize_ds_offload

    def initialize_ds_offload(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = offload(self, *args, **kwargs)
        partitioned.update(_status())
        sampler.enter("optimizer buffers")
        return result

    Stage3.initialize_ds_offload = initialize_ds_offload
    with sampler.running():
        dist.barrier()  # both ranks load at the same time, as a run's ranks do
        before_load = _status()
        reset_peak_rss()
        sampler.enter("load")
        keep: Any = None
        if side == "after-mmap":
            _map_large_allocations()
        if side == "before":
            from transformers import AutoModelForCausalLM

            module = AutoModelForCausalLM.from_pretrained(spec.model, dtype=torch.float32)
        else:
            loaded = build_model(spec, tokenizer, None, ds_config=ds_config, precision="fp32")
            module, keep = loaded.module, loaded.zero3_config
        sampler.enter("partition")
        optimizer, scheduler = build_optimizer(spec, module, total_steps=plan.total_steps)
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        sampler.enter("step 1")
        batches = batches_from(plan, data.train, 0)
        train_step(engine, batches, spec=spec, device=torch.device("cpu"), group=None)
        sampler.enter("end")
    Stage3.initialize_ds_offload = offload
    del keep
    creation = [sampler.peaks[p] for p in ("load", "partition")]
    result = {
        "rank": rank,
        "rss_before_load_bytes": before_load["VmRSS"],
        "creation_peak_bytes": partitioned["VmHWM"] - before_load["VmRSS"],
        "creation_peak_anon_bytes": max(p["anon"] for p in creation) - before_load["RssAnon"],
        "peak_to_first_step_bytes": _peak_rss_since_start(),
        "phase_peaks": sampler.peaks,
        "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(gathered))
    ray.train.report({"steps": 1})


def _map_large_allocations() -> None:
    """A diagnostic, not what runs do: glibc's dynamic mmap threshold rises to 32 MiB once a
    large block is freed, after which the full-size tensors zero.Init creates and frees for
    every parameter come from the heap, and the heap keeps their pages."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    from app.cli.tiny_assets import write_jsonl_dataset
    from bench.service import running_service

    results: dict[str, list[dict[str, Any]]] = {}
    with bench_home("zero3-load") as root:
        assets = root / "assets"
        model = build_llama(assets)
        data = write_jsonl_dataset(assets / "news.jsonl", rows=2000)
        with running_service(root / "home", allowed_roots=[assets]) as service:
            for side in SIDES:
                body = request_body(model, data, 3, steps=1)
                results[side] = probe(
                    service, body, name=f"zero3-load-{side}", worker=side, steps=1
                )
                print(json.dumps({side: results[side]}), flush=True)
    report(results)


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    parameters = results["after"][0]["parameters"]
    fp32_size = 4 * parameters
    rows: list[dict[str, object]] = []
    ratios = []
    for before, after, mapped in zip(*(results[side] for side in SIDES), strict=True):
        ratios.append(after["creation_peak_bytes"] / fp32_size)
        rows.append(
            {
                "rank": after["rank"],
                "before: peak (MiB)": before["creation_peak_bytes"] / MIB,
                "after: peak (MiB)": after["creation_peak_bytes"] / MIB,
                "fp32 model size (MiB)": fp32_size / MIB,
                "before / model size": before["creation_peak_bytes"] / fp32_size,
                "after / model size": after["creation_peak_bytes"] / fp32_size,
                "before, anonymous / model size": before["creation_peak_anon_bytes"] / fp32_size,
                "after, anonymous / model size": after["creation_peak_anon_bytes"] / fp32_size,
                "after, 128 KiB mmap threshold / model size": mapped["creation_peak_bytes"]
                / fp32_size,
                "after, 128 KiB mmap threshold, anonymous / model size": mapped[
                    "creation_peak_anon_bytes"
                ]
                / fp32_size,
                "process peak to first step, before / after (MiB)": (
                    f"{before['peak_to_first_step_bytes'] / MIB:,.0f} / "
                    f"{after['peak_to_first_step_bytes'] / MIB:,.0f}"
                ),
            }
        )
    met = all(r <= TARGET_RATIO for r in ratios)
    record(
        "ZeRO-3 load memory: each rank's peak while the model is created, before and after",
        rows,
        notes=[
            f"Llama of {parameters:,} parameters (fp32 size {fp32_size / MIB:,.0f} MiB, "
            f"stored fp32), ZeRO-3, fp32, 2 CPU workers (gloo), batch {BATCH_SIZE} x "
            f"{SEQ_LENGTH} packed tokens; every side runs as a Ray job on the service's Ray "
            "head.",
            "Before: from_pretrained(dtype=float32) with no HfDeepSpeedConfig alive, every "
            "rank building the whole model, then deepspeed.initialize partitions it (the old "
            "path, reproduced in the benchmark only). After: worker.model.loading.build_model, "
            "which creates the model inside deepspeed.zero.Init. 'After, 128 KiB mmap "
            "threshold': the same, with glibc told to give every allocation from 128 KiB up "
            "pages of its own (mallopt M_MMAP_THRESHOLD) just before loading; a diagnostic, "
            "not what runs do.",
            "Peak: the rank's resident memory (VmHWM, reset just before from_pretrained) at "
            "the moment the model is partitioned (DeepSpeed's initialize_ds_offload returns; "
            "its optimizer buffers come after and are the same on every side), minus the RSS "
            "just before from_pretrained. Anonymous: the same without file-backed pages (the "
            "mapped checkpoint's, which the kernel can drop and ranks on a node share), "
            "sampled every 5 ms. Process peak to first step: ru_maxrss from the process's "
            "start through one step, nothing subtracted; after initialize a rank holds its "
            "partitions of parameters, gradients and Adam state, the same on every side.",
            f"Target: each rank's peak <= {TARGET_RATIO}x the fp32 model size: "
            + ("met." if met else f"MISSED (after: {', '.join(f'{r:.2f}' for r in ratios)})."),
        ],
    )


if __name__ == "__main__":
    main()
