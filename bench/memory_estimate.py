"""Benchmark 6, memory estimate: `POST /v1/runs/validate`'s per-worker peak against each
rank's measured peak resident memory, for ZeRO stages 0 to 3 on a ~114M-parameter Llama.

For each stage the service validates the request (the estimate: its `memory_per_worker`
lines and their peak), then a probe trains the same spec for a few steps as a Ray job on
the service's Ray head, on tuneyard's own code path (`worker.training.loop.build_training`:
tokenizer, data, `worker.model.loading.build_model`, `deepspeed.initialize` with the
resolved config; then `worker.training.loop.train_step`), and records on every rank:

- peak RSS: the kernel's high-water mark of the rank process's resident memory
  (`getrusage(RUSAGE_SELF).ru_maxrss`) from the process's start through the last step.
  Nothing is subtracted: the estimate carries the process's fixed cost as its own measured
  line, `runtime`.
- where it peaked: a thread samples RSS (anonymous and file-backed) every 5 ms and keeps
  the largest per phase (tokenizer and data, model load, DeepSpeed initialize, each step's
  forward, backward and optimizer step), to show which lines drive the peak.

The `runtime` line (torch, DeepSpeed, transformers, datasets and Ray imported, the process
group, DeepSpeed's communication workspace, thread pools) is measured by `--calibrate`:
the same probe on the tests' 58k-parameter GPT-2, whose model lines come to about 7 MiB,
so its peak RSS less those is the fixed cost. The constant in app/services/estimates.py is
the largest measured, rounded up.

    python -m bench.memory_estimate [--steps 3] [--calibrate]

bench/zero3_load_memory.py reuses the probe to measure ZeRO-3's load-time peak.
"""

from __future__ import annotations

import argparse
import json
import shlex
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import record
from bench.service import BenchService, running_service
from bench.training import bench_home, run_ray_job

BATCH_SIZE = 2
SEQ_LENGTH = 256
MIB = 1 << 20
TARGET = (0.8, 1.25)

# ~114M parameters: hidden 768, 12 layers of 12 heads, gated MLP of 3072, the local
# tokenizer's 512-token vocabulary, untied embeddings.
LLAMA_SHAPE: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
}


def build_llama(root: Path) -> Path:
    """A ~114M-parameter Llama (fp32 safetensors) with the local tokenizer; reused if built."""
    folder = root / "llama-114m"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.cli.tiny_assets import build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer: Any = build_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **LLAMA_SHAPE,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)  # fp32, as initialised
    return folder


def build_tiny_gpt2(root: Path) -> Path:
    from app.cli.tiny_assets import build_tiny_gpt2 as build

    folder = root / "tiny-gpt2"
    return folder if (folder / "config.json").exists() else build(folder, n_positions=512)


# --- the probe: runs on every rank of a TorchTrainer --------------------------------------


def _status() -> dict[str, int]:
    """This process's resident memory now and its high-water mark, in bytes."""
    wanted = {"VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"}
    found: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in wanted:
            found[name] = int(value.split()[0]) * 1024
    return found


def reset_peak_rss() -> None:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0); ru_maxrss,
    the process's peak since it started, is left as it is."""
    Path("/proc/self/clear_refs").write_text("5")


class PhaseSampler:
    """Samples RSS every few ms in a thread; keeps the largest per named phase."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.phase = "start"
        self.step = 0
        self.peaks: dict[str, dict[str, int]] = {}
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = _status()
        peak = self.peaks.setdefault(self.phase, {"rss": 0, "anon": 0, "file": 0})
        peak["rss"] = max(peak["rss"], now["VmRSS"])
        peak["anon"] = max(peak["anon"], now["RssAnon"])
        peak["file"] = max(peak["file"], now["RssFile"] + now.get("RssShmem", 0))
        peak["last"] = now["VmRSS"]

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    @contextmanager
    def running(self) -> Iterator[PhaseSampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def enter(self, phase: str) -> None:
        self._sample()  # the end of the phase before
        self.phase = phase
        self._sample()


@contextmanager
def _phases_of_build(sampler: PhaseSampler) -> Iterator[None]:
    """Name the phases inside `build_training` (model load, DeepSpeed initialize) by
    wrapping the functions it calls; they behave exactly as before."""
    import deepspeed

    import worker.model.loading as model_loading

    build_model, initialize = model_loading.build_model, deepspeed.initialize

    def load(*args: Any, **kwargs: Any) -> Any:
        sampler.enter("load")
        return build_model(*args, **kwargs)

    def init(*args: Any, **kwargs: Any) -> Any:
        sampler.enter("initialize")
        return initialize(*args, **kwargs)

    model_loading.build_model, deepspeed.initialize = load, init
    try:
        yield
    finally:
        model_loading.build_model, deepspeed.initialize = build_model, initialize


def _label_step_phases(engine: Any, sampler: PhaseSampler) -> None:
    """Name forward, backward and optimizer step of each training step, per step."""
    for method, label in (("forward", "forward"), ("backward", "backward"), ("step", "optimizer")):
        original = getattr(engine, method)

        def wrapped(*args: Any, _original: Any = original, _label: str = label, **kw: Any) -> Any:
            sampler.enter(f"step {sampler.step} {_label}")
            return _original(*args, **kw)

        setattr(engine, method, wrapped)


def _peak_rss_since_start() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def probe_worker(config: dict[str, Any]) -> None:
    """Train `steps` steps as a run does and report this rank's memory."""
    import ray.train
    import torch.distributed as dist

    from contract.run_request import RunSpec
    from worker.training.loop import batches_from, build_training, place_rank, train_step

    spec = RunSpec.model_validate(config["spec"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    place_rank(spec, local_world_size=context.get_local_world_size())
    # What every run imports before it builds anything (worker.training.loop imports the
    # rest lazily, as a run does).
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import transformers  # noqa: F401

    sampler = PhaseSampler()
    with sampler.running(), _phases_of_build(sampler):
        sampler.enter("imports")
        imported = _status()
        sampler.enter("tokenizer and data")
        training = build_training(spec, rank=rank)
        engine = training.engine
        _label_step_phases(engine, sampler)
        batches = batches_from(training.plan, training.data.train, 0)
        for step in range(1, config["steps"] + 1):
            sampler.step = step
            train_step(engine, batches, spec=spec, device=training.device, group=None)
        sampler.enter("end")
    result = {
        "rank": rank,
        "peak_rss_bytes": _peak_rss_since_start(),
        "rss_after_imports_bytes": imported["VmRSS"],
        "phase_peaks": sampler.peaks,
        "parameters": sum(
            getattr(p, "ds_numel", p.numel()) for p in training.engine.module.parameters()
        ),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(gathered))
    ray.train.report({"steps": config["steps"]})


def run_probe(spec: dict[str, Any], *, worker: str, out: str, steps: int) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    import bench.zero3_load_memory as zero3

    # "estimate": this benchmark's probe; the others are bench/zero3_load_memory.py's sides.
    train_fn = probe_worker if worker == "estimate" else zero3.load_probe_worker
    ray.init()
    try:
        TorchTrainer(
            train_fn,
            train_loop_config={"spec": spec, "out": out, "steps": steps, "worker": worker},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(
                num_workers=spec["resources"]["num_workers"], use_gpu=False
            ),
            run_config=RunConfig(storage_path=spec["storage_path"], name=spec["run_id"]),
        ).fit()
    finally:
        ray.shutdown()


def probe(
    service: BenchService, body: dict[str, Any], *, name: str, worker: str, steps: int
) -> list[dict[str, Any]]:
    """Run the probe on `body` as a Ray job on the service's head; every rank's result."""
    spec = spec_from_request(body)
    spec.update(
        {"run_id": f"probe-{name}", "attempt": 1, "storage_path": str(service.home / "probe")}
    )
    out = service.home / f"probe-{name}.json"
    entrypoint = shlex.join(
        [
            "python",
            "-m",
            "bench.memory_estimate",
            "--probe",
            json.dumps(spec),
            f"--worker={worker}",
            f"--out={out}",
            f"--steps={steps}",
        ]
    )
    run_ray_job(service, entrypoint, name=name, timeout_s=900)
    ranks: list[dict[str, Any]] = json.loads(out.read_text())
    return sorted(ranks, key=lambda r: r["rank"])


def spec_from_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request with the service's defaults filled in, as the worker receives it."""
    from contract.run_request import RunRequest

    return RunRequest.model_validate(body).worker_fields()


# --- the benchmark: estimate over HTTP, measure with the probe ------------------------------


def request_body(
    model: Path, data: Path, stage: int, *, steps: int, checkpointing: bool = False
) -> dict[str, Any]:
    return {
        "model": str(model),
        "dataset": {"source": str(data), "text_field": "text"},
        "training": {
            "max_steps": steps,
            "learning_rate": 1e-4,
            "batch_size_per_worker": BATCH_SIZE,
            "seq_length": SEQ_LENGTH,
            # Full rows of seq_length tokens: the estimate's activations assume them.
            "packing": True,
            "gradient_checkpointing": checkpointing,
        },
        "deepspeed": {"zero_stage": stage, "precision": "fp32"},
        "resources": {"num_workers": 2},
        "checkpointing": {"export_hf": False},
    }


def validate(service: BenchService, body: dict[str, Any]) -> dict[str, Any]:
    response = service.http.post("/v1/runs/validate", json=body)
    response.raise_for_status()
    report: dict[str, Any] = response.json()
    if not report["valid"]:
        raise RuntimeError(f"validate refused the request: {report['errors']}")
    return report


def measure(
    service: BenchService,
    *,
    model: Path,
    data: Path,
    stage: int,
    steps: int,
    checkpointing: bool = False,
) -> dict[str, Any]:
    body = request_body(model, data, stage, steps=steps, checkpointing=checkpointing)
    report = validate(service, body)
    name = f"{model.name}-zero{stage}{'-gc' if checkpointing else ''}"
    ranks = probe(service, body, name=name, worker="estimate", steps=steps)
    return {
        "stage": stage,
        "checkpointing": checkpointing,
        "estimate": report["estimate"],
        "resolved": report["resolved"],
        "ranks": ranks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the runtime line on the tiny GPT-2 instead of the Llama",
    )
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--checkpointing-stage", type=int, default=2)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default="estimate", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        run_probe(json.loads(args.probe), worker=args.worker, out=args.out, steps=args.steps)
        return

    from app.cli.tiny_assets import write_jsonl_dataset

    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    results: list[dict[str, Any]] = []
    with bench_home("memory") as root:
        assets = root / "assets"
        model = build_tiny_gpt2(assets) if args.calibrate else build_llama(assets)
        data = write_jsonl_dataset(assets / "news.jsonl", rows=2000)
        with running_service(root / "home", allowed_roots=[assets]) as service:
            for stage in stages:
                results.append(
                    measure(service, model=model, data=data, stage=stage, steps=args.steps)
                )
                print(json.dumps(results[-1]), flush=True)
            if not args.calibrate and args.checkpointing_stage >= 0:
                results.append(
                    measure(
                        service,
                        model=model,
                        data=data,
                        stage=args.checkpointing_stage,
                        steps=args.steps,
                        checkpointing=True,
                    )
                )
                print(json.dumps(results[-1]), flush=True)
    if args.calibrate:
        report_calibration(results, steps=args.steps)
    else:
        report(results, steps=args.steps)


def _lines_mib(memory: dict[str, Any]) -> str:
    """The estimate's lines that are not zero, in MiB, device + host."""
    parts = []
    for name, line in memory["lines"].items():
        total = line["device"] + line["host"]
        if total:
            parts.append(f"{name} {total / MIB:,.0f}")
    return ", ".join(parts)


def _where(rank: dict[str, Any]) -> str:
    phases = rank["phase_peaks"]
    phase = max(phases, key=lambda p: phases[p]["rss"])
    return phase


def report(results: list[dict[str, Any]], *, steps: int) -> None:
    rows: list[dict[str, object]] = []
    verdicts = []
    for result in results:
        memory = result["estimate"]["memory_per_worker"]
        estimate = memory["peak"]["total"]
        label = f"{result['stage']}{' + checkpointing' if result['checkpointing'] else ''}"
        for rank in result["ranks"]:
            measured = rank["peak_rss_bytes"]
            ratio = estimate / measured
            verdicts.append(TARGET[0] <= ratio <= TARGET[1])
            rows.append(
                {
                    "ZeRO stage": label,
                    "rank": rank["rank"],
                    "estimate (MiB)": estimate / MIB,
                    "measured peak RSS (MiB)": measured / MIB,
                    "estimate / measured": ratio,
                    "peaked in": _where(rank),
                    "RSS after imports (MiB)": rank["rss_after_imports_bytes"] / MIB,
                }
            )
    first = results[0]
    parameters = first["estimate"]["parameters"]
    zero = {r["stage"]: r["resolved"]["deepspeed_config"]["zero_optimization"] for r in results}
    lines = "; ".join(
        f"ZeRO-{r['stage']}{' + checkpointing' if r['checkpointing'] else ''}: "
        f"{_lines_mib(r['estimate']['memory_per_worker'])}"
        for r in results
    )
    met = all(verdicts)
    record(
        "Memory estimate: validate's per-worker peak vs each rank's measured peak",
        rows,
        notes=[
            f"Llama of {parameters:,} parameters (hidden 768, 12 layers, 12 heads, gated MLP "
            f"3072, vocab 512, untied), fp32, 2 CPU workers (gloo), batch {BATCH_SIZE} x "
            f"{SEQ_LENGTH} packed tokens per worker, {steps} steps; run by the probe on "
            "tuneyard's own code path (worker.training.loop.build_training, train_step) as a Ray "
            "job on the service's Ray head.",
            "Estimate: `estimate.memory_per_worker.peak.total` from POST /v1/runs/validate for "
            "the same request. Measured: each rank's ru_maxrss (peak resident memory of the "
            "Ray Train worker process from its start through the last step), nothing "
            "subtracted. 'peaked in': the phase where a sampling thread saw the largest RSS.",
            f"The estimate's lines (MiB, per worker): {lines}.",
            "ZeRO buckets as resolved from the model's hidden size: "
            + "; ".join(
                f"ZeRO-{s}: "
                + ", ".join(f"{k} {v:,}" for k, v in z.items() if "bucket" in k or "thresh" in k)
                for s, z in zero.items()
                if s
            )
            + ".",
            f"Target: every ratio within {TARGET[0]}-{TARGET[1]}: "
            + ("met." if met else "MISSED."),
        ],
    )


def report_calibration(results: list[dict[str, Any]], *, steps: int) -> None:
    rows: list[dict[str, object]] = []
    for result in results:
        memory = result["estimate"]["memory_per_worker"]
        model_lines = sum(
            line["device"] + line["host"]
            for name, line in memory["lines"].items()
            if name not in ("runtime", "load_time_peak")
        )
        for rank in result["ranks"]:
            rows.append(
                {
                    "ZeRO stage": result["stage"],
                    "rank": rank["rank"],
                    "measured peak RSS (MiB)": rank["peak_rss_bytes"] / MIB,
                    "RSS after imports (MiB)": rank["rss_after_imports_bytes"] / MIB,
                    "model lines of the estimate (MiB)": model_lines / MIB,
                    "runtime = peak - model lines (MiB)": (rank["peak_rss_bytes"] - model_lines)
                    / MIB,
                }
            )
    record(
        "Memory estimate: the runtime line, measured on the tiny GPT-2",
        rows,
        notes=[
            f"The tests' GPT-2 ({results[0]['estimate']['parameters']:,} parameters), fp32, 2 "
            f"CPU workers, batch {BATCH_SIZE} x {SEQ_LENGTH} packed tokens, {steps} steps, the "
            "same probe as the Llama's. Its model lines come to about 7 MiB (the activations "
            "and logits of 512 tokens), so a rank's peak RSS less those is the fixed cost of "
            "a worker process: Ray's worker, torch, DeepSpeed, transformers and datasets "
            "loaded, the gloo process group, DeepSpeed's communication workspace and thread "
            "pools, the data loader. app/services/estimates.py's RUNTIME_HOST_BYTES is the "
            "largest, rounded up.",
        ],
    )


if __name__ == "__main__":
    main()
