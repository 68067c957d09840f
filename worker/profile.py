"""Ray job entry point of a profile: `python -m worker.profile`.

`POST /v1/runs/validate` with `profile: true` sends the request here to be measured before
anyone pays for a run: the training is built exactly as a run builds it
(`worker.training.loop.build_training`) and trains `steps` real steps (`train_step`) under Ray
Train with the run's resources, so the numbers are those of the real parallel setup. Then
rank 0 writes what was measured as JSON to the storage location in `PROFILE_ENV`, and the
service reads it back (app/services/profiles.py). Nothing else a run does happens: no
checkpoint, no export, no callback to the service (a profile has no run, and no run token).
A failure is written to the same place as `{"error": {"code", "message"}}`.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from contract.job_env import PROFILE_ENV
from contract.run_request import RunSpec
from contract.storage import Storage

log = logging.getLogger("tuneyard.worker")


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    steps: int  # steps trained, warm-up included
    warmup_steps: int  # the first steps, not timed: lazy allocations, JIT builds, caches
    result: str  # the storage location of the JSON written at the end

    @classmethod
    def from_env(cls) -> ProfileOptions:
        raw = os.environ.get(PROFILE_ENV)
        if not raw:
            raise RuntimeError(f"{PROFILE_ENV} is not set: this entry point runs as a profile job")
        return cls(**json.loads(raw))


def main() -> int:
    # The start of the start-up the profile reports: the job's driver is running.
    driver_started = time.time()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    spec = RunSpec.from_env()
    options = ProfileOptions.from_env()
    storage = Storage(spec.storage_path)
    try:
        check_placement_now(spec)
        build_profile_trainer(spec, options, driver_started=driver_started).fit()
    except BaseException as exc:
        from worker.reporting.failures import describe_failure, failure_code

        # A profile's codes are a run's, and `cluster_busy` of its own (app/schemas/profile.py).
        code: str = failure_code(exc)
        message = describe_failure(exc)
        if isinstance(exc, ClusterBusy):
            code = "cluster_busy"
        log.error("profile %s failed (%s): %s", spec.run_id, code, message)
        write_json(storage, options.result, {"error": {"code": code, "message": message}})
        return 1
    log.info("profile %s finished", spec.run_id)
    return 0


class ClusterBusy(Exception):
    """The cluster could hold the run, but other runs hold the resources now."""


def check_placement_now(spec: RunSpec) -> None:
    """A profile is asked for while a user waits for its answer: it never waits for
    resources that runs are holding. Raises Unplaceable when the cluster can never hold the
    workers, ClusterBusy when it cannot now (an autoscaling cluster is waited for, within
    the placement timeout the service set)."""
    import ray

    from contract.job_env import CLUSTER_AUTOSCALES_ENV
    from contract.placement import EPS, known, shape, worker_demand, workers
    from worker.reporting.placement import placement_decision

    try:
        if not ray.is_initialized():
            ray.init()
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        free = ray.available_resources()
    except Exception as exc:  # Ray Train reads the cluster again, within its timeout
        log.warning("could not read the cluster's resources before placing workers: %s", exc)
        return
    if not nodes:  # this driver runs on a node: an empty list is a view not ready yet
        return
    res = spec.resources
    autoscales = os.environ.get(CLUSTER_AUTOSCALES_ENV) == "1"
    # Raises Unplaceable when no node can ever hold a worker (the rule runs share).
    placement_decision(
        res,
        nodes,
        free,
        autoscales=autoscales,
        tensor_parallel_size=spec.deepspeed.tensor_parallel_size,
    )
    demand = worker_demand(res)
    needed = {name: need * res.num_workers for name, need in demand.items()}
    if autoscales or all(free.get(k, 0.0) + EPS >= total for k, total in needed.items()):
        return
    raise ClusterBusy(
        f"the profile needs {shape(needed)} for {workers(res.num_workers)}, the cluster has "
        f"{shape(known(free, demand))} free now (runs hold the rest); try again when they "
        "finish"
    )


def build_profile_trainer(spec: RunSpec, options: ProfileOptions, *, driver_started: float) -> Any:
    """The run's TorchTrainer (worker/training/trainer.py) without what outlives a run: no
    checkpoints kept, no callbacks, and one try: a profile that failed says so, and a
    placement wait ends it."""
    from worker.training.trainer import torch_trainer

    return torch_trainer(
        spec,
        profile_loop_per_worker,
        {
            "spec": spec.model_dump(mode="json"),
            "options": asdict(options),
            "driver_started": driver_started,
        },
        max_failures=0,
    )


def profile_loop_per_worker(config: dict[str, Any]) -> None:
    """What every rank runs: the run's own set-up, then `steps` timed steps."""
    import ray.train
    import torch.distributed as dist

    from worker.data.remote_sources import with_local_sources
    from worker.reporting.host_group import host_group
    from worker.reporting.logs import configure_worker_logging
    from worker.reporting.nodes import check_worker_nodes
    from worker.training.deepspeed_import import import_deepspeed
    from worker.training.loop import batches_from, build_training, place_rank, train_step

    spec = RunSpec.model_validate(config["spec"])
    options = ProfileOptions(**config["options"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    configure_worker_logging(run_id=spec.run_id, attempt=spec.attempt, rank=rank)
    place_rank(spec, local_world_size=context.get_local_world_size())
    import_deepspeed()
    # Where a run builds its metric sinks: the gloo group the step's loss reductions use.
    group = host_group()
    check_worker_nodes(spec, rank=rank, post_event=lambda _type, message: log.info(message))
    spec = with_local_sources(spec)
    training = build_training(spec, rank=rank)
    batches = batches_from(training.plan, training.data.train, 0)
    first_step_at = time.time()
    times: list[float] = []
    tokens = samples = 0
    for index in range(options.steps):
        _synchronize(training.device)
        started = time.perf_counter()
        result = train_step(
            training.engine,
            batches,
            spec=spec,
            device=training.device,
            group=group,
            reference=training.reference,
        )
        _synchronize(training.device)
        if index >= options.warmup_steps:
            times.append(time.perf_counter() - started)
            tokens += result.tokens
            samples += result.samples
    mine = {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "step_times": times,
        "tokens": tokens,
        "samples": samples,
        **peak_memory(training.device),
    }
    every: list[dict[str, Any]] = [mine]
    if dist.is_initialized():
        every = [{}] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=group)
    if rank == 0:
        measured = summarize(
            every,
            tensor_parallel_size=spec.deepspeed.tensor_parallel_size,
            startup_seconds=max(first_step_at - float(config["driver_started"]), 0.0),
            options=options,
        )
        write_json(Storage(spec.storage_path), options.result, measured)


def peak_memory(device: Any) -> dict[str, int | None]:
    """This rank's peaks so far: the CUDA caching allocator's (None on CPU) and the
    process's resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    host = rss if sys.platform == "darwin" else rss * 1024
    gpu = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return {"peak_device_memory_bytes": gpu, "peak_host_memory_bytes": int(host)}


def summarize(
    ranks: list[dict[str, Any]],
    *,
    tensor_parallel_size: int,
    startup_seconds: float,
    options: ProfileOptions,
) -> dict[str, Any]:
    """Every rank's measurements as one answer. A step ends when its slowest rank does (the
    ranks meet in its collectives), so a step's time is the largest of the ranks'. Tokens and
    samples are summed over the ranks, once per tensor-parallel group (its ranks train on
    the same batch)."""
    per_step = [max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"]))]
    seconds = sum(per_step)
    tokens = sum(r["tokens"] for r in ranks) / tensor_parallel_size
    samples = sum(r["samples"] for r in ranks) / tensor_parallel_size
    return {
        "steps": options.steps,
        "warmup_steps": options.warmup_steps,
        "steps_measured": len(per_step),
        "step_time_seconds": seconds / len(per_step),
        "step_times_seconds": per_step,
        "tokens_per_second": tokens / seconds if seconds > 0 else None,
        "samples_per_second": samples / seconds if seconds > 0 else None,
        "startup_seconds": startup_seconds,
        "workers": [
            {
                "rank": r["rank"],
                "node_id": r["node_id"],
                "peak_device_memory_bytes": r["peak_device_memory_bytes"],
                "peak_host_memory_bytes": r["peak_host_memory_bytes"],
            }
            for r in sorted(ranks, key=lambda r: r["rank"])
        ],
    }


def write_json(storage: Storage, location: str, document: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        local = Path(folder) / "profile.json"
        local.write_text(json.dumps(document))
        storage.put(local, location)


def _synchronize(device: Any) -> None:
    # A GPU runs behind the host: time each step from an idle device to an idle device.
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
