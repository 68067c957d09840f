"""DeepSpeed checkpoints through Ray Train, resume from them, and the final HF export."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.callbacks import CheckpointKind
from contract.run_request import RunSpec
from contract.storage import Storage

log = logging.getLogger("tuneyard.worker")

# Written beside DeepSpeed's files, so a resume can refuse an incompatible checkpoint
# before DeepSpeed fails on it in a way nobody can read.
MANIFEST = "tuneyard_checkpoint.json"


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_step_{step:08d}"


def save_and_report_checkpoint(
    engine: Any,
    spec: RunSpec,
    *,
    step: int,
    epoch: float,
    metrics: dict[str, float],
    watch: dict[str, Any] | None = None,
) -> None:
    """Every rank saves its shards and calls `ray.train.report`; Ray merges the folders.
    `watch`: worker.training.eval_watch's state, restored with the checkpoint."""
    import ray.train
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="tuneyard-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=f"step_{step}", client_state={"step": step, "watch": watch})
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
            checkpoint_dir_name=checkpoint_dir_name(step),
        )


@dataclass(slots=True)
class Restored:
    step: int = 0  # the optimizer step to continue from
    watch: dict[str, Any] | None = None  # worker.training.eval_watch's state at that step


def restore_checkpoint(engine: Any, spec: RunSpec) -> Restored:
    """Load Ray Train's latest checkpoint, if any."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return Restored()
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
    log.info("resumed from step %d", step)
    return Restored(step=step, watch=client_state.get("watch"))


def load_weights_of_step(engine: Any, spec: RunSpec, *, step: int) -> None:
    """Put the weights of this run's checkpoint at `step` back into the engine (every rank
    loads its own shards), for an export of the best checkpoint rather than the last.

    The whole checkpoint, optimizer states included, as a resume loads it: under ZeRO-3
    (and with ZeRO's bf16 master weights) the weights are restored from the optimizer's
    partitions, which DeepSpeed's load_module_only would skip."""
    from ray.train import Checkpoint

    storage = Storage(spec.storage_path)
    location = storage.join(spec.run_id, checkpoint_dir_name(step))
    checkpoint = Checkpoint(path=storage.fs_path(location), filesystem=storage.fs)
    with checkpoint.as_directory() as folder:
        engine.load_checkpoint(folder, tag=f"step_{step}")


EXPORT_DIRNAME = "export"
# The probe row and the engine's top logits on it, kept beside the export so anyone can
# check the export against the trained engine again.
EXPORT_CHECK_NAME = "export_check.pt"


@contextmanager
def export_staging(spec: RunSpec) -> Iterator[Path]:
    """A local folder to write the run's export into, laid out as its folder in storage
    (`export/`, `export_check.pt`): that folder itself on local storage; on an object
    store a temporary one, uploaded when the block ends without error."""
    storage = Storage(spec.storage_path)
    if not storage.remote:
        yield Path(storage.join(spec.run_id))
        return
    with tempfile.TemporaryDirectory(prefix="tuneyard-export-") as tmp:
        yield Path(tmp)
        for name in (EXPORT_DIRNAME, EXPORT_CHECK_NAME):
            storage.put(Path(tmp, name), storage.join(spec.run_id, name))


# The export check's probe: one row of at most this many tokens, so its logits stay small
# whatever the vocabulary (128 x 152k fp32 = 78 MB for Qwen2.5) and the check is cheap.
PROBE_TOKENS = 128
# Per position, the engine's largest logits and their ids are kept; never full logits.
PROBE_TOP_K = 5


def probe_row(batch: dict[str, Any]) -> dict[str, Any]:
    """The first row of a training batch, cut to PROBE_TOKENS: the inputs a user gives
    a model (a packed row's position_ids are training's, not the export's to check)."""
    kept = ("input_ids", "attention_mask", "token_type_ids", "labels")
    row = {k: v[:1] for k, v in batch.items() if k in kept}
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        if key in row:
            row[key] = row[key][:, :PROBE_TOKENS]
    # Method grpo's prompt batches have none: its labels are sampled, not given.
    if "labels" in row and row["labels"].dim() == 2:
        row["labels"] = row["labels"][:, :PROBE_TOKENS]
    return row


@dataclass(slots=True)
class Export:
    path: str
    max_diff: float
    # "hf": a full model `from_pretrained` loads; "adapter": a LoRA adapter for peft.
    kind: CheckpointKind = "hf"


def export_hf_model(
    engine: Any,
    tokenizer: Any,
    spec: RunSpec,
    *,
    rank: int,
    probe: dict[str, Any],
    zero3_config: Any = None,
) -> list[Export]:
    """A folder `from_pretrained` loads: config, safetensors weights and the tokenizer.

    Weights partitioned by ZeRO-3 or sharded by AutoTP are gathered first: every rank
    joins and rank 0 receives full tensors (`save_pretrained` of the module would write
    rank 0's shard only). Then rank 0 loads the export back and checks that its logits on
    a probe batch equal the trained engine's, so a broken export fails the run instead of
    reaching a user. A LoRA run exports by `lora.export`: the adapter (peft's folder), the
    merged model, or both (the adapter in `adapter/`, the merged model beside it).
    """
    import torch

    probe = probe_row(probe)
    engine_logits = _engine_logits(engine, probe)
    if spec.deepspeed.zero_stage == 3 or spec.deepspeed.tensor_parallel_size > 1:
        state = engine._consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if rank == 0 else None
    exports: list[Export] = []
    if rank == 0:
        from worker.model.loading import loading_whole

        storage = Storage(spec.storage_path)
        with export_staging(spec) as stage:
            with loading_whole(zero3_config):
                exports = _write_exports(
                    engine, tokenizer, spec, state, probe, engine_logits, stage / EXPORT_DIRNAME
                )
            top = engine_logits.topk(min(PROBE_TOP_K, engine_logits.shape[-1]), dim=-1)
            torch.save(
                {
                    **{k: v.cpu() for k, v in probe.items()},
                    "top_ids": top.indices,
                    "top_logits": top.values,
                },
                stage / EXPORT_CHECK_NAME,
            )
        for export in exports:
            # Checked where it was written; users see where it is in storage.
            export.path = storage.join(spec.run_id, os.path.relpath(export.path, stage))
            log.info(
                "exported %s to %s (max |logit diff| %.3g)",
                export.kind,
                export.path,
                export.max_diff,
            )
    return exports


def _write_exports(
    engine: Any,
    tokenizer: Any,
    spec: RunSpec,
    state: dict[str, Any] | None,
    probe: dict[str, Any],
    engine_logits: Any,
    out: Path,
) -> list[Export]:
    """Rank 0: each folder the run asks for, each checked against the engine's logits;
    for `both`, the adapter first (the last one becomes the run's model_path)."""
    out.mkdir(parents=True, exist_ok=True)
    if spec.lora is None:
        engine.module.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
        return [Export(str(out), _verify_export(out, spec, probe, engine_logits))]
    from worker.model.lora import merged_model, save_adapter

    assert state is not None
    exports = []
    if spec.lora.export in ("adapter", "both"):
        folder = out / "adapter" if spec.lora.export == "both" else out
        save_adapter(engine.module, state, folder, spec=spec)
        tokenizer.save_pretrained(folder)
        diff = _verify_export(folder, spec, probe, engine_logits, adapter_of=engine.module)
        exports.append(Export(str(folder), diff, kind="adapter"))
    if spec.lora.export in ("merged", "both"):
        dtype = next(iter(state.values())).dtype
        merged_model(engine.module, state, spec, dtype=dtype).save_pretrained(
            out, safe_serialization=True
        )
        tokenizer.save_pretrained(out)
        exports.append(Export(str(out), _verify_export(out, spec, probe, engine_logits)))
    return exports


def _engine_logits(engine: Any, probe: dict[str, Any]) -> Any:
    import torch

    device = next(engine.module.parameters()).device
    engine.eval()
    with torch.no_grad():
        # On the training device: the engine's weights are there (or partitioned).
        batch = {k: v.to(device) for k, v in probe.items() if k != "labels"}
        logits = engine(**batch).logits.float().cpu()
    engine.train()
    return logits


def _verify_export(
    out: Path,
    spec: RunSpec,
    probe: dict[str, Any],
    expected: Any,
    *,
    adapter_of: Any = None,
) -> float:
    """The largest logit difference between the export, loaded as a user would, and the
    engine; raises beyond rounding. An adapter loads onto a fresh base from the run's
    model, in the dtype the adapter was trained in."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = (
        AutoModelForSequenceClassification
        if spec.task == "sequence_classification"
        else AutoModelForCausalLM
    )
    if adapter_of is not None:
        base_config = adapter_of.get_base_model().config
        model = _adapter_model(out, spec, auto, base_config).eval()
    else:
        model = auto.from_pretrained(out).eval()
    with torch.no_grad():
        batch = {k: v.cpu() for k, v in probe.items() if k != "labels"}
        logits = model(**batch).logits.float()
    if logits.shape != expected.shape:
        raise RuntimeError(
            f"export check failed: logits shape {tuple(logits.shape)} != the trained "
            f"engine's {tuple(expected.shape)}"
        )
    mask = probe["attention_mask"].bool()
    diff = (
        float((logits - expected).abs()[mask].max())
        if logits.dim() == 3
        else float((logits - expected).abs().max())
    )
    scale = float(expected.abs().max()) or 1.0
    # fp32 matches to rounding; 16-bit weights and kernels differ a little more.
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    if diff > tolerance * scale:
        raise RuntimeError(
            f"export check failed: the exported model's logits differ from the trained "
            f"engine's by up to {diff:.3g} (tolerance {tolerance * scale:.3g})"
        )
    return diff


def _adapter_model(out: Path, spec: RunSpec, auto: Any, base_config: Any) -> Any:
    from peft import PeftModel
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        dtype = f.get_slice(next(iter(f.keys()))).get_dtype()
    import torch

    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[dtype]
    # The trained base's config: a classification head is sized by the run's labels (its
    # weights come with the adapter, as peft's modules_to_save), not by the checkpoint.
    base = auto.from_pretrained(spec.model, config=base_config, dtype=torch_dtype)
    return PeftModel.from_pretrained(base, out, autocast_adapter_dtype=False)
