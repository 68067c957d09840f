"""A spawned test process as the only rank of a gloo group, as DeepSpeed needs one even
for a single worker (its engine, ZeRO and shared-memory comm all ask the group)."""

from __future__ import annotations

import os


def join_one_rank_group(port: int) -> None:
    """Rank 0 of 1 on loopback at `port` (picked by the parent: `app.ports.free_port`),
    with DeepSpeed on its CPU accelerator."""
    import torch.distributed as dist

    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    dist.init_process_group("gloo", rank=0, world_size=1)
