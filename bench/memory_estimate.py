"""Benchmark 6, memory estimate: `POST /v1/runs/validate`'s per-worker estimate against
what a worker really holds, for ZeRO stages 0 to 3 on the tiny GPT-2.

For each stage the service validates the request (the estimate), then a probe trains the
same spec for a few steps as a Ray job on the service's Ray head, on tuneyard's own code
path (worker.model_setup and worker.deepspeed_config, the same `deepspeed.initialize`),
and measures on every rank, from just before the model is built:

- tensors held after the steps: every CPU tensor storage Python can reach (deduplicated),
  minus those that existed before. This is what a GPU allocator would count as allocated
  between steps (model states plus DeepSpeed's own buffers), whether touched or not.
- peak RSS growth: the kernel's high-water mark of resident memory (VmHWM, reset just
  before the model is built) minus the RSS then. This is what the run costs in RAM on CPU,
  activations and everything else included; buffers never written to cost nothing here.

    python -m bench.memory_estimate [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from bench.common import record
from bench.service import BenchService, running_service
from bench.training import bench_home, build_model, run_ray_job

BATCH_SIZE = 2
SEQ_LENGTH = 128
KIB = 1 << 10


# --- the probe: runs on every rank of a TorchTrainer --------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _held_tensor_bytes() -> dict[int, int]:
    """Every CPU tensor storage reachable from Python: {data pointer: bytes}."""
    import gc

    import torch

    gc.collect()
    held: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
            if storage.nbytes():
                held[storage.data_ptr()] = storage.nbytes()
        except Exception:  # objects that fail isinstance or are not real tensors
            continue
    return held


def probe_worker(config: dict[str, Any]) -> None:
    import deepspeed
    import ray.train
    import torch.distributed as dist

    from contract.run_request import RunSpec
    from worker.deepspeed_config import resolve_deepspeed_config
    from worker.model_setup import build_data, build_model, build_optimizer, load_tokenizer

    spec = RunSpec.model_validate(config["spec"])
    rank = ray.train.get_context().get_world_rank()
    tokenizer = load_tokenizer(spec)
    data = build_data(spec, tokenizer, rank=rank)
    batches = iter(data.train)

    before = _held_tensor_bytes()
    _reset_peak_rss()
    rss_before = _status_kib("VmRSS") * 1024

    model = build_model(spec, tokenizer, None)
    optimizer, scheduler = build_optimizer(spec, model, total_steps=config["steps"])
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=resolve_deepspeed_config(spec, bf16_supported=False),
    )
    rss_after_initialize = _status_kib("VmRSS") * 1024 - rss_before
    # Model states peak at the optimizer step: parameters, gradients and optimizer state all
    # exist then, activations are gone (DeepSpeed frees gradients after it). DeepSpeed's
    # reduction buckets live only during backward: per-parameter gradient hooks sample there.
    # Optimizer state exists from the second step on, so sampling starts there.
    peak: dict[int, int] = {}

    def sample(_grad: Any = None) -> None:
        nonlocal peak
        if sampling:
            held = {ptr: n for ptr, n in _held_tensor_bytes().items() if ptr not in before}
            if sum(held.values()) > sum(peak.values()):
                peak = held

    sampling = False
    hooks = [p.register_hook(sample) for p in engine.module.parameters() if p.requires_grad]
    for step in range(config["steps"]):
        sampling = step == 1
        batch = next(batches)
        loss = engine(**batch).loss
        engine.backward(loss)
        sampling = step >= 1
        sample()
        engine.step()
    for hook in hooks:
        hook.remove()
    at_step = peak
    peak_rss = _status_kib("VmHWM") * 1024 - rss_before
    # DeepSpeed's gradient-reduction buckets: reduce_bucket_size elements each.
    bucket = int(engine.zero_reduce_bucket_size())
    buckets = sum(size for size in at_step.values() if size in (2 * bucket, 4 * bucket))
    result = {
        "rank": rank,
        "held_at_step_bytes": sum(at_step.values()),
        "reduction_bucket_bytes": buckets,
        "largest_held_bytes": sorted(at_step.values(), reverse=True)[:3],
        "peak_rss_growth_bytes": peak_rss,
        "rss_growth_after_initialize_bytes": rss_after_initialize,
        "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "reduce_bucket_size": bucket,
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(gathered))
    ray.train.report({"steps": config["steps"]})


def run_probe(spec: dict[str, Any], *, out: str, steps: int) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init()
    try:
        TorchTrainer(
            probe_worker,
            train_loop_config={"spec": spec, "out": out, "steps": steps},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(
                num_workers=spec["resources"]["num_workers"], use_gpu=False
            ),
            run_config=RunConfig(storage_path=spec["storage_path"], name=spec["run_id"]),
        ).fit()
    finally:
        ray.shutdown()


# --- the benchmark: estimate over HTTP, measure with the probe ------------------------------


def request_body(model: Path, data: Path, stage: int) -> dict[str, Any]:
    return {
        "model": str(model),
        "dataset": {"source": str(data), "text_field": "text"},
        "training": {
            "max_steps": 5,
            "learning_rate": 3e-3,
            "batch_size_per_worker": BATCH_SIZE,
            "seq_length": SEQ_LENGTH,
        },
        "deepspeed": {"zero_stage": stage, "precision": "fp32"},
        "resources": {"num_workers": 2},
        "checkpointing": {"export_hf": False},
    }


def measure(
    service: BenchService, *, model: Path, data: Path, stage: int, steps: int
) -> dict[str, Any]:
    response = service.http.post("/v1/runs/validate", json=request_body(model, data, stage))
    response.raise_for_status()
    validated = response.json()
    if not validated["valid"]:
        raise RuntimeError(f"validate refused the request: {validated['errors']}")
    estimate = validated["estimate"]
    # The worker's spec as the dispatcher builds it: the request with defaults filled in.
    spec = _spec_from_request(request_body(model, data, stage))
    spec.update(
        {
            "run_id": f"memory-probe-zero{stage}",
            "attempt": 1,
            "storage_path": str(service.home / "probe-storage"),
        }
    )
    out = service.home / f"memory-zero{stage}.json"
    entrypoint = shlex.join(
        [
            "python",
            "-m",
            "bench.memory_estimate",
            "--probe",
            json.dumps(spec),
            f"--out={out}",
            f"--steps={steps}",
        ]
    )
    run_ray_job(service, entrypoint, name=f"memory-zero{stage}")
    ranks: list[dict[str, Any]] = json.loads(out.read_text())
    return {"estimate": estimate, "ranks": ranks}


def _spec_from_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request with the service's defaults filled in, as the worker receives it."""
    from contract.run_request import RunRequest

    return RunRequest.model_validate(body).worker_fields()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        run_probe(json.loads(args.probe), out=args.out, steps=args.steps)
        return

    results: dict[int, dict[str, Any]] = {}
    with bench_home("memory") as root:
        model = build_model(root / "assets")
        from app.tiny_assets import write_jsonl_dataset

        data = write_jsonl_dataset(root / "assets" / "news.jsonl", rows=256)
        with running_service(root / "home", allowed_roots=[root / "assets"]) as service:
            for stage in (0, 1, 2, 3):
                results[stage] = measure(
                    service, model=model, data=data, stage=stage, steps=args.steps
                )
                print(f"ZeRO-{stage}: {json.dumps(results[stage])}")
    report(results, steps=args.steps)


def report(results: dict[int, dict[str, Any]], *, steps: int) -> None:
    rows: list[dict[str, object]] = []
    for stage, result in results.items():
        estimate = result["estimate"]["model_states_bytes_per_worker"]["total"]
        worst = max(result["ranks"], key=lambda r: r["held_at_step_bytes"])
        held = worst["held_at_step_bytes"]
        buckets = worst["reduction_bucket_bytes"]
        peak = max(r["peak_rss_growth_bytes"] for r in result["ranks"])
        at_init = max(r["rss_growth_after_initialize_bytes"] for r in result["ranks"])
        rows.append(
            {
                "ZeRO stage": stage,
                "estimate (KiB)": estimate / KIB,
                "held at the step (KiB)": held / KIB,
                "of which reduction buckets (KiB)": buckets / KIB,
                "estimate / held": estimate / held,
                "estimate / held without buckets": estimate / max(held - buckets, 1),
                "RSS growth by initialize (KiB)": at_init / KIB,
                "peak RSS growth (KiB)": peak / KIB,
                "estimate / peak RSS growth": estimate / peak,
            }
        )
    first = next(iter(results.values()))
    parameters = first["estimate"]["parameters"]
    bucket = first["ranks"][0]["reduce_bucket_size"]
    record(
        "Memory estimate: validate's per-worker estimate vs measured",
        rows,
        notes=[
            f"Tiny GPT-2 ({parameters:,} parameters), fp32, 2 CPU workers, batch {BATCH_SIZE}, "
            f"seq_length {SEQ_LENGTH}, {steps} steps, run by the probe on tuneyard's own code "
            "path (worker.model_setup, worker.deepspeed_config); the worst rank. The estimate "
            "is `estimate.model_states_bytes_per_worker.total` from POST /v1/runs/validate "
            "(parameters, gradients and Adam state by the ZeRO paper's formulas; activations "
            "and buffers left out by design).",
            "Held at the step: every CPU tensor storage reachable from Python (deduplicated) "
            "after backward and before the optimizer step, when parameters, gradients and "
            "optimizer state all exist, minus those that existed before the model was built; "
            "the largest over the steps. This is what a GPU allocator would count as "
            "allocated then (activations are freed by then), whether written or not. torch "
            "keeps no allocator statistics for CPU tensors, so this stands in for "
            "torch.cuda.max_memory_allocated.",
            f"Reduction buckets: DeepSpeed's gradient-reduction buffers of reduce_bucket_size "
            f"({bucket:,}) elements, DeepSpeed's default since tuneyard does not set it. On a "
            "GPU they are real allocations; on CPU the pages never written are never resident.",
            "Peak RSS growth: VmHWM (reset just before the model is built) minus the RSS then: "
            "the RAM the run really took on CPU, activations, communication buffers, thread "
            "arenas and lazily loaded code included.",
        ],
    )


if __name__ == "__main__":
    main()
