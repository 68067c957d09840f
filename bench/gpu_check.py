"""GPU check: ~0.5B Llama through tuneyard and a plain DeepSpeed script, bf16, ZeRO-2 and 3.

A ~0.5B Llama, built locally, trained through the real service on one GPU with bf16 under
ZeRO-2 and ZeRO-3, next to a plain DeepSpeed script on the same GPU, data and DeepSpeed
config (bench/gpu_check_plain.py): tokens/s, MFU and peak GPU memory of each.

    python -m bench.gpu_check             # one CUDA GPU; appends its table to BENCHMARKS.md
    python -m bench.gpu_check --dry-run   # CPU: a tiny Llama, fp32, 3 steps, the same code
                                          # paths; MFU n/a, nothing appended

MFU (model FLOPs utilisation) = model FLOPs per token x tokens/s / the GPU's peak dense bf16
FLOP/s. FLOPs per token are the PaLM paper's (Chowdhery et al. 2022, appendix B):
6 N + 12 L H Q T, with N the parameters (all counted; the embeddings of the local
tokenizer's 512 tokens are 0.3% of them here), L the layers, H x Q (heads x head size) the
hidden size and T the sequence length: 6 N for the weight matrix products of the forward
and backward passes, the second term for attention's scores and weighted sums.
Recomputation is not counted (these runs do not checkpoint activations).

Not part of `make bench`, which runs on CPU machines: `make gpu-check` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# Its table is recorded through the module (common.record), never the bare name: bench.run_all
# counts a module that calls the bare name among `make bench`'s CPU benchmarks, and this one
# needs a GPU.
from bench import common
from bench.common import REPO_ROOT
from bench.service import running_service
from bench.training import bench_home, metric_rows, step_intervals

ZERO_STAGES = (2, 3)
TUNEYARD = "tuneyard"
PLAIN = "plain DeepSpeed"
GIB = 1 << 30


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


# About 0.48B parameters: 24 layers of 19.8M (attention 4 x 1280², SwiGLU MLP 3 x 1280 x 3456)
# and two embedding matrices of the local tokenizer's 512 tokens, so the layers' matrix
# products are nearly all the FLOPs. Head size 128, as in Llama's own models.
GPU_MODEL = LlamaShape(hidden_size=1280, num_layers=24, num_heads=10, intermediate_size=3456)


@dataclass(frozen=True)
class CheckSettings:
    dry_run: bool
    steps: int
    warmup_steps: int
    batch_size: int
    seq_length: int
    learning_rate: float = 3e-4

    @classmethod
    def defaults(cls, *, dry_run: bool) -> CheckSettings:
        if dry_run:
            return cls(dry_run=True, steps=3, warmup_steps=1, batch_size=2, seq_length=64)
        # 8 x 1024 tokens a step: about 21 GB at the peak by estimate (model states 16 bytes
        # a parameter, activations about 1.5 MB a token); lower --batch-size on a 24 GB GPU.
        return cls(dry_run=False, steps=50, warmup_steps=10, batch_size=8, seq_length=1024)

    @property
    def use_gpu(self) -> bool:
        return not self.dry_run

    @property
    def precision(self) -> str:
        return "fp32" if self.dry_run else "bf16"

    def dataset_rows(self) -> int:
        """Enough short news lines (about ten tokens each) for one epoch of packed blocks."""
        return max(512, self.steps * self.batch_size * self.seq_length // 8)


# --- the arithmetic ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    parameters: int
    num_layers: int
    hidden_size: int


def flops_per_token(facts: ModelFacts, *, seq_length: int) -> float:
    """Training FLOPs per token, forward and backward: PaLM's 6 N + 12 L H Q T."""
    return 6.0 * facts.parameters + 12.0 * facts.num_layers * facts.hidden_size * seq_length


# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, in FLOP/s. The first
# name found in torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("B200", 2250e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H800 PCIe", 756e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 125e12),  # the A10's datasheet value
    ("A10", 125e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    name = device_name.lower()
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in name:
            return flops
    return None


def mfu(
    *, flops_per_token: float, tokens_per_second: float, peak_flops: float | None
) -> float | None:
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_second / peak_flops


# --- what one side measured ------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    side: str
    zero_stage: int
    precision: str
    step_times: list[float]  # seconds from one step's end to the next, one a step
    tokens: list[float]  # tokens trained in each step
    losses: list[float]
    peak_memory_bytes: float | None
    memory_kind: str  # "gpu_allocated": torch.cuda.max_memory_allocated; "rss": on CPU
    notes: list[str] = field(default_factory=list)

    def tokens_per_second(self, *, warmup_steps: int) -> float:
        times, tokens = self.step_times[warmup_steps:], self.tokens[warmup_steps:]
        if not times:
            raise ValueError(f"{self.side}: no step left after {warmup_steps} warm-up steps")
        return sum(tokens) / sum(times)


# How far apart the two sides' losses may be for their speeds to be compared. The same
# examples through the same weights and optimizer give the same losses up to rounding: in
# fp32 (the dry run on CPU) to about 1e-6, so 1e-4 at every step leaves room and still
# catches one example out of place; in bf16 a matrix product rounds to 8 bits of mantissa
# (0.4%) and the two sides' kernels may sum in other orders, so the first step may differ
# by a fraction of a percent and the curve, as each step's update carries the last one's
# rounding, by a few.
FP32_LOSS_GAP = 1e-4  # absolute, at every step
HALF_FIRST_STEP_GAP = 0.01  # relative, bf16 and fp16
HALF_CURVE_GAP = 0.05  # relative, every later step


def loss_mismatch(ours: list[float], plain: list[float], *, precision: str) -> str | None:
    """Why two loss curves do not show the same training, or None when they do."""
    if len(ours) != len(plain):
        return f"{len(ours)} steps against the plain script's {len(plain)}"
    for step, (a, b) in enumerate(zip(ours, plain, strict=True), start=1):
        if precision == "fp32":
            allowed, rule = FP32_LOSS_GAP, f"{FP32_LOSS_GAP:g} (fp32)"
        else:
            share = HALF_FIRST_STEP_GAP if step == 1 else HALF_CURVE_GAP
            allowed, rule = share * abs(b), f"{share:.0%} ({precision}, step {step})"
        if not abs(a - b) <= allowed:  # a NaN on either side fails too
            return (
                f"step {step}: loss {a:.6g} against the plain script's {b:.6g}, "
                f"apart by more than {rule}"
            )
    return None


def largest_loss_gap(ours: list[float], plain: list[float]) -> float | None:
    gaps = [abs(a - b) for a, b in zip(ours, plain, strict=False)]
    return max(gaps) if gaps else None


def mismatches(measurements: list[Measurement]) -> dict[int, str]:
    """Per ZeRO stage, why tuneyard's run and the plain script's did not train alike."""
    by_side = {(m.side, m.zero_stage): m for m in measurements}
    found = {}
    for (side, stage), ours in by_side.items():
        plain = by_side.get((PLAIN, stage))
        if side != TUNEYARD or plain is None:
            continue
        reason = loss_mismatch(ours.losses, plain.losses, precision=ours.precision)
        if reason:
            found[stage] = reason
    return found


def memory_column(measurements: list[Measurement]) -> str:
    kinds = {m.memory_kind for m in measurements}
    return "peak GPU memory (GiB)" if kinds == {"gpu_allocated"} else "peak RSS (GiB)"


def table_rows(
    measurements: list[Measurement],
    *,
    warmup_steps: int,
    flops_per_token: float,
    peak_flops: float | None,
) -> list[dict[str, object]]:
    """One row a side and ZeRO stage, ZeRO-2 first, tuneyard above the plain script. A
    speed ratio is given only where both sides trained alike (`loss_mismatch`): otherwise
    they did different work, and which is faster says nothing."""
    column = memory_column(measurements)
    plain = {m.zero_stage: m for m in measurements if m.side == PLAIN}
    plain_speed = {
        stage: m.tokens_per_second(warmup_steps=warmup_steps) for stage, m in plain.items()
    }
    unlike = mismatches(measurements)
    ordered = sorted(measurements, key=lambda m: (m.zero_stage, m.side != TUNEYARD))
    rows: list[dict[str, object]] = []
    for m in ordered:
        speed = m.tokens_per_second(warmup_steps=warmup_steps)
        util = mfu(flops_per_token=flops_per_token, tokens_per_second=speed, peak_flops=peak_flops)
        baseline = plain_speed.get(m.zero_stage)
        ratio: object = "n/a" if not baseline else speed / baseline
        if m.zero_stage in unlike:
            ratio = "withheld: trained unlike"
        gap = (
            largest_loss_gap(m.losses, plain[m.zero_stage].losses)
            if m.side == TUNEYARD and m.zero_stage in plain
            else None
        )
        rows.append(
            {
                "side": m.side,
                "ZeRO": m.zero_stage,
                "precision": m.precision,
                "steps timed": len(m.step_times[warmup_steps:]),
                "tokens/s": speed,
                "MFU": "n/a" if util is None else f"{util:.1%}",
                column: "n/a"
                if m.peak_memory_bytes is None
                else f"{m.peak_memory_bytes / GIB:.2f}",
                "tokens/s vs plain": ratio,
                "loss, last step": m.losses[-1] if m.losses else "n/a",
                "loss gap to plain, largest": "n/a" if gap is None else f"{gap:.2e}",
            }
        )
    return rows


# --- the model, the data, the request -------------------------------------------------------


def llama_config(
    shape: LlamaShape,
    *,
    vocab_size: int,
    max_positions: int,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def build_llama(folder: Path, shape: LlamaShape, *, max_positions: int) -> Path:
    """A random Llama of `shape` with the project's locally trained tokenizer, saved in bf16
    (runs load it in the dtype they train in)."""
    import torch
    from transformers import LlamaForCausalLM

    from app.cli.tiny_assets import build_tokenizer

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer: Any = build_tokenizer(folder)
    config = llama_config(
        shape,
        vocab_size=len(tokenizer),
        max_positions=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def build_assets(
    root: Path, settings: CheckSettings, *, shape: LlamaShape = GPU_MODEL, name: str = "llama-0.5b"
) -> tuple[Path, Path]:
    """The model folder (a Llama of `shape` in `name`; the tiny Llama in a dry run) and a
    jsonl dataset under `root`."""
    from app.cli.tiny_assets import build_tiny_llama, write_jsonl_dataset

    if settings.dry_run:
        model = build_tiny_llama(root / "tiny-llama", max_positions=max(128, settings.seq_length))
    else:
        model = build_llama(root / name, shape, max_positions=settings.seq_length)
    data = write_jsonl_dataset(root / "news.jsonl", rows=settings.dataset_rows())
    return model, data


def facts_of(config: Any) -> ModelFacts:
    """Parameters counted on the model built on the meta device: no memory, no weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config)
    return ModelFacts(
        parameters=sum(p.numel() for p in module.parameters()),
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
    )


def model_facts(model: Path) -> ModelFacts:
    from transformers import AutoConfig

    return facts_of(AutoConfig.from_pretrained(model))


def run_request(model: Path, data: Path, *, zero_stage: int, settings: CheckSettings) -> dict:
    """The request both sides train from.

    Packed full-length blocks, so every step trains batch x seq_length tokens (the T of the
    FLOPs formula); the optimizer's settings left at their defaults (weight decay 0.01 off
    biases and norms: two parameter groups, which both sides build alike); a metric every
    step; no export and no retries.
    """
    return {
        "model": str(model),
        "dataset": {"source": str(data), "text_field": "text"},
        "training": {
            "max_steps": settings.steps,
            "learning_rate": settings.learning_rate,
            "batch_size_per_worker": settings.batch_size,
            "seq_length": settings.seq_length,
            "packing": True,
            "log_every_n_steps": 1,
        },
        "deepspeed": {"zero_stage": zero_stage, "precision": settings.precision},
        "resources": {"num_workers": 1, "use_gpu": settings.use_gpu},
        "checkpointing": {"export_hf": False},
        "fault_tolerance": {"max_failures": 0, "max_resubmits": 0},
        "metadata": {"bench": "gpu_check"},
    }


# --- the two sides --------------------------------------------------------------------------


class RunsOverHttp(Protocol):
    """A running service: bench.service.BenchService, or the e2e tests' own."""

    http: Any

    def submit(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def wait_terminal(self, run_id: str, *, timeout_s: float) -> dict[str, Any]: ...


def measure_service(
    service: RunsOverHttp, body: dict[str, Any], *, timeout_s: float = 3600
) -> Measurement:
    """Submit over HTTP, wait, and read back what rank 0 reported for every step."""
    run = service.submit(body)
    final = service.wait_terminal(run["id"], timeout_s=timeout_s)
    if final["status"] != "succeeded":
        logs = service.http.get(f"/v1/runs/{run['id']}/logs", params={"tail": 80}).text
        raise RuntimeError(f"run {run['id']} ended {final['status']}: {final['error']}\n{logs}")
    run_id = final["id"]

    def values(name: str) -> list[float]:
        return [float(r["value"]) for r in metric_rows(service, run_id, name)]

    step_time, speed = values("step_time_seconds"), values("tokens_per_second")
    peak: float | None = None
    kind = "gpu_allocated" if body["resources"]["use_gpu"] else "rss"
    notes = []
    gpu_memory = values("gpu_memory_max_allocated_bytes")
    if gpu_memory:
        peak = max(gpu_memory)
    elif kind == "rss":
        peak = max(values("memory_rss_bytes"), default=None)
    else:
        notes.append("the worker reported no gpu_memory_max_allocated_bytes")
    return Measurement(
        side=TUNEYARD,
        zero_stage=body["deepspeed"]["zero_stage"],
        precision=body["deepspeed"]["precision"],
        # Wall-clock: the times at which rank 0 logged consecutive steps, so the whole step
        # counts, tuneyard's own per-step work included.
        step_times=step_intervals(service, run_id),
        tokens=[s * t for s, t in zip(speed, step_time, strict=True)],
        losses=values("loss"),
        peak_memory_bytes=peak,
        memory_kind=kind,
        notes=notes,
    )


def plain_env(settings: CheckSettings) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    if settings.dry_run:
        env["DS_ACCELERATOR"] = "cpu"  # as the service's dispatcher does for CPU runs
    return env


def run_module(
    module: str,
    body: dict[str, Any],
    *,
    name: str,
    what: str,
    args: list[str],
    workdir: Path,
    settings: CheckSettings,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """`python -m module --request=... --out=... *args` in a process of its own, on the
    check's request for one stage, its output in workdir's `<name>-zero<stage>.log`: the
    JSON it wrote to --out."""
    stage = body["deepspeed"]["zero_stage"]
    workdir.mkdir(parents=True, exist_ok=True)
    request = workdir / f"{name}-zero{stage}-request.json"
    out = workdir / f"{name}-zero{stage}.json"
    log = workdir / f"{name}-zero{stage}.log"
    request.write_text(json.dumps(body))
    with log.open("wb") as log_file:
        done = subprocess.run(
            [sys.executable, "-m", module, f"--request={request}", f"--out={out}", *args],
            cwd=workdir,
            env=plain_env(settings),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{log.read_text()[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def measure_plain(
    body: dict[str, Any], *, workdir: Path, settings: CheckSettings, timeout_s: float = 3600
) -> Measurement:
    """bench/gpu_check_plain.py in a process of its own, on the same request."""
    result = run_module(
        "bench.gpu_check_plain",
        body,
        name="plain",
        what="the plain DeepSpeed script",
        args=[f"--steps={settings.steps}"],
        workdir=workdir,
        settings=settings,
        timeout_s=timeout_s,
    )
    return Measurement(
        side=PLAIN,
        zero_stage=int(result["zero_stage"]),
        precision=str(result["precision"]),
        step_times=[float(t) for t in result["step_times"]],
        tokens=[float(t) for t in result["tokens"]],
        losses=[float(v) for v in result["losses"]],
        peak_memory_bytes=float(result["peak_memory_bytes"]),
        memory_kind=str(result["memory_kind"]),
    )


def cuda_device_name() -> str | None:
    """The first GPU's name, asked in a process of its own: CUDA initialised here would hold
    memory on the GPU for the whole check."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() "
            "else '')",
        ],
        capture_output=True,
        text=True,
    )
    name = done.stdout.strip()
    return name or None


# --- the check ------------------------------------------------------------------------------


def run_check(settings: CheckSettings, *, model: Path, data: Path, root: Path) -> list[Measurement]:
    """Both stages through the service, then both with the plain script once the service
    (and its Ray head) is gone, so that each has the device to itself."""
    bodies = [
        run_request(model, data, zero_stage=stage, settings=settings) for stage in ZERO_STAGES
    ]
    measurements = []
    allowed = sorted({model.parent, data.parent})
    with running_service(root / "home", allowed_roots=allowed) as service:
        for body in bodies:
            measured = measure_service(service, body)
            print(f"tuneyard ZeRO-{measured.zero_stage}: done", flush=True)
            measurements.append(measured)
    for body in bodies:
        measured = measure_plain(body, workdir=root / "plain", settings=settings)
        print(f"plain DeepSpeed ZeRO-{measured.zero_stage}: done", flush=True)
        measurements.append(measured)
    return measurements


# A profile records a few steady steps: a trace of many is large and says nothing more.
PROFILE_WARMUP_STEPS = 5
PROFILE_STEPS = 5


def profile_steps(settings: CheckSettings) -> int:
    return min(settings.steps - settings.warmup_steps, PROFILE_STEPS)


def profile_stage(
    body: dict[str, Any], *, workdir: Path, trace_dir: Path, settings: CheckSettings
) -> dict[str, Any]:
    """bench/gpu_profile.py in a process of its own, on the check's request: its summary."""
    return run_module(
        "bench.gpu_profile",
        body,
        name="profile",
        what="the profile",
        args=[
            f"--trace-dir={trace_dir}",
            f"--warmup-steps={min(settings.warmup_steps, PROFILE_WARMUP_STEPS)}",
            f"--steps={profile_steps(settings)}",
        ],
        workdir=workdir,
        settings=settings,
    )


def profile_tables(
    summaries: list[dict[str, Any]],
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """A row per stage (where the step's time goes), and the top operators of each."""
    from bench.gpu_profile import Operator, Profile, StepTimes

    steps, operators = [], []
    for summary in summaries:
        profile = Profile(
            **{
                **summary,
                "steps": [StepTimes(**s) for s in summary["steps"]],
                "top": [Operator(**o) for o in summary["top"]],
            }
        )
        steps.append(profile.row())
        operators.extend(
            {
                "ZeRO": profile.zero_stage,
                "operator": o.name,
                "calls": o.calls,
                "own time (ms)": o.self_ms,
                "of the steps": f"{o.share:.1%}",
            }
            for o in profile.top
        )
    return steps, operators


def run_profile(
    settings: CheckSettings, *, model: Path, data: Path, root: Path, trace_dir: Path
) -> int:
    """`--profile`: tuneyard's step at each stage under torch.profiler, one short process
    each; two tables (the step's time, the top operators) and a trace per stage."""
    summaries = [
        profile_stage(
            run_request(model, data, zero_stage=stage, settings=settings),
            workdir=root / "profile",
            trace_dir=trace_dir,
            settings=settings,
        )
        for stage in ZERO_STAGES
    ]
    steps, operators = profile_tables(summaries)
    where = (
        "dry run on CPU, tiny Llama"
        if settings.dry_run
        else f"~0.5B Llama, {summaries[0]['device']}"
    )
    warmup = min(settings.warmup_steps, PROFILE_WARMUP_STEPS)
    notes = [
        "tuneyard's step (worker.training.loop.train_step) on the engine a run builds, one "
        f"process, {warmup} steps' warm-up, then {profile_steps(settings)} recorded "
        "(bench/gpu_profile.py says what each column measures).",
        *(f"ZeRO-{s['zero_stage']} trace: {s['trace']}" for s in summaries),
    ]
    common.record(f"GPU check profile: where a step's time goes ({where})", steps, notes=notes)
    common.record(f"GPU check profile: top operators by their own time ({where})", operators)
    return 0


def report_notes(
    settings: CheckSettings,
    *,
    facts: ModelFacts,
    device: str,
    peak_flops: float | None,
    per_token: float,
    measurements: list[Measurement],
) -> list[str]:
    model = (
        "tiny Llama (app.cli.tiny_assets.build_tiny_llama)"
        if settings.dry_run
        else f"Llama {GPU_MODEL.num_layers} layers, hidden {GPU_MODEL.hidden_size}, "
        f"{GPU_MODEL.num_heads} heads, MLP {GPU_MODEL.intermediate_size}"
    )
    peak = (
        f"peak {peak_flops / 1e12:,.0f} TFLOP/s dense bf16"
        if peak_flops
        else "no peak FLOP/s known for it (pass --peak-flops): MFU n/a"
    )
    notes = [
        f"Model: {model}, {facts.parameters:,} parameters, built locally with random weights; "
        f"vocabulary of the local tokenizer. Device: {device}; {peak}.",
        f"Each run: 1 worker, {settings.precision}, batch {settings.batch_size} x seq_length "
        f"{settings.seq_length} packed (every token trained), AdamW lr "
        f"{settings.learning_rate:g} (the rest of the optimizer at the run's defaults), "
        f"{settings.steps} steps, the first {settings.warmup_steps} left out of tokens/s. "
        "Both sides use one DeepSpeed config (contract.deepspeed_config), the run's data "
        "loader, model inputs and optimizer (bench/gpu_check_plain.py says which): the same "
        "examples in the same order through the same steps. A speed ratio is given only "
        f"where their losses agree: within {FP32_LOSS_GAP:g} at every step in fp32, within "
        f"{HALF_FIRST_STEP_GAP:.0%} at the first step and {HALF_CURVE_GAP:.0%} at every "
        "later one in bf16.",
        f"MFU = {per_token / 1e9:,.3f} GFLOP a token (PaLM: 6 N + 12 L h T) x tokens/s / peak.",
        "tokens/s: tokens of the timed steps / their wall-clock time; tuneyard's from the times "
        "rank 0 logged consecutive steps (GET /v1/runs/{id}/metrics), the plain script's from "
        "one step's end to the next with the device synchronised.",
        "Peak memory: torch.cuda.max_memory_allocated in the training process (tuneyard: the "
        "worker's gpu_memory_max_allocated_bytes metric); on CPU, the largest resident set "
        "at a step's end (tuneyard: memory_rss_bytes).",
    ]
    for m in measurements:
        notes.extend(f"{m.side} ZeRO-{m.zero_stage}: {note}" for note in m.notes)
    return notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny Llama, fp32, 3 steps")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-length", type=int)
    parser.add_argument(
        "--peak-flops", type=float, help="the GPU's peak dense bf16 FLOP/s, e.g. 989e12"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of the comparison: tuneyard's step under torch.profiler at each stage, "
        "the warm-up steps left out, the rest recorded",
    )
    parser.add_argument(
        "--trace-dir", type=Path, default=Path("gpu-check-traces"), help="--profile's traces"
    )
    args = parser.parse_args()

    defaults = CheckSettings.defaults(dry_run=args.dry_run)
    settings = CheckSettings(
        dry_run=args.dry_run,
        steps=args.steps or defaults.steps,
        warmup_steps=defaults.warmup_steps if args.warmup_steps is None else args.warmup_steps,
        batch_size=args.batch_size or defaults.batch_size,
        seq_length=args.seq_length or defaults.seq_length,
    )
    if settings.warmup_steps >= settings.steps:
        parser.error(f"--warmup-steps ({settings.warmup_steps}) must be below --steps")

    if settings.dry_run:
        device, peak_flops = "CPU (dry run)", None
        # bench.common.record prints the table but does not append it to BENCHMARKS.md.
        os.environ["TUNEYARD_BENCH_DRY_RUN"] = "1"
    else:
        name = cuda_device_name()
        if name is None:
            print(
                "no CUDA GPU is visible to torch here (a CPU build of torch, or no GPU): "
                "`python -m bench.gpu_check --dry-run` runs the same code paths on CPU",
                file=sys.stderr,
            )
            return 2
        device, peak_flops = name, args.peak_flops or peak_bf16_flops(name)

    with bench_home("gpu-check") as root:
        model, data = build_assets(root / "assets", settings)
        if args.profile:
            # Absolute: the profile runs in a temporary folder of its own.
            return run_profile(
                settings, model=model, data=data, root=root, trace_dir=args.trace_dir.resolve()
            )
        facts = model_facts(model)
        print(f"model: {facts.parameters:,} parameters", flush=True)
        measurements = run_check(settings, model=model, data=data, root=root)
    per_token = flops_per_token(facts, seq_length=settings.seq_length)
    rows = table_rows(
        measurements,
        warmup_steps=settings.warmup_steps,
        flops_per_token=per_token,
        peak_flops=peak_flops,
    )
    title = (
        "GPU check (dry run on CPU: tiny Llama, fp32)"
        if settings.dry_run
        else f"GPU check: ~0.5B Llama, tuneyard vs plain DeepSpeed, bf16, one {device}"
    )
    common.record(
        title,
        rows,
        notes=report_notes(
            settings,
            facts=facts,
            device=device,
            peak_flops=peak_flops,
            per_token=per_token,
            measurements=measurements,
        ),
    )
    unlike = mismatches(measurements)
    for stage, reason in sorted(unlike.items()):
        print(
            f"ZeRO-{stage}: tuneyard and the plain script did not train alike ({reason}); "
            "their speeds are not compared",
            file=sys.stderr,
        )
    return 1 if unlike else 0


if __name__ == "__main__":
    sys.exit(main())
