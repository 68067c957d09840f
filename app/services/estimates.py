"""What `POST /v1/runs/validate` tells before a run: the resolved config and its cost.

Two memory answers, both per worker:

- `model_states_bytes_per_worker`: the ZeRO paper's model states (Rajbhandari et al., 2020,
  section 3): with Ψ parameters per tensor-parallel shard and Adam, mixed precision keeps
  2Ψ bytes of parameters, 2Ψ of gradients and 12Ψ of optimizer state; fp32 training
  4Ψ + 4Ψ + 8Ψ; stage 1 partitions the optimizer state over the data-parallel ranks, stage 2
  the gradients too, stage 3 the parameters too. Kept as it was for the clients that read it.
- `memory_per_worker`: what a worker really holds at its peak, line by line, each split into
  device (GPU) and host memory: what DeepSpeed 0.19.8 allocates at each stage
  (runtime/zero/stage_1_and_2.py, stage3.py, fp16/fused_optimizer.py, engine.py; see
  `_states`), the ZeRO buckets of the resolved config, the activations of one micro-batch
  (`activation_bytes`), the load-time peak (`_load_time_peak`) and the worker process's own
  fixed cost (`RUNTIME_HOST_BYTES`, measured). `peak` is the larger of training (the sum of
  every line but the load: see `memory_per_worker`) and loading (runtime + load). On a CPU
  run everything is host memory; on GPU the offloaded lines are.

Everything here is read from files (config.json, the safetensors headers): the service
never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.services.rules.adapter_sizes import Linear, adapter_parameters, linear_weights
from app.services.rules.model_files import checkpoint_parameters, safetensors_headers
from app.services.rules.run_rules import CheckedRequest
from contract.deepspeed_config import (
    global_batch_size,
    hidden_size_of,
    resolve_deepspeed_config,
    resolve_precision,
)
from contract.graders.score_model import BATCH_TOKENS
from contract.run_request import RunDefinition
from contract.seq_length import completion_room

# A GPU run with precision=auto resolves on the cluster; validation assumes a bf16 GPU.
ASSUME_BF16_GPU = True

MIB = 1 << 20
# The host memory of one worker process before its model counts: Ray's worker, torch,
# DeepSpeed, transformers and datasets loaded, the gloo process group, DeepSpeed's
# communication workspace, thread pools and the data loader. Measured, not derived:
# `python -m bench.memory_estimate --calibrate` found 559-604 MiB per rank at ZeRO 0-3 (peak
# RSS of a rank training a 58k-parameter GPT-2 on CPU, less its 7 MiB of model lines; torch
# 2.13, DeepSpeed 0.19.8, Ray 2.60; BENCHMARKS.md). A GPU rank also holds its CUDA context
# and kernels on the device (some hundreds of MiB), not measured here.
RUNTIME_HOST_BYTES = 608 * MIB

# DeepSpeed 0.19.8's own values where the resolved config leaves a size out (a model whose
# hidden size the service cannot read).
_DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}
# ZeRO-0: engine.allreduce_gradients flattens the gradients into buckets of this many
# elements (engine.py MEMORY_OPT_ALLREDUCE_SIZE) before all-reducing them.
_ZERO0_ALLREDUCE_ELEMENTS = 500_000_000
# Adam's two moments, fp32, per parameter.
_ADAM_BYTES = 8
_FP32 = 4


def resolve(checked: CheckedRequest) -> dict[str, Any]:
    spec, plan = checked.resolved, checked.plan
    return {
        # The request's, or where it is unset the one the worker will choose (null: chosen
        # from data the service cannot read).
        "seq_length": spec.training.seq_length or checked.seq_length,
        "deepspeed_config": _deepspeed_config(checked),
        "precision": resolve_precision(spec, bf16_supported=ASSUME_BF16_GPU),
        "data_parallel_size": spec.data_parallel_size,
        "tensor_parallel_size": spec.deepspeed.tensor_parallel_size,
        "global_batch_size": global_batch_size(spec),
        "steps_per_epoch": plan.steps_per_epoch if plan else None,
        "total_steps": plan.total_steps if plan else spec.training.max_steps,
    }


def _deepspeed_config(checked: CheckedRequest) -> dict[str, Any]:
    """The config the worker builds: bucket sizes from the model's hidden size, as the
    worker reads it (worker.training.loop.model_hidden_size); unknown for a hub id."""
    hidden = hidden_size_of(checked.model_config) if checked.model_config is not None else None
    return resolve_deepspeed_config(
        checked.resolved, bf16_supported=ASSUME_BF16_GPU, hidden_size=hidden
    )


def estimate(checked: CheckedRequest) -> dict[str, Any]:
    spec = checked.costed
    model = parameters = None
    if checked.model_config is not None:
        folder = Path(spec.model)
        # One read of the safetensors headers; the count alone where the layout is unknown.
        model = ModelFacts.read(folder, checked.model_config)
        parameters = model.parameters if model else checkpoint_parameters(folder)
    trainable = trainable_parameters(spec, model) if model else None
    if spec.lora is None:
        trainable = parameters
    return {
        "parameters": parameters,
        # Full fine-tuning trains them all; LoRA only its adapters (the base is frozen),
        # and gradients, optimizer state and master copy are the adapters' alone.
        "trainable_parameters": trainable,
        "model_states_bytes_per_worker": (
            model_states_bytes(spec, parameters, trainable=trainable)
            if parameters is not None and trainable is not None
            else None
        ),
        "memory_per_worker": (
            memory_per_worker(spec, model, _deepspeed_config(checked), judges=_judges(checked))
            if model
            else None
        ),
        "tokens_per_step": global_batch_size(spec) * _rows_per_example(spec) * _row_tokens(spec),
        "method": "model_states_bytes_per_worker: ZeRO paper formulas for parameters, "
        "gradients and Adam state of the parameters in the model's safetensors files. "
        "memory_per_worker: what DeepSpeed 0.19.8 allocates at this stage, the ZeRO buckets "
        "of the resolved config, one micro-batch's activations, the load-time peak and a "
        "measured per-process runtime, each line split into device and host memory; its "
        "`formulas` say how each line is counted",
    }


def _judges(checked: CheckedRequest) -> dict[str, ModelFacts | None]:
    """Each score_model grader's model, once, with what its files say (None: a hub id or an
    export in object storage, whose weights the service does not read)."""
    judges: dict[str, ModelFacts | None] = {}
    for judge in checked.judges:
        if judge.model not in judges:
            folder = judge.folder
            facts = None
            if folder is not None and judge.config is not None:
                facts = ModelFacts.read(folder, judge.config)
            judges[judge.model] = facts
    return judges


def model_states_bytes(
    spec: RunDefinition, parameters: int, *, trainable: int | None = None
) -> dict[str, int]:
    """`trainable`: the parameters with gradients and optimizer state (all by default)."""
    ds = spec.deepspeed
    precision = resolve_precision(spec, bf16_supported=ASSUME_BF16_GPU)
    psi = parameters / ds.tensor_parallel_size
    psi_t = (parameters if trainable is None else trainable) / ds.tensor_parallel_size
    dp = spec.data_parallel_size
    if precision == "fp32":
        params, grads, optim = 4 * psi, 4 * psi_t, 8 * psi_t
    else:
        params, grads, optim = 2 * psi, 2 * psi_t, 12 * psi_t
    stage = ds.zero_stage
    if stage >= 1:
        optim /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        params /= dp
    offloaded = 0.0
    if ds.offload_optimizer == "cpu":
        offloaded += optim
    if ds.offload_params == "cpu":
        offloaded += params
    total = params + grads + optim
    return {
        "parameters": int(params),
        "gradients": int(grads),
        "optimizer_states": int(optim),
        "total": int(total),
        "on_device": int(total - offloaded),
        "offloaded_to_cpu": int(offloaded),
    }


# --- what the estimate reads from a local model ----------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """A local model's shapes, from its config.json and its safetensors headers."""

    tensor_sizes: tuple[int, ...]  # elements of every tensor in the checkpoint
    checkpoint_bytes: int  # the tensors' bytes as stored (their own dtype)
    layers: int
    hidden: int
    q_dim: int  # attention heads x head size
    kv_dim: int  # key/value heads x head size (smaller than q_dim with grouped queries)
    intermediate: int
    vocab: int
    gated_mlp: bool  # SwiGLU-style MLP (Llama, Qwen, Mistral, Gemma): three matrices
    rotary: bool  # rotary position embeddings, applied to queries and keys
    linears: tuple[Linear, ...] = ()  # the 2-d weights, by module name (LoRA's targets)

    @property
    def parameters(self) -> int:
        return sum(self.tensor_sizes)

    @classmethod
    def read(cls, folder: Path, config: dict[str, Any]) -> ModelFacts | None:
        """None when the files do not say enough (no safetensors, an unknown layout)."""
        headers = safetensors_headers(folder)
        text = config.get("text_config")
        cfg = text if isinstance(text, dict) else config
        hidden = hidden_size_of(cfg)
        layers = _first_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _first_int(cfg, "num_attention_heads", "n_head")
        vocab = _first_int(cfg, "vocab_size")
        if not headers or not hidden or not layers or not heads or not vocab:
            return None
        head_dim = _first_int(cfg, "head_dim") or hidden // heads
        kv_heads = _first_int(cfg, "num_key_value_heads") or heads
        intermediate = _first_int(cfg, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
        sizes: list[int] = []
        stored = 0
        for header in headers:
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                sizes.append(math.prod(entry["shape"]))
                start, end = entry["data_offsets"]
                stored += int(end) - int(start)
        activation = str(cfg.get("hidden_act") or cfg.get("activation_function") or "")
        model_type = str(cfg.get("model_type") or "")
        return cls(
            tensor_sizes=tuple(sizes),
            linears=linear_weights(headers),
            checkpoint_bytes=stored,
            layers=layers,
            hidden=hidden,
            q_dim=heads * head_dim,
            kv_dim=kv_heads * head_dim,
            intermediate=intermediate,
            vocab=vocab,
            gated_mlp=activation in ("silu", "swish") or model_type.startswith("gemma"),
            rotary=any(key.startswith("rope") or key.startswith("rotary") for key in cfg),
        )


def trainable_parameters(spec: RunDefinition, model: ModelFacts) -> int:
    """What trains: every parameter, or under LoRA the adapters alone."""
    if spec.lora is None:
        return model.parameters
    return adapter_parameters(model.linears, spec.lora)


def _first_int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# --- the per-worker breakdown ---------------------------------------------------------------


Line = dict[str, int]  # {"device": bytes, "host": bytes}
_PLACES = ("device", "host")


def memory_per_worker(
    spec: RunDefinition,
    model: ModelFacts,
    ds_config: dict[str, Any],
    *,
    judges: Mapping[str, ModelFacts | None] | None = None,
) -> dict[str, Any]:
    """Every line in bytes per worker, device and host apart, and the peak.

    The training peak is the sum of the lines, not the largest moment of any one phase:
    what activations and gathered parameters free in backward stays with the allocator
    (glibc's heap on CPU, PyTorch's cache on GPU), and the optimizer step's large
    buffers are new allocations on top of it. On CPU this sum lands within 0.8-1.25 of
    each rank's measured peak RSS at ZeRO 0-3 (bench/memory_estimate.py, BENCHMARKS.md).
    """
    ds = spec.deepspeed
    on_gpu = spec.resources.use_gpu
    precision = resolve_precision(spec, bf16_supported=ASSUME_BF16_GPU)
    width = _FP32 if precision == "fp32" else 2  # bytes of a parameter as trained
    s = _states(spec, model, ds_config, width=width)
    optimizer_offloaded = ds.offload_optimizer == "cpu"

    def line(nbytes: float, *, offloaded: bool = False) -> Line:
        if on_gpu and not offloaded:
            return {"device": int(nbytes), "host": 0}
        return {"device": 0, "host": int(nbytes)}

    lines: dict[str, Line] = {
        "runtime": {"device": 0, "host": RUNTIME_HOST_BYTES},
        "parameters": line(s.parameters, offloaded=ds.offload_params == "cpu"),
        "persistent_parameters": line(s.persistent),
        "gathered_parameters": line(s.gathered),
        "gradients": _sum(line(s.gradients), line(s.offloaded_gradients, offloaded=True)),
        "optimizer_states": line(s.optimizer, offloaded=optimizer_offloaded),
        "optimizer_step_temporaries": line(s.step_temporaries, offloaded=optimizer_offloaded),
        "fp32_master_copy": line(s.master, offloaded=optimizer_offloaded),
        "zero_buckets": line(s.buckets),
        "reference_model": line(
            reference_model_bytes(spec, model, width=width),
            offloaded=ds.offload_params == "cpu",
        ),
        "generation": line(generation_bytes(spec, model, width=width)),
        "judge_models": line(judge_bytes(judges or {}, on_gpu=on_gpu)),
        "activations": line(activation_bytes(spec, model, width=width)),
        "load_time_peak": _load_time_peak(spec, model, width=width),
    }
    training = {p: sum(v[p] for k, v in lines.items() if k != "load_time_peak") for p in _PLACES}
    loading = _sum(lines["runtime"], lines["load_time_peak"])
    peak = {p: max(training[p], loading[p]) for p in _PLACES}
    peak["total"] = max(sum(training.values()), sum(loading.values()))
    return {
        "lines": lines,
        "peak": peak,
        "peak_phase": "load" if sum(loading.values()) > sum(training.values()) else "training",
        "precision": precision,
        "gradient_checkpointing": spec.training.gradient_checkpointing,
        "formulas": {
            **_formulas(spec, model, ds_config, width=width),
            "judge_models": _judge_formula(judges or {}, on_gpu=on_gpu),
        },
    }


def _sum(*lines: Line) -> Line:
    return {place: sum(line[place] for line in lines) for place in _PLACES}


@dataclass(frozen=True, slots=True)
class _States:
    """What DeepSpeed keeps beside the activations, in bytes per rank."""

    parameters: float
    persistent: float
    gathered: float
    gradients: float
    offloaded_gradients: float  # with offload_optimizer: gradients DeepSpeed keeps on the host
    optimizer: float
    step_temporaries: float
    master: float
    buckets: float


def _zero_value(zero: dict[str, Any], key: str) -> int:
    return int(zero.get(key, _DEEPSPEED_DEFAULTS[key]))


def _states(
    spec: RunDefinition, model: ModelFacts, ds_config: dict[str, Any], *, width: int
) -> _States:
    """What DeepSpeed 0.19.8 keeps per rank at each stage. Ψ: the parameters of this rank's
    tensor-parallel shard; dp: the data-parallel size; w: the trained dtype's bytes.

    - ZeRO-0 (engine.py): the module's parameters (wΨ) and gradients (wΨ); the
      all-reduce flattens the gradients into one more buffer of up to 5e8 elements
      (MEMORY_OPT_ALLREDUCE_SIZE); Adam 8Ψ. 16-bit runs go through FP16_Optimizer
      (fp16/fused_optimizer.py): an fp32 master copy (4Ψ) and fp32 gradients for it (4Ψ).
    - ZeRO-1/2 (stage_1_and_2.py): the parameters whole, in one flat buffer (wΨ); an fp32
      clone of this rank's partition as master weights, even when training in fp32
      (4Ψ/dp); Adam 8Ψ/dp. Stage 1 keeps whole gradients (wΨ), stage 2 its partition
      (wΨ/dp); both flatten the partition's gradients to fp32 at the step (4Ψ/dp). The
      reduce bucket holds reduce_bucket_size elements, two with overlap_comm; the
      all-gather works in place in the flat buffer and needs none.
    - ZeRO-3 (stage3.py): the parameter partition (wΨ/dp), parameters up to
      stage3_param_persistence_threshold elements whole on every rank, the gradient
      partition (wΨ/dp) and its fp32 flattened copy at the step (4Ψ/dp), Adam 8Ψ/dp, and an
      fp32 master copy of the partition (4Ψ/dp) even in fp32: `_create_fp32_partitions`
      means to share the partition then, but compares a torch.device with a device name,
      which is never equal. Gathered parameters: a module's parameters are released
      after its forward only if not used again within stage3_max_reuse_distance elements
      of the trace (default 1e9), and backward uses them again, so the last
      reuse_distance / 2 elements of the model stay gathered from forward into backward,
      besides the prefetch bucket and the module being computed.
    - On CPU torch's AdamW makes temporaries as large as what it updates, two per tensor
      (the variance's square root, then its quotient); ZeRO 1-3 and FP16_Optimizer hand it
      one flat partition per group. On a GPU the worker builds the fused AdamW
      (worker/training/optimizer.py), one kernel that updates in place
      (torch/optim/adam.py `_fused_adam`), and DeepSpeedCPUAdam (offload_optimizer)
      updates in place too: no temporaries.
    - offload_optimizer moves the master copy, Adam and the fp32 gradients to the host,
      offload_params the parameter partition.
    """
    ds = spec.deepspeed
    zero = ds_config["zero_optimization"]
    stage, dp, tp = ds.zero_stage, spec.data_parallel_size, ds.tensor_parallel_size
    psi = model.parameters / tp
    # What trains (LoRA: the adapters; the frozen base has no gradients, optimizer state
    # or master copy, and ZeRO-1/2 flatten only the trainable parameters' groups).
    psi_t = trainable_parameters(spec, model) / tp
    mixed = width < _FP32
    offload = ds.offload_optimizer == "cpu"
    temporaries_per_element = 0 if spec.resources.use_gpu else 2 * _FP32
    largest = min(max(model.tensor_sizes) / tp, psi_t)

    if stage == 0:
        # Plain AdamW on the module's tensors (fp32), or on FP16_Optimizer's flat master.
        flat = mixed
        return _States(
            parameters=width * psi,
            persistent=0,
            gathered=0,
            gradients=width * psi_t + (_FP32 * psi_t if mixed else 0),
            offloaded_gradients=0,
            optimizer=_ADAM_BYTES * psi_t,
            step_temporaries=temporaries_per_element * (psi_t if flat else largest),
            master=_FP32 * psi_t if mixed else 0,
            buckets=width * min(psi_t, _ZERO0_ALLREDUCE_ELEMENTS),
        )
    partition = psi / dp
    partition_t = psi_t / dp
    fp32_grads = _FP32 * partition_t
    step_temporaries = 0 if offload else temporaries_per_element * partition_t
    reduce_bucket = width * _zero_value(zero, "reduce_bucket_size")
    if stage in (1, 2):
        return _States(
            parameters=width * psi,
            persistent=0,
            gathered=0,
            gradients=width * (psi_t if stage == 1 else partition_t)
            + (0 if offload else fp32_grads),
            offloaded_gradients=fp32_grads if offload else 0,
            optimizer=_ADAM_BYTES * partition_t,
            step_temporaries=step_temporaries,
            master=_FP32 * partition_t,
            buckets=reduce_bucket * (2 if zero.get("overlap_comm") else 1),
        )
    threshold = _zero_value(zero, "stage3_param_persistence_threshold")
    persistent = sum(n for n in model.tensor_sizes if n <= threshold) / tp
    held_into_backward = _zero_value(zero, "stage3_max_reuse_distance") / 2
    in_flight = _zero_value(zero, "stage3_prefetch_bucket_size") + largest
    return _States(
        parameters=width * partition,
        persistent=width * persistent,
        gathered=width * min(psi - persistent, held_into_backward + in_flight),
        # With offload_optimizer the gradient partition itself lives on the host too.
        gradients=0 if offload else width * partition_t + fp32_grads,
        offloaded_gradients=width * partition_t + fp32_grads if offload else 0,
        optimizer=_ADAM_BYTES * partition_t,
        step_temporaries=step_temporaries,
        master=_FP32 * partition_t,
        buckets=reduce_bucket,
    )


def keeps_reference_copy(spec: RunDefinition) -> bool:
    """DPO, and GRPO with a KL term, compare with the starting model: a copy of it unless
    LoRA's adapters can be switched off instead (worker/training/dpo.py build_reference)."""
    method = spec.method
    compares = method.type == "dpo" or (method.type == "grpo" and method.beta > 0)
    return compares and spec.lora is None


def reference_model_bytes(spec: RunDefinition, model: ModelFacts, *, width: int) -> int:
    """The reference (worker/training/dpo.py): under LoRA the policy with its adapters disabled,
    nothing more; otherwise a frozen copy in its own inference engine, partitioned like the
    policy's parameters at ZeRO-3 and whole on every rank at other stages (it has no
    gradients or optimizer state for ZeRO-1/2 to shard)."""
    if not keeps_reference_copy(spec):
        return 0
    psi = model.parameters / spec.deepspeed.tensor_parallel_size
    if spec.deepspeed.zero_stage == 3:
        psi /= spec.data_parallel_size
    return int(width * psi)


def generation_bytes(spec: RunDefinition, model: ModelFacts, *, width: int) -> int:
    """GRPO's sampling (worker/training/generation.py): the KV cache of a micro-batch's rows at
    their full length (keys and values, kv_dim each, per layer), and under ZeRO-3 the rest
    of the model gathered onto every rank for the step's generation."""
    if spec.method.type != "grpo":
        return 0
    cache = rows_per_micro_batch(spec) * _row_tokens(spec) * model.layers * 2 * model.kv_dim
    gathered = 0.0
    if spec.deepspeed.zero_stage == 3:
        dp = spec.data_parallel_size
        gathered = model.parameters * (1 - 1 / dp)
    return int(width * (cache + gathered))


def _judge_width(*, on_gpu: bool) -> int:
    # worker/training/judge.py: bf16 on a GPU with native bf16 (validation assumes one), else fp32.
    return 2 if on_gpu and ASSUME_BF16_GPU else _FP32


def judge_bytes(judges: Mapping[str, ModelFacts | None], *, on_gpu: bool) -> int:
    """The score_model graders' judges (worker/training/judge.py): each model whole on every rank,
    beside the policy, and the KV cache of one batch of its answers (BATCH_TOKENS prompt
    and answer tokens at most); judges whose files the service cannot read count 0."""
    width = _judge_width(on_gpu=on_gpu)
    return sum(
        width * (facts.parameters + BATCH_TOKENS * facts.layers * 2 * facts.kv_dim)
        for facts in judges.values()
        if facts is not None
    )


def _judge_formula(judges: Mapping[str, ModelFacts | None], *, on_gpu: bool) -> str:
    if not judges:
        return "none: only a score_model grader loads a judge model"
    width = _judge_width(on_gpu=on_gpu)
    counted = [
        f"{name}: {width} bytes x ({facts.parameters:,} parameters + {BATCH_TOKENS:,} tokens "
        f"x layers {facts.layers} x 2 x kv {facts.kv_dim})"
        for name, facts in judges.items()
        if facts is not None
    ]
    unread = [name for name, facts in judges.items() if facts is None]
    text = "each score_model grader's judge, whole on every rank, and one batch's KV cache"
    if counted:
        text += ": " + "; ".join(counted)
    if unread:
        text += f"; not counted (files the service does not read): {', '.join(unread)}"
    return text


def _rows_per_example(spec: RunDefinition) -> int:
    """Sequences per example: a DPO pair's two answers, a GRPO prompt's completions."""
    method = spec.method
    if method.type == "dpo":
        return 2
    if method.type == "grpo":
        return method.num_generations
    return 1


def rows_per_micro_batch(spec: RunDefinition) -> int:
    """Sequences in one forward: DPO scores each pair's chosen and rejected answers in one
    batch of twice the pairs (worker/data/preference.py); GRPO each prompt's completions."""
    return spec.training.batch_size_per_worker * _rows_per_example(spec)


def _row_tokens(spec: RunDefinition) -> int:
    """A row's longest length: seq_length, and a GRPO completion after its prompt."""
    return _seq_length(spec) + completion_room(spec)


def activation_bytes(spec: RunDefinition, model: ModelFacts, *, width: int) -> int:
    """The activations one micro-batch keeps for backward, with the loss's buffers.

    Per token and decoder layer, in elements of the trained dtype (sdpa attention, whose
    memory grows with the sequence, not its square; tensor-parallel ranks split what lies
    between the projections):
    - the two norms: their input and output each, 4h;
    - attention: queries, keys and values (q + 2kv), with rotary embeddings their rotated
      halves and results for queries and keys (2(q + kv)), the attention output and its
      re-laid copy that the output projection reads (2q);
    - MLP: gate, activation, up and their product (4i) when gated, else the two sides of
      the activation (2i).
    With gradient checkpointing (one checkpoint per decoder layer) only each layer's input
    (h) is kept, and one layer's full activations are rebuilt at a time during backward.
    The final norm adds 2h. A causal LM's loss adds, per token and vocabulary entry: the
    logits (w), their fp32 copy in 16-bit runs (4), the fp32 log-probabilities (4) and the
    two fp32 gradients of the same shape in backward (8).
    """
    tr, tp = spec.training, spec.deepspeed.tensor_parallel_size
    m = model
    attention = m.q_dim + 2 * m.kv_dim + (2 * (m.q_dim + m.kv_dim) if m.rotary else 0)
    attention += 2 * m.q_dim
    mlp = (4 if m.gated_mlp else 2) * m.intermediate
    per_layer = 4 * m.hidden + (attention + mlp) / tp
    # Checkpointing keeps each layer's input and rebuilds one layer at a time.
    kept = m.layers * m.hidden + per_layer if tr.gradient_checkpointing else m.layers * per_layer
    tokens = rows_per_micro_batch(spec) * _row_tokens(spec)
    hidden_states = tokens * width * (kept + 2 * m.hidden)
    logits = tokens * m.vocab * _logit_bytes(width) if spec.task == "causal_lm" else 0
    return int(hidden_states + logits)


def _seq_length(spec: RunDefinition) -> int:
    # Costs are counted on CheckedRequest.costed, whose seq_length is always set.
    assert spec.training.seq_length is not None
    return spec.training.seq_length


def _logit_bytes(width: int) -> int:
    """Per token and vocabulary entry: logits, their fp32 copy (16-bit), fp32 log-probs and
    two fp32 gradients."""
    return width + (_FP32 if width < _FP32 else 0) + 3 * _FP32


def _load_time_peak(spec: RunDefinition, model: ModelFacts, *, width: int) -> Line:
    """The most a worker holds from `from_pretrained` to the end of `deepspeed.initialize`.

    transformers 5 maps a safetensors checkpoint into memory: a tensor stored in the
    trained dtype becomes a parameter without a copy (its pages count once read), one
    stored in another dtype is converted into a new one, the mapping read whole.
    - ZeRO-3 creates the model partitioned (worker.model.loading keeps transformers'
      HfDeepSpeedConfig alive, so `from_pretrained` runs inside `deepspeed.zero.Init`):
      each rank builds its partition (wΨ/dp), and rank 0, the worst, reads the whole
      checkpoint in host memory; `initialize` then copies the partitions into one flat
      buffer (one more partition, briefly).
    - Otherwise every rank holds the whole model (wΨ, in host memory first), and
      `deepspeed.initialize` moves it to the device, where ZeRO-1/2 flatten it into a
      second buffer before freeing the first and clone the fp32 master partition
      (2wΨ + 4Ψ/dp).
    """
    ds = spec.deepspeed
    on_gpu = spec.resources.use_gpu
    tp, dp = ds.tensor_parallel_size, spec.data_parallel_size
    whole = width * model.parameters
    converted = model.checkpoint_bytes != whole
    if ds.zero_stage == 3:
        partition = whole / tp / dp
        device, host = 2 * partition, float(model.checkpoint_bytes)
        if not on_gpu or ds.offload_params == "cpu":
            host, device = host + device, 0
        return {"device": int(device), "host": int(host)}
    host = whole + (model.checkpoint_bytes if converted else 0)
    on_device = whole / tp
    if ds.zero_stage in (1, 2):
        on_device = 2 * on_device + _FP32 * model.parameters / tp / dp
    if on_gpu:
        return {"device": int(on_device), "host": int(host)}
    return {"device": 0, "host": int(max(host, on_device))}


def _formulas(
    spec: RunDefinition, model: ModelFacts, ds_config: dict[str, Any], *, width: int
) -> dict[str, str]:
    """How each line was counted, in words, for the request at hand."""
    tr, ds = spec.training, spec.deepspeed
    zero = ds_config["zero_optimization"]
    stage = ds.zero_stage
    psi = "Ψ" if ds.tensor_parallel_size == 1 else f"Ψ/{ds.tensor_parallel_size}"
    per_dp = f"{psi}/dp" if stage >= 1 else psi
    on_gpu = spec.resources.use_gpu
    if stage == 0:
        buckets = "the all-reduce's flat copy of the gradients, up to 5e8 elements"
    elif stage in (1, 2):
        buckets = f"reduce bucket of {_zero_value(zero, 'reduce_bucket_size'):,} elements" + (
            " x 2 (overlap_comm)" if zero.get("overlap_comm") else ""
        )
    else:
        buckets = f"reduce bucket of {_zero_value(zero, 'reduce_bucket_size'):,} elements"
    checkpointing = (
        "gradient checkpointing: each layer's input (h) plus one layer rebuilt in backward"
        if tr.gradient_checkpointing
        else "no gradient checkpointing: every layer's activations"
    )
    loss = (
        f"; the loss: batch x seq_length x vocab ({model.vocab:,}) x {_logit_bytes(width)} "
        "bytes (logits, fp32 log-probabilities and two fp32 gradients)"
        if spec.task == "causal_lm"
        else ""
    )
    return {
        "runtime": "measured, not derived: a worker process's peak RSS training a "
        "58k-parameter model on CPU (bench/memory_estimate.py --calibrate); host memory",
        "parameters": f"{width} bytes x {psi}"
        + (" / dp (this rank's partition)" if stage == 3 else " (whole)"),
        "persistent_parameters": (
            f"parameters of at most {_zero_value(zero, 'stage3_param_persistence_threshold'):,} "
            "elements (stage3_param_persistence_threshold), whole on every rank"
            if stage == 3
            else "ZeRO-3 only"
        ),
        "gathered_parameters": (
            "parameters gathered whole for computing: the last "
            f"stage3_max_reuse_distance / 2 ({_zero_value(zero, 'stage3_max_reuse_distance'):,}"
            " / 2) elements stay from forward into backward, plus the prefetch bucket "
            f"({_zero_value(zero, 'stage3_prefetch_bucket_size'):,}) and the largest "
            f"parameter ({max(model.tensor_sizes):,}); at most the whole model"
            if stage == 3
            else "ZeRO-3 only"
        ),
        "gradients": {
            0: f"{width} bytes x {psi} (whole)"
            + (f" + 4 bytes x {psi} fp32 for the master copy" if width < _FP32 else ""),
            1: f"{width} bytes x {psi} (whole) + 4 bytes x {psi}/dp fp32 at the step",
            2: f"{width} bytes x {psi}/dp + 4 bytes x {psi}/dp fp32 at the step",
            3: f"{width} bytes x {psi}/dp + 4 bytes x {psi}/dp fp32 at the step",
        }[stage]
        + ("; host memory with offload_optimizer" if ds.offload_optimizer == "cpu" else ""),
        "optimizer_states": f"Adam's momentum and variance, 8 bytes x {per_dp}",
        "optimizer_step_temporaries": (
            "none: DeepSpeedCPUAdam updates in place"
            if ds.offload_optimizer == "cpu"
            else "none: torch's fused AdamW updates in place"
            if on_gpu
            else "torch AdamW's update: 8 bytes x "
            + (per_dp if stage >= 1 or width < _FP32 else "the largest tensor")
            + " (square root, then quotient)"
        ),
        "fp32_master_copy": {
            0: "4 bytes x Ψ in 16-bit (FP16_Optimizer), none in fp32",
            1: f"4 bytes x {psi}/dp: DeepSpeed clones its partition, even in fp32",
            2: f"4 bytes x {psi}/dp: DeepSpeed clones its partition, even in fp32",
            3: f"4 bytes x {psi}/dp: DeepSpeed clones its partition, even in fp32",
        }[stage],
        "zero_buckets": buckets,
        "reference_model": (
            "a frozen copy of the starting model, "
            + (
                f"{width} bytes x {psi}/dp (partitioned)"
                if stage == 3
                else f"{width} bytes x {psi}"
            )
            if keeps_reference_copy(spec)
            else "none: only DPO and GRPO with beta > 0, without LoRA, keep a reference copy"
        ),
        "generation": (
            f"GRPO's sampling: the KV cache, rows {rows_per_micro_batch(spec)} x "
            f"(seq_length + max_completion_tokens) {_row_tokens(spec)} tokens x layers "
            f"{model.layers} x 2 x kv {model.kv_dim} elements of {width} bytes"
            + (
                f", and the gathered model, {width} bytes x {psi} x (1 - 1/dp)"
                if stage == 3
                else ""
            )
            if spec.method.type == "grpo"
            else "none: only GRPO samples"
        ),
        "trainable_parameters": (
            "LoRA: gradients, optimizer states, their temporaries and the master copy count "
            "the adapters' parameters only (r x (in + out) per targeted layer), not Ψ"
            if spec.lora is not None
            else "every parameter trains"
        ),
        "activations": f"{checkpointing}; rows {rows_per_micro_batch(spec)} x "
        f"{_row_tokens(spec)} tokens; per token and layer 4h + attention (q + 2kv"
        + (" + rotary 2(q + kv)" if model.rotary else "")
        + f" + output 2q) + MLP ({4 if model.gated_mlp else 2}i) elements of {width} bytes"
        + loss,
        "load_time_peak": (
            "ZeRO-3 creates the model partitioned: rank 0 reads the whole checkpoint "
            f"({model.checkpoint_bytes:,} bytes) in host memory while each rank builds its "
            "partition; initialize copies the partitions into one flat buffer"
            if stage == 3
            else "every rank builds the whole model in the trained dtype"
            + (
                "; initialize flattens it into a second buffer and clones the fp32 master partition"
                if stage in (1, 2)
                else ""
            )
        ),
        "peak": "training: the sum of every line but load_time_peak; loading: runtime + "
        "load_time_peak; peak: the larger",
    }
