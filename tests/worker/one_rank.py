"""Spawned test processes as the ranks of a gloo group on loopback, as DeepSpeed needs one
even for a single worker (its engine, ZeRO and shared-memory comm all ask the group)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What a rank imports before its first line: about 6 CPU seconds in a fresh interpreter,
# paid by every spawned rank of every test. A fork server imports them once per test
# process and forks each rank from there (copy on write), so a rank starts in a fraction
# of a second. Importing them starts no thread, so forking after them is safe.
PRELOADED = (
    "torch",
    "torch.distributed",
    "deepspeed",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "peft",
    "trl",
    "datasets",
)


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`, each rank forked from the fork
    server, in this process's environment as it is now, its output shown as this test's.

    A fork server's children get the environment it started with and write to the
    stdout and stderr it started with (under pytest, the capture of whichever test
    started it): each rank writes to a file of its own instead, printed here after."""
    import torch.multiprocessing as torch_mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        try:
            torch_mp.start_processes(
                _in_environment,
                args=(fn, dict(os.environ), logs, *args),
                nprocs=nprocs,
                start_method="forkserver",
            )
        finally:
            for rank in range(nprocs):
                log = Path(logs, f"rank{rank}.log")
                if log.exists() and (text := log.read_text(errors="replace")):
                    sys.stdout.write(f"--- rank {rank} ---\n{text}")


def _in_environment(
    rank: int, fn: Callable[..., None], env: dict[str, str], logs: str, *args: Any
) -> None:
    os.environ.clear()
    os.environ.update(env)
    log = os.open(Path(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # Ranks may end with os._exit, which flushes nothing.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    fn(rank, *args)


def join_group(rank: int, world_size: int, port: int) -> None:
    """Rank `rank` of `world_size` on loopback at `port` (picked by the parent:
    `app.ports.free_port`), with DeepSpeed on its CPU accelerator."""
    import torch.distributed as dist

    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def join_one_rank_group(port: int) -> None:
    """Rank 0 of 1."""
    join_group(0, 1, port)
