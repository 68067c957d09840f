"""Spawned test processes as the ranks of a gloo group on loopback, as DeepSpeed needs one
even for a single worker (its engine, ZeRO and shared-memory comm all ask the group)."""

from __future__ import annotations

import os


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
