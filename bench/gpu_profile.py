"""Where a step's time goes: tuneyard's own training step (`worker.training.loop.train_step`,
its loss shared over the step's targets) on the engine a run builds, a few steady steps
recorded with `torch.profiler` (CPU, and CUDA on a GPU), in one process, without Ray.

    python -m bench.gpu_profile --request REQUEST.json --out SUMMARY.json \\
        --trace-dir TRACES --warmup-steps 5 --steps 5

`bench.gpu_check --profile` runs it for each ZeRO stage and prints its tables. Per step:
the step's time (CUDA events on a GPU, between which the device ran the step; the host's
clock on CPU); the host's time to issue it (from the step's start until `train_step`
returned, before waiting for the device) and the CPU time of the training thread; the
GPU's busy time (the union of its kernels' intervals) and idle time (the rest of the
step). A host that issues the step in about the step's time is the bottleneck; a GPU idle
for much of it waits on the host or on communication. The trace (Chrome's format, for
chrome://tracing or Perfetto) and the top operators by their own time go with it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOP_OPERATORS = 12


@dataclass
class StepTimes:
    step_ms: float  # CUDA events on a GPU, the host's clock on CPU
    host_issue_ms: float  # wall time until train_step returned, before any wait for the device
    host_cpu_ms: float  # CPU time of the training thread over the step


@dataclass
class Operator:
    name: str
    calls: int
    self_ms: float  # on the device where there is one, else on the CPU
    share: float  # of all the steps' time


@dataclass
class Profile:
    zero_stage: int
    precision: str
    device: str
    steps: list[StepTimes]
    gpu_busy_ms: float | None  # per step; None on CPU
    top: list[Operator] = field(default_factory=list)
    trace: str = ""

    def row(self) -> dict[str, object]:
        def mean(values: list[float]) -> float:
            return sum(values) / len(values)

        step = mean([s.step_ms for s in self.steps])
        busy = self.gpu_busy_ms
        return {
            "ZeRO": self.zero_stage,
            "precision": self.precision,
            "steps profiled": len(self.steps),
            "step (ms)": step,
            "host issue (ms)": mean([s.host_issue_ms for s in self.steps]),
            "host CPU (ms)": mean([s.host_cpu_ms for s in self.steps]),
            "GPU busy (ms)": "n/a" if busy is None else busy,
            "GPU idle": "n/a" if busy is None else f"{max(step - busy, 0.0) / step:.0%}",
        }


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals, in their unit."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def top_operators(averages: Any, *, on_device: bool, total_ms: float) -> list[Operator]:
    """The operators with the most time of their own: on a GPU its kernels (the device's
    own events: an operator's device time is its kernels', which would count them twice),
    on CPU the operators."""
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    if on_device:
        from torch.autograd import DeviceType

        averages = [a for a in averages if a.device_type == DeviceType.CUDA]
    ranked = sorted(averages, key=lambda a: getattr(a, key), reverse=True)
    top = []
    for average in ranked[:TOP_OPERATORS]:
        own_ms = getattr(average, key) / 1000.0  # the profiler counts microseconds
        if own_ms <= 0:
            break
        top.append(
            Operator(
                name=average.key[:80],
                calls=int(average.count),
                self_ms=own_ms,
                share=own_ms / total_ms if total_ms else 0.0,
            )
        )
    return top


def profile(request: dict[str, Any], *, warmup_steps: int, steps: int, trace_dir: Path) -> Profile:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench.gpu_check_plain import setup
    from worker.reporting.host_group import host_group
    from worker.training.loop import batches_from, train_step

    built = setup(request, run_id="gpu-profile")
    use_gpu = built.use_gpu
    batches = batches_from(built.plan, built.loader, 0)
    # As a rank's: the step's target count is summed on a gloo group of its own (nccl
    # cannot reduce the host tensor it lives in).
    group = host_group()

    def step() -> None:
        train_step(built.engine, batches, spec=built.spec, device=built.device, group=group)

    for _ in range(warmup_steps):
        step()
    built.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_gpu else [])
    timed: list[StepTimes] = []
    with torch_profile(activities=activities) as recorded:
        for _ in range(steps):
            cpu_before, wall_before = time.thread_time(), time.perf_counter()
            if use_gpu:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            step()
            issued = time.perf_counter()
            if use_gpu:
                end.record()
                end.synchronize()
                step_ms = start.elapsed_time(end)
            else:
                step_ms = (issued - wall_before) * 1000.0
            timed.append(
                StepTimes(
                    step_ms=step_ms,
                    host_issue_ms=(issued - wall_before) * 1000.0,
                    host_cpu_ms=(time.thread_time() - cpu_before) * 1000.0,
                )
            )
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace = trace_dir.resolve() / f"zero{built.zero_stage}-{'cuda' if use_gpu else 'cpu'}.json"
    recorded.export_chrome_trace(str(trace))

    total_ms = sum(t.step_ms for t in timed)
    busy: float | None = None
    if use_gpu:
        from torch.autograd import DeviceType

        # Kernels, copies and sets: the GPU's annotations of a CPU span (Optimizer.step,
        # record_function ranges) cover its gaps too, and are left out.
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in recorded.events()
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        ]
        busy = busy_ms(kernels) / 1000.0 / len(timed)
    result = Profile(
        zero_stage=built.zero_stage,
        precision=built.precision,
        device=torch.cuda.get_device_name(0) if use_gpu else "cpu",
        steps=timed,
        gpu_busy_ms=busy,
        top=top_operators(recorded.key_averages(), on_device=use_gpu, total_ms=total_ms),
        trace=str(trace),
    )
    built.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="the run request, a JSON file")
    parser.add_argument("--out", required=True, help="where the summary goes, as JSON")
    parser.add_argument("--trace-dir", required=True, help="where the Chrome trace goes")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    summary = profile(
        json.loads(Path(args.request).read_text()),
        warmup_steps=args.warmup_steps,
        steps=args.steps,
        trace_dir=Path(args.trace_dir),
    )
    Path(args.out).write_text(json.dumps(asdict(summary)))


if __name__ == "__main__":
    main()
