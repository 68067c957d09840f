"""Benchmark 3, training overhead: the same training through tuneyard and through a plain
Ray Train + DeepSpeed script written as the tutorial writes it (bench/tutorial_baseline.py).

Both sides: the tiny GPT-2, ZeRO-2, fp32, 2 CPU workers, batch 8 per worker, seq_length
512, the same data, a fixed number of steps, on one Ray head (the service's). tuneyard runs
are submitted over HTTP; the tutorial script runs as a plain Ray job beside them. Every
text is longer than seq_length, so both sides train on full 8 x 512 batches and do the
same work per step whatever their padding rule. Step time is the wall-clock interval
between consecutive step ends on rank 0, after WARMUP_STEPS; repetitions alternate sides.

    python -m bench.training_overhead [--steps 40] [--repeats 7]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.common import median, percentile, record
from bench.service import BenchService, running_service
from bench.training import (
    WARMUP_STEPS,
    bench_home,
    build_model,
    metric_rows,
    run_tuneyard,
    run_tutorial,
    steady,
    step_intervals,
    write_jsonl,
)

BATCH_SIZE = 8
SEQ_LENGTH = 512
TARGET_RATIO = 1.05


def long_texts(n: int, *, lines_per_text: int = 60) -> list[str]:
    """News-like texts, each longer than SEQ_LENGTH tokens: every sample is truncated to a
    full row, so neither side pads."""
    from app.cli.tiny_assets import news_lines

    lines = news_lines(n * lines_per_text, seed=7)
    return [" ".join(lines[i * lines_per_text : (i + 1) * lines_per_text]) for i in range(n)]


def check_all_full(model: Path, texts: list[str]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    shortest = min(len(ids) for ids in tokenizer(texts)["input_ids"])
    if shortest < SEQ_LENGTH:
        raise RuntimeError(f"a text has {shortest} tokens, fewer than seq_length {SEQ_LENGTH}")


def tuneyard_request(*, model: Path, data: Path, steps: int) -> dict[str, Any]:
    """The run request for tuneyard's side: the tutorial's configuration."""
    return {
        "model": str(model),
        "dataset": {"source": str(data), "text_field": "text"},
        "training": {
            "max_steps": steps,
            "learning_rate": 3e-3,
            "batch_size_per_worker": BATCH_SIZE,
            "seq_length": SEQ_LENGTH,
            "packing": False,
            "log_every_n_steps": 1,
            # The tutorial decays every parameter (one AdamW group); configure the same.
            "weight_decay": 0.01,
            "decay_bias_and_norm": True,
        },
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "resources": {"num_workers": 2},
        "checkpointing": {"export_hf": False},
    }


def tuneyard_side(
    service: BenchService, *, model: Path, data: Path, steps: int
) -> dict[str, list[float]]:
    run = run_tuneyard(service, tuneyard_request(model=model, data=data, steps=steps))
    inner = [r["value"] for r in metric_rows(service, run["id"], "step_time_seconds")]
    # Logged from step 2 on (it needs the previous step's mark): step 1 repeats step 2's.
    cpu = [r["value"] for r in metric_rows(service, run["id"], "cpu_seconds_per_step")]
    return {
        "step_times": step_intervals(service, run["id"]),
        "cpu_times": cpu[:1] + cpu,
        "inner": inner,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    runs: dict[str, list[dict[str, list[float]]]] = {"tutorial": [], "tuneyard": []}
    with bench_home("overhead") as root:
        model = build_model(root / "assets")
        texts = long_texts(2 * BATCH_SIZE * args.steps + 64)
        check_all_full(model, texts)
        data = write_jsonl(root / "assets" / "long-news.jsonl", texts)
        with running_service(root / "home", allowed_roots=[root / "assets"]) as service:
            for i in range(args.repeats):
                # Alternate which side goes first, so drift on a shared machine hits both.
                order = ("tutorial", "tuneyard") if i % 2 == 0 else ("tuneyard", "tutorial")
                for side in order:
                    if side == "tutorial":
                        result = run_tutorial(
                            service,
                            model=model,
                            data=data,
                            steps=args.steps,
                            index=i,
                            batch_size=BATCH_SIZE,
                            seq_length=SEQ_LENGTH,
                        )
                    else:
                        result = tuneyard_side(service, model=model, data=data, steps=args.steps)
                    runs[side].append(result)
                    wall = median(steady(result["step_times"]))
                    cpu = median(steady(result["cpu_times"]))
                    print(f"repeat {i + 1}, {side}: step {wall:.4f}s wall, {cpu:.4f}s CPU")

    report(runs, steps=args.steps)


def report(runs: dict[str, list[dict[str, list[float]]]], *, steps: int) -> None:
    tokens_per_step = 2 * BATCH_SIZE * SEQ_LENGTH

    def medians(side: str, key: str) -> list[float]:
        return [median(steady(r[key])) for r in runs[side]]

    def paired(key: str) -> list[float]:
        # Each repetition runs both sides back to back: their ratio cancels slow drift.
        return [
            b / a for a, b in zip(medians("tutorial", key), medians("tuneyard", key), strict=True)
        ]

    wall_ratio, cpu_ratio = median(paired("step_times")), median(paired("cpu_times"))
    rows: list[dict[str, object]] = []
    for side, name in (("tutorial", "tutorial script"), ("tuneyard", "tuneyard")):
        wall, cpu = medians(side, "step_times"), medians(side, "cpu_times")
        pooled = [t for r in runs[side] for t in steady(r["step_times"])]
        rows.append(
            {
                "side": name,
                "runs": len(wall),
                "median step, wall (ms)": 1000 * median(wall),
                "p10-p90 wall (ms)": f"{1000 * percentile(pooled, 10):.0f}-"
                f"{1000 * percentile(pooled, 90):.0f}",
                "per-run medians, wall (ms)": " ".join(f"{1000 * m:.0f}" for m in wall),
                "median step, CPU (ms)": 1000 * median(cpu),
                "tokens/s (wall)": tokens_per_step / median(wall),
                "wall ratio": 1.0 if side == "tutorial" else wall_ratio,
                "CPU ratio": 1.0 if side == "tutorial" else cpu_ratio,
            }
        )
    inner = median(medians("tuneyard", "inner"))
    verdict = "met" if wall_ratio <= TARGET_RATIO else "MISSED"
    record(
        "Training overhead: tuneyard vs the Ray Train + DeepSpeed tutorial",
        rows,
        notes=[
            f"Ratio of steady-state step times, tuneyard / tutorial: {wall_ratio:.3f} wall-clock "
            f"(median of the per-repetition ratios "
            f"{', '.join(f'{p:.3f}' for p in paired('step_times'))}), {cpu_ratio:.3f} in CPU "
            f"time ({', '.join(f'{p:.3f}' for p in paired('cpu_times'))}). "
            f"Target <= {TARGET_RATIO}: {verdict} by the median; the per-repetition ratios "
            f"span {min(paired('step_times')):.2f} to {max(paired('step_times')):.2f}, and "
            "a difference smaller than that spread is not resolved by this comparison. "
            "bench/step_overhead.py times the two steps alternating in the same processes, "
            "to about a percent.",
            f"Tiny GPT-2 (2 layers, n_embd 32), ZeRO-2, fp32, 2 CPU workers (gloo), batch "
            f"{BATCH_SIZE} per worker, seq_length {SEQ_LENGTH}, {steps} steps, the first "
            f"{WARMUP_STEPS} left out. Both sides run as Ray jobs on the service's Ray head; "
            "repetitions alternate which side goes first and each is paired with the run "
            "next to it.",
            "Wall: the interval between consecutive step ends on rank 0 (for tuneyard the "
            "times at which rank 0 logged each step, read from GET /v1/runs/{id}/metrics, so "
            "its per-step metric reduction and posting count). CPU: rank 0's process CPU "
            "time over the same interval, every thread included (tuneyard's "
            "cpu_seconds_per_step metric; the tutorial's process_time). Other jobs share "
            "these 2 cores and move wall-clock times by tens of percent from run to run; "
            "CPU time leaves out the time they hold the cores.",
            f"tuneyard's step_time_seconds metric (forward, backward, optimizer step only): "
            f"median {1000 * inner:.1f} ms.",
            "Same work per step: every text is longer than seq_length, so both sides train on "
            "full 8 x 512 rows (the tutorial pads to seq_length, tuneyard to the longest row: "
            "here the same). Same optimizer setup: AdamW, weight decay 0.01 on every "
            "parameter, one parameter group (tuneyard: training.decay_bias_and_norm true; its "
            "default keeps biases and norms out of decay in a second group, which costs ZeRO "
            "a second partition to reduce and gather each step). Left different: the "
            "tutorial names AdamW in the DeepSpeed config (torch_adam), tuneyard passes torch "
            "AdamW; tuneyard checkpoints once at the end, outside the timed steps.",
        ],
    )


if __name__ == "__main__":
    main()
