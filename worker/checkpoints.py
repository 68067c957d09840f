"""DeepSpeed checkpoints through Ray Train, resume from them, and the final HF export."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from worker.spec import RunSpec

log = logging.getLogger("tuneyard.worker")

# Written beside DeepSpeed's files, so a resume can refuse an incompatible checkpoint
# before DeepSpeed fails on it in a way nobody can read.
MANIFEST = "tuneyard_checkpoint.json"


def save_and_report_checkpoint(
    engine: Any, spec: RunSpec, *, step: int, epoch: float, metrics: dict[str, float]
) -> None:
    """Every rank saves its shards and calls `ray.train.report`; Ray merges the folders."""
    import ray.train
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="tuneyard-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=f"step_{step}", client_state={"step": step})
        if not dist.is_initialized() or dist.get_rank() == 0:
            manifest = {
                "step": step,
                "epoch": epoch,
                "zero_stage": spec.deepspeed.zero_stage,
                "tensor_parallel_size": spec.deepspeed.tensor_parallel_size,
                "attempt": spec.attempt,
            }
            Path(tmp, MANIFEST).write_text(json.dumps(manifest))
        ray.train.report(
            {**metrics, "step": step, "epoch": epoch},
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=f"checkpoint_step_{step:08d}",
        )


def restore_checkpoint(engine: Any, spec: RunSpec) -> int:
    """Load Ray Train's latest checkpoint, if any; the optimizer step to continue from."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as folder:
        manifest = json.loads(Path(folder, MANIFEST).read_text())
        for key in ("zero_stage", "tensor_parallel_size"):
            wanted = getattr(spec.deepspeed, key)
            if manifest[key] != wanted:
                raise ValueError(
                    f"cannot resume: the checkpoint was written with deepspeed.{key}="
                    f"{manifest[key]}, this run asks for {wanted}"
                )
        _, client_state = engine.load_checkpoint(folder)
    step = int(client_state["step"])
    log.info("run %s: resumed from step %d", spec.run_id, step)
    return step


def export_dir(spec: RunSpec) -> Path:
    return Path(spec.storage_path) / spec.run_id / "export"


def export_hf_model(engine: Any, tokenizer: Any, spec: RunSpec, *, rank: int) -> str:
    """A folder `from_pretrained` loads: config, safetensors weights and the tokenizer.

    Under ZeRO-3 the weights are partitioned, so every rank joins the gather and rank 0
    receives the full state dict; below stage 3 every rank already holds full weights.
    """
    out = export_dir(spec)
    if spec.deepspeed.zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if rank == 0 else None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        engine.module.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
        log.info("run %s: exported model to %s", spec.run_id, out)
    return str(out)
