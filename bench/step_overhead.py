"""Benchmark 3, the training step alone: tuneyard's step against the tutorial's, in the same
two processes, alternating step by step.

bench/training_overhead.py compares whole runs one after another, so every other job on
these shared cores lands on one side or the other and moves the ratio by several percent.
Here both sides are built side by side in the same two gloo ranks (the way Ray Train runs
them: one CPU and one torch thread per rank) and take turns, one step each, in an order
that alternates: drift hits both alike, and the per-step ratio is tuneyard's cost in the
step to within about a percent.

- tuneyard: `worker.training.loop.build_training` (tokenizer, data with its collator,
  model, optimizer, scheduler, DeepSpeed engine) from the same run request that
  training_overhead submits, then `train_step` and `MetricSinks.log_step` every step, with
  rank 0 posting its metrics over HTTP to a local receiver that answers at once.
- tutorial: bench/tutorial_baseline.py's dataset (padded to seq_length), DeepSpeed config
  and step; a DistributedSampler shards the data, as `prepare_data_loader` does.

What this leaves out, training_overhead keeps: Ray's and the service's own work while a
run trains.

    python -m bench.step_overhead [--steps 150] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from app.ports import free_port
from bench.common import median, record
from bench.training import WARMUP_STEPS, bench_home, build_model, write_jsonl
from bench.training_overhead import (
    BATCH_SIZE,
    SEQ_LENGTH,
    TARGET_RATIO,
    check_all_full,
    long_texts,
    tuneyard_request,
)

WORLD_SIZE = 2
SIDES = ("tutorial", "tuneyard")


class _Receiver(BaseHTTPRequestHandler):
    """Stands in for the service: reads the body and answers 200 at once."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _cycle(loader: Any) -> Iterator[dict[str, Any]]:
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _rank(rank: int, config: dict[str, Any]) -> None:
    """One rank: build both sides, then alternate their steps; rank 0 writes the times."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(config["master_port"]),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        DS_ACCELERATOR="cpu",
    )
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from bench.tutorial_baseline import (
        tutorial_dataset,
        tutorial_engine,
        tutorial_step,
        tutorial_tokenizer,
    )
    from contract.job_env import CALLBACK_URL_ENV, TOKEN_ENV
    from contract.run_request import RunSpec
    from worker.reporting.metrics import MetricSinks
    from worker.training.loop import batches_from, build_training, train_step

    # Ray gives a 1-CPU worker one OpenMP thread; do the same for both sides.
    torch.set_num_threads(1)
    os.environ[CALLBACK_URL_ENV] = config["callback_url"]
    os.environ[TOKEN_ENV] = "bench"
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)

    tokenizer = tutorial_tokenizer(config["model"])
    dataset = tutorial_dataset(tokenizer, config["data"], SEQ_LENGTH)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    tutorial_batches = _cycle(
        DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)
    )
    tutorial = tutorial_engine(
        {
            "model": config["model"],
            "batch_size": BATCH_SIZE,
            "num_workers": WORLD_SIZE,
            "zero_stage": 2,
            "lr": 3e-3,
        }
    )

    spec = RunSpec.model_validate(config["spec"])
    training = build_training(spec, rank=rank)
    tuneyard_batches = batches_from(training.plan, training.data.train, 0)
    sinks = MetricSinks(spec, rank=rank)
    steps = config["steps"]
    done = 0

    def tuneyard_step() -> None:
        nonlocal done
        started = time.perf_counter()
        result = train_step(
            training.engine,
            tuneyard_batches,
            spec=spec,
            device=training.device,
            group=sinks.group,
        )
        done += 1
        sinks.log_step(
            training.engine,
            step=done,
            epoch=training.plan.epoch_at(done),
            elapsed=time.perf_counter() - started,
            result=result,
            total_steps=steps,
        )

    def tutorial_side_step() -> None:
        batch = next(tutorial_batches)
        tutorial_step(tutorial, batch)
        int(batch["attention_mask"].sum())  # the tutorial counts tokens too

    step_of = {"tutorial": tutorial_side_step, "tuneyard": tuneyard_step}
    times: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []} for s in SIDES}
    dist.barrier()
    for i in range(steps):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            step_of[side]()
            times[side]["wall"].append(time.perf_counter() - wall)
            times[side]["cpu"].append(time.process_time() - cpu)
    sinks.flush()
    sinks.close()
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run_once(config: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(config,), nprocs=WORLD_SIZE)
    result: dict[str, dict[str, list[float]]] = json.loads(Path(config["out"]).read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    runs = []
    try:
        with bench_home("step") as root:
            model = build_model(root / "assets")
            texts = long_texts(WORLD_SIZE * BATCH_SIZE * args.steps + 64)
            check_all_full(model, texts)
            data = write_jsonl(root / "assets" / "long-news.jsonl", texts)
            request = tuneyard_request(model=model, data=data, steps=args.steps)
            spec = _worker_spec(request, storage=root / "storage")
            for i in range(args.repeats):
                result = run_once(
                    {
                        "model": str(model),
                        "data": str(data),
                        "spec": spec,
                        "steps": args.steps,
                        "out": str(root / f"steps-{i}.json"),
                        "master_port": free_port(),
                        "callback_url": f"http://127.0.0.1:{receiver.server_address[1]}",
                    }
                )
                runs.append(result)
                ratio = _paired_ratio(result, "wall")
                print(f"repeat {i + 1}: tuneyard / tutorial per step {ratio:.3f} wall")
    finally:
        receiver.shutdown()
    report(runs, steps=args.steps)


def _worker_spec(request: dict[str, Any], *, storage: Path) -> dict[str, Any]:
    """The spec a worker gets for this request, as the service builds it."""
    from contract.run_request import RunRequest

    fields = RunRequest.model_validate(request).worker_fields()
    return {**fields, "run_id": "bench", "attempt": 1, "storage_path": str(storage)}


def _paired_ratio(result: dict[str, dict[str, list[float]]], key: str) -> float:
    """Median over steps of tuneyard's step / the tutorial's step taken next to it."""
    a, b = result["tutorial"][key][WARMUP_STEPS:], result["tuneyard"][key][WARMUP_STEPS:]
    return median([y / x for x, y in zip(a, b, strict=True)])


def report(runs: list[dict[str, dict[str, list[float]]]], *, steps: int) -> None:
    wall_ratios = [_paired_ratio(r, "wall") for r in runs]
    cpu_ratios = [_paired_ratio(r, "cpu") for r in runs]
    rows: list[dict[str, object]] = []
    for side, name in (("tutorial", "tutorial script's step"), ("tuneyard", "tuneyard's step")):
        walls = [median(r[side]["wall"][WARMUP_STEPS:]) for r in runs]
        cpus = [median(r[side]["cpu"][WARMUP_STEPS:]) for r in runs]
        rows.append(
            {
                "side": name,
                "runs": len(runs),
                "median step, wall (ms)": 1000 * median(walls),
                "per-run medians, wall (ms)": " ".join(f"{1000 * w:.1f}" for w in walls),
                "median step, CPU (ms)": 1000 * median(cpus),
                "wall ratio": 1.0 if side == "tutorial" else median(wall_ratios),
                "CPU ratio": 1.0 if side == "tutorial" else median(cpu_ratios),
            }
        )
    wall_ratio = median(wall_ratios)
    verdict = "met" if wall_ratio <= TARGET_RATIO else "MISSED"
    record(
        "Training step overhead: tuneyard's step vs the tutorial's, alternating in the same "
        "processes",
        rows,
        notes=[
            f"Ratio of step times, tuneyard / tutorial: {wall_ratio:.3f} wall-clock (per run, "
            f"the median over steps of each tuneyard step / the tutorial step next to it: "
            f"{', '.join(f'{r:.3f}' for r in wall_ratios)}), {median(cpu_ratios):.3f} in CPU "
            f"time ({', '.join(f'{r:.3f}' for r in cpu_ratios)}). Target <= {TARGET_RATIO}: "
            f"{verdict}.",
            f"Tiny GPT-2 (2 layers, n_embd 32), ZeRO-2, fp32, {WORLD_SIZE} gloo ranks with one "
            f"torch thread each, batch {BATCH_SIZE} per rank, seq_length {SEQ_LENGTH}, "
            f"{steps} steps per side per run, the first {WARMUP_STEPS} left out. Both sides "
            "live in the same two processes and take turns one step each, the order flipping "
            "every step.",
            "tuneyard's step is the worker's own code: build_training from the request "
            "training_overhead submits (one AdamW group, weight decay 0.01, constant LR "
            "schedule), train_step, and MetricSinks.log_step every step (the metric "
            "all-reduce, grad norm, LR, RSS, and rank 0's metric posting over HTTP to a "
            "local receiver). The tutorial's is bench/tutorial_baseline.py's data, config "
            "and step.",
            "CPU: the process's CPU time during the step, every thread included (gloo's, "
            "and the thread posting tuneyard's metrics).",
        ],
    )


if __name__ == "__main__":
    main()
