"""Benchmark 4, useful throughput: non-padding tokens trained per second, tuneyard with
`training.packing: true` against the tutorial's loader that pads every sample to seq_length.

The data: short news-like texts whose lengths follow a lognormal spread (median about 40
tokens, a long tail past 512), written to a local jsonl file. Both sides: the tiny GPT-2,
ZeRO-2, fp32, 2 CPU workers, batch 8 per worker, seq_length 512, a fixed number of steps,
on the service's Ray head. tuneyard runs go through the service over HTTP (its own data
pipeline, worker/data/loading.py); the tutorial script (bench/tutorial_baseline.py) runs as a plain
Ray job. A third row shows tuneyard without packing (it pads each batch to its longest row).

    python -m bench.packing_throughput [--steps 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import random
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
    step_intervals,
    write_jsonl,
)

BATCH_SIZE = 8
SEQ_LENGTH = 512
MEDIAN_TOKENS = 40
# Spread of ln(length): about 1 text in 400 is longer than seq_length, as in news corpora
# where a few long articles sit among many short items.
SIGMA = 0.9
TARGET_RATIO = 3.0


def news_texts(tokenizer: Any, n: int, *, seed: int = 11) -> list[str]:
    """`n` texts of news-like words whose token counts are lognormal around MEDIAN_TOKENS."""
    from app.cli.tiny_assets import news_lines

    words = " ".join(news_lines(20_000, seed=seed)).split()
    sample = " ".join(words[:5000])
    tokens_per_word = len(tokenizer(sample)["input_ids"]) / 5000
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        tokens = max(2.0, rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA))
        count = max(1, round(tokens / tokens_per_word))
        start = rng.randrange(len(words) - count)
        texts.append(" ".join(words[start : start + count]))
    return texts


def length_summary(tokenizer: Any, texts: list[str]) -> dict[str, float]:
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    return {
        "texts": len(lengths),
        "median": median(lengths),
        "p90": percentile(lengths, 90),
        "p99": percentile(lengths, 99),
        "max": max(lengths),
        "over_seq_length": sum(n > SEQ_LENGTH for n in lengths),
        "tokens": sum(lengths),
        "tokens_kept": sum(min(n, SEQ_LENGTH) for n in lengths),
    }


def tuneyard_side(
    service: BenchService, *, model: Path, data: Path, steps: int, packing: bool
) -> dict[str, list[float]]:
    body: dict[str, Any] = {
        "model": str(model),
        "dataset": {"source": str(data), "text_field": "text"},
        "training": {
            "max_steps": steps,
            "learning_rate": 3e-3,
            "batch_size_per_worker": BATCH_SIZE,
            "seq_length": SEQ_LENGTH,
            "packing": packing,
            "log_every_n_steps": 1,
        },
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "resources": {"num_workers": 2},
        "checkpointing": {"export_hf": False},
    }
    run = run_tuneyard(service, body)
    # tokens_per_second x step_time_seconds = the step's non-padding tokens, all ranks.
    rates = metric_rows(service, run["id"], "tokens_per_second")
    inner = metric_rows(service, run["id"], "step_time_seconds")
    tokens = [r["value"] * t["value"] for r, t in zip(rates, inner, strict=True)]
    # Logged from step 2 on (it needs the previous step's mark): step 1 repeats step 2's.
    cpu = [r["value"] for r in metric_rows(service, run["id"], "cpu_seconds_per_step")]
    return {
        "step_times": step_intervals(service, run["id"]),
        "cpu_times": cpu[:1] + cpu,
        "tokens": tokens,
    }


def steady_rate(result: dict[str, list[float]], clock: str = "step_times") -> float:
    """Non-padding tokens per second (wall-clock, or rank 0's CPU time with "cpu_times")
    over the steps after the warm-up."""
    return sum(result["tokens"][WARMUP_STEPS:]) / sum(result[clock][WARMUP_STEPS:])


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    sides = ("tutorial", "packing", "no packing")
    rates: dict[str, list[float]] = {side: [] for side in sides}
    cpu_rates: dict[str, list[float]] = {side: [] for side in sides}
    fill: dict[str, list[float]] = {side: [] for side in sides}
    with bench_home("packing") as root:
        model = build_model(root / "assets")
        tokenizer = AutoTokenizer.from_pretrained(model)
        # Enough text for packing to fill every step's 2 x 8 full blocks.
        texts = news_texts(tokenizer, 6000)
        lengths = length_summary(tokenizer, texts)
        data = write_jsonl(root / "assets" / "short-news.jsonl", texts)
        with running_service(root / "home", allowed_roots=[root / "assets"]) as service:
            for i in range(args.repeats):
                # Rotate the order, so drift on a shared machine hits every side.
                for side in sides[i % 3 :] + sides[: i % 3]:
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
                        result = tuneyard_side(
                            service,
                            model=model,
                            data=data,
                            steps=args.steps,
                            packing=side == "packing",
                        )
                    rates[side].append(steady_rate(result))
                    cpu_rates[side].append(steady_rate(result, "cpu_times"))
                    capacity = 2 * BATCH_SIZE * SEQ_LENGTH * (args.steps - WARMUP_STEPS)
                    fill[side].append(sum(result["tokens"][WARMUP_STEPS:]) / capacity)
                    print(f"repeat {i + 1}, {side}: {rates[side][-1]:,.0f} tokens/s")

    report(rates, cpu_rates, fill, lengths, steps=args.steps)


def report(
    rates: dict[str, list[float]],
    cpu_rates: dict[str, list[float]],
    fill: dict[str, list[float]],
    lengths: dict[str, float],
    *,
    steps: int,
) -> None:
    # A packed block holds one eos between texts; count only the texts' own tokens.
    separator_share = lengths["texts"] / (lengths["tokens"] + lengths["texts"])
    useful = {
        "tutorial": 1.0,
        "packing": 1.0 - separator_share,
        "no packing": 1.0,
    }
    base = median(rates["tutorial"])
    cpu_base = median(cpu_rates["tutorial"])
    names = {
        "tutorial": "tutorial loader (pads every sample to 512)",
        "packing": "tuneyard, packing: true",
        "no packing": "tuneyard, packing: false (pads to the batch's longest)",
    }
    rows: list[dict[str, object]] = []
    for side, runs in rates.items():
        rate = median(runs) * useful[side]
        rows.append(
            {
                "side": names[side],
                "runs": len(runs),
                "useful tokens/s": rate,
                "per-run tokens/s": ", ".join(f"{r * useful[side]:,.0f}" for r in runs),
                "non-padding tokens / (2 x 8 x 512)": median(fill[side]) * useful[side],
                "ratio to tutorial": rate / base,
                "useful tokens per CPU s": median(cpu_rates[side]) * useful[side],
                "CPU ratio": median(cpu_rates[side]) * useful[side] / cpu_base,
            }
        )
    ratio = median(rates["packing"]) * useful["packing"] / base
    cpu_ratio = median(cpu_rates["packing"]) * useful["packing"] / cpu_base
    verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
    record(
        "Useful throughput: packing vs padding every sample to seq_length",
        rows,
        notes=[
            f"Packing / tutorial ratio of non-padding tokens per second: {ratio:.2f} "
            f"wall-clock, {cpu_ratio:.2f} per CPU second. "
            f"Target >= {TARGET_RATIO:g}: {verdict}.",
            f"Data: {lengths['texts']:,} generated news-like texts, lognormal lengths: median "
            f"{lengths['median']:.0f} tokens, p90 {lengths['p90']:.0f}, p99 "
            f"{lengths['p99']:.0f}, max {lengths['max']:.0f}; {lengths['over_seq_length']} "
            f"longer than seq_length {SEQ_LENGTH}.",
            f"Tiny GPT-2, ZeRO-2, fp32, 2 CPU workers, batch {BATCH_SIZE} per worker, "
            f"seq_length {SEQ_LENGTH}, {steps} steps, the first {WARMUP_STEPS} left out; "
            "tuneyard through the real service (its own data pipeline, "
            "worker/data/loading.py), the "
            "tutorial script as a plain Ray job on the same Ray head.",
            "Useful tokens/s = non-padding tokens of the steady steps / their wall-clock "
            "time on rank 0; per CPU s = / rank 0's process CPU time over the same steps, "
            "which leaves out the time other jobs on these shared cores hold them. "
            "tuneyard's count is its reported tokens_per_second x step_time_seconds "
            "(attention-mask sums over both ranks); for packing the eos "
            f"separators between texts ({100 * separator_share:.1f}% of packed tokens) are "
            "taken out. Tokens the tutorial truncates past seq_length are not counted "
            "(they are never trained).",
            "Packed blocks let a text attend to the texts before it in the same block (no "
            "cross-document mask), as in the Hugging Face language-modeling examples.",
        ],
    )


if __name__ == "__main__":
    main()
