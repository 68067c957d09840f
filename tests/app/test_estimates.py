"""The per-worker memory breakdown of /v1/runs/validate: its arithmetic, stage by stage.

The breakdown is checked here on a synthetic model, from its relations (what partitions
over data-parallel ranks, what moves to the host, what the resolved config sizes), and
against a real checkpoint's files; bench/memory_estimate.py compares it with measured
memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.services.estimates import (
    RUNTIME_HOST_BYTES,
    ModelFacts,
    activation_bytes,
    memory_per_worker,
    model_states_bytes,
    trainable_parameters,
)
from contract.deepspeed_config import resolve_deepspeed_config
from contract.run_request import RunDefinition, RunRequest

HIDDEN = 256
# A Llama-like model: 8 layers of 4 attention matrices (h x h), 3 MLP matrices (h x 4h) and
# 2 norms (h); embeddings and head of 1000 x h; a final norm.
LAYER = [HIDDEN * HIDDEN] * 4 + [HIDDEN * 4 * HIDDEN] * 3 + [HIDDEN] * 2
TENSORS = tuple(LAYER * 8 + [1000 * HIDDEN, 1000 * HIDDEN, HIDDEN])
PSI = sum(TENSORS)
NORMS = sum(n for n in TENSORS if n == HIDDEN)


def facts(**overrides: Any) -> ModelFacts:
    fields: dict[str, Any] = {
        "tensor_sizes": TENSORS,
        "checkpoint_bytes": 4 * PSI,  # stored in fp32
        "layers": 8,
        "hidden": HIDDEN,
        "q_dim": HIDDEN,
        "kv_dim": HIDDEN,
        "intermediate": 4 * HIDDEN,
        "vocab": 1000,
        "gated_mlp": True,
        "rotary": True,
    }
    fields.update(overrides)
    return ModelFacts(**fields)


def spec_for(
    *,
    stage: int,
    workers: int = 2,
    precision: str = "fp32",
    gpu: bool = False,
    checkpointing: bool = False,
    **deepspeed: Any,
) -> RunDefinition:
    body = {
        "model": "/models/m",
        "dataset": {"source": "/data/d.jsonl"},
        "training": {
            "batch_size_per_worker": 4,
            "seq_length": 128,
            "gradient_checkpointing": checkpointing,
        },
        "deepspeed": {"zero_stage": stage, "precision": precision, **deepspeed},
        "resources": {"num_workers": workers, "use_gpu": gpu},
    }
    return RunDefinition.model_validate(RunRequest.model_validate(body).worker_fields())


def breakdown(spec: RunDefinition, model: ModelFacts | None = None) -> dict[str, Any]:
    config = resolve_deepspeed_config(spec, bf16_supported=True, hidden_size=HIDDEN)
    return memory_per_worker(spec, model or facts(), config)


def total(line: dict[str, int]) -> int:
    return line["device"] + line["host"]


class TestStages:
    def test_every_line_is_its_own_key_with_device_and_host_bytes(self) -> None:
        memory = breakdown(spec_for(stage=3, gpu=True))
        assert set(memory["lines"]) == {
            "runtime",
            "parameters",
            "persistent_parameters",
            "gathered_parameters",
            "gradients",
            "optimizer_states",
            "optimizer_step_temporaries",
            "fp32_master_copy",
            "zero_buckets",
            "reference_model",
            "generation",
            "judge_models",
            "activations",
            "load_time_peak",
        }
        for name, line in memory["lines"].items():
            assert set(line) == {"device", "host"}, name
            assert all(isinstance(v, int) and v >= 0 for v in line.values()), name
        assert set(memory["formulas"]) >= set(memory["lines"])

    def test_zero0_keeps_everything_whole(self) -> None:
        lines = breakdown(spec_for(stage=0))["lines"]
        assert total(lines["parameters"]) == 4 * PSI
        assert total(lines["gradients"]) == 4 * PSI
        assert total(lines["optimizer_states"]) == 8 * PSI
        assert total(lines["fp32_master_copy"]) == 0  # fp32 training: the parameters are it
        # The engine's all-reduce flattens every gradient into one more buffer.
        assert total(lines["zero_buckets"]) == 4 * PSI
        assert total(lines["gathered_parameters"]) == total(lines["persistent_parameters"]) == 0

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_optimizer_state_and_master_copy_partition_over_data_parallel_ranks(
        self, stage: int
    ) -> None:
        two = breakdown(spec_for(stage=stage, workers=2))["lines"]
        four = breakdown(spec_for(stage=stage, workers=4))["lines"]
        for name in ("optimizer_states", "fp32_master_copy", "optimizer_step_temporaries"):
            assert total(two[name]) == pytest.approx(2 * total(four[name]), abs=2), name
        assert total(two["optimizer_states"]) == pytest.approx(8 * PSI / 2, abs=1)
        # DeepSpeed clones an fp32 master partition even when training in fp32.
        assert total(two["fp32_master_copy"]) == pytest.approx(4 * PSI / 2, abs=1)

    def test_gradients_partition_from_stage_2(self) -> None:
        fp32_step_copy = 4 * PSI / 2  # the partition's gradients flattened to fp32 at the step
        stage1 = total(breakdown(spec_for(stage=1))["lines"]["gradients"])
        stage2 = total(breakdown(spec_for(stage=2))["lines"]["gradients"])
        assert stage1 == pytest.approx(4 * PSI + fp32_step_copy, abs=1)
        assert stage2 == pytest.approx(4 * PSI / 2 + fp32_step_copy, abs=1)

    def test_stage3_partitions_parameters_but_keeps_persistent_ones_whole(self) -> None:
        for workers in (2, 4):
            spec = spec_for(stage=3, workers=workers)
            zero = resolve_deepspeed_config(spec, hidden_size=HIDDEN)["zero_optimization"]
            lines = breakdown(spec)["lines"]
            assert total(lines["parameters"]) == pytest.approx(4 * PSI / workers, abs=1)
            # 10 x hidden: every norm is under the threshold, every matrix over it.
            assert zero["stage3_param_persistence_threshold"] == 10 * HIDDEN
            assert total(lines["persistent_parameters"]) == 4 * NORMS
        stage2 = breakdown(spec_for(stage=2))["lines"]
        assert total(stage2["parameters"]) == 4 * PSI
        assert total(stage2["persistent_parameters"]) == 0

    def test_stage3_keeps_gathered_parameters_up_to_the_whole_model(self) -> None:
        # DeepSpeed's default stage3_max_reuse_distance (1e9 elements) is far above this
        # model: what forward gathers stays until backward uses it again.
        lines = breakdown(spec_for(stage=3))["lines"]
        assert total(lines["gathered_parameters"]) == 4 * (PSI - NORMS)

    def test_a_16bit_run_keeps_an_fp32_master_copy_beside_adams_moments(self) -> None:
        lines = breakdown(spec_for(stage=0, precision="bf16", gpu=True))["lines"]
        assert total(lines["parameters"]) == 2 * PSI
        assert total(lines["fp32_master_copy"]) == 4 * PSI
        assert total(lines["optimizer_states"]) == 8 * PSI
        fp32 = breakdown(spec_for(stage=3, precision="fp32", gpu=True))["lines"]
        bf16 = breakdown(spec_for(stage=3, precision="bf16", gpu=True))["lines"]
        assert total(bf16["parameters"]) * 2 == total(fp32["parameters"])
        assert total(bf16["fp32_master_copy"]) == total(fp32["fp32_master_copy"])


class TestPlacement:
    def test_a_cpu_run_is_all_host_memory(self) -> None:
        memory = breakdown(spec_for(stage=3, offload_optimizer="cpu"))
        assert all(line["device"] == 0 for line in memory["lines"].values())
        assert memory["peak"]["device"] == 0
        assert memory["peak"]["total"] == memory["peak"]["host"]

    def test_a_gpu_run_keeps_everything_but_the_runtime_on_the_device(self) -> None:
        lines = breakdown(spec_for(stage=3, gpu=True))["lines"]
        for name, line in lines.items():
            if name in ("runtime", "load_time_peak"):
                continue
            assert line["host"] == 0, name
        assert lines["runtime"] == {"device": 0, "host": RUNTIME_HOST_BYTES}

    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_the_fused_adamw_a_gpu_run_builds_updates_in_place(self, stage: int) -> None:
        """worker/training/optimizer.py builds torch's fused AdamW on a GPU: no temporaries;
        on CPU the default AdamW's two (square root, then quotient) of what it updates."""
        gpu = breakdown(spec_for(stage=stage, gpu=True))
        assert total(gpu["lines"]["optimizer_step_temporaries"]) == 0
        assert "fused AdamW" in gpu["formulas"]["optimizer_step_temporaries"]
        if stage:
            cpu = breakdown(spec_for(stage=stage))["lines"]["optimizer_step_temporaries"]
            assert total(cpu) == pytest.approx(8 * PSI / 2, abs=2)

    def test_offload_moves_lines_from_device_to_host(self) -> None:
        on_device = breakdown(spec_for(stage=3, gpu=True))["lines"]
        offloaded = breakdown(
            spec_for(stage=3, gpu=True, offload_optimizer="cpu", offload_params="cpu")
        )["lines"]
        for name in ("parameters", "optimizer_states", "fp32_master_copy", "gradients"):
            assert offloaded[name]["device"] == 0, name
            assert offloaded[name]["host"] > 0, name
        assert offloaded["optimizer_states"]["host"] == on_device["optimizer_states"]["device"]
        assert offloaded["parameters"]["host"] == on_device["parameters"]["device"]
        # DeepSpeedCPUAdam updates in place: no temporaries.
        assert total(offloaded["optimizer_step_temporaries"]) == 0
        # Computing still happens on the device.
        assert offloaded["activations"] == on_device["activations"]
        assert offloaded["gathered_parameters"] == on_device["gathered_parameters"]

    def test_offloading_the_optimizer_at_stage_2_leaves_the_parameters_on_the_device(
        self,
    ) -> None:
        lines = breakdown(spec_for(stage=2, gpu=True, offload_optimizer="cpu"))["lines"]
        assert lines["parameters"]["host"] == 0 and lines["parameters"]["device"] > 0
        assert lines["optimizer_states"]["device"] == 0
        assert lines["fp32_master_copy"]["device"] == 0


class TestBuckets:
    def test_bucket_lines_follow_the_resolved_config(self) -> None:
        spec = spec_for(stage=2)
        for hidden in (256, 512):
            config = resolve_deepspeed_config(spec, hidden_size=hidden)
            assert config["zero_optimization"]["reduce_bucket_size"] == hidden * hidden
            lines = memory_per_worker(spec, facts(), config)["lines"]
            assert total(lines["zero_buckets"]) == 4 * hidden * hidden

    def test_overlap_comm_doubles_the_reduce_bucket(self) -> None:
        spec = spec_for(stage=2, gpu=True, precision="bf16")  # overlap_comm follows use_gpu
        config = resolve_deepspeed_config(spec, hidden_size=HIDDEN)
        assert config["zero_optimization"]["overlap_comm"] is True
        lines = memory_per_worker(spec, facts(), config)["lines"]
        assert total(lines["zero_buckets"]) == 2 * 2 * HIDDEN * HIDDEN  # bf16, two buffers

    def test_unsized_buckets_cost_what_deepspeed_defaults_to(self) -> None:
        # A model whose hidden size is unknown: DeepSpeed's 5e8-element reduce bucket.
        spec = spec_for(stage=2)
        config = resolve_deepspeed_config(spec, hidden_size=None)
        assert "reduce_bucket_size" not in config["zero_optimization"]
        lines = memory_per_worker(spec, facts(), config)["lines"]
        assert total(lines["zero_buckets"]) == 4 * 500_000_000


class TestActivations:
    def test_gradient_checkpointing_reduces_activations(self) -> None:
        model = facts(vocab=8)  # the loss's buffers aside
        plain = activation_bytes(spec_for(stage=2), model, width=4)
        checkpointed = activation_bytes(spec_for(stage=2, checkpointing=True), model, width=4)
        assert checkpointed < plain / 4
        breakdown_plain = breakdown(spec_for(stage=2), model)
        assert breakdown_plain["gradient_checkpointing"] is False
        assert "no gradient checkpointing" in breakdown_plain["formulas"]["activations"]
        with_checkpoints = breakdown(spec_for(stage=2, checkpointing=True), model)
        assert with_checkpoints["gradient_checkpointing"] is True
        assert total(with_checkpoints["lines"]["activations"]) == checkpointed

    def test_the_loss_buffers_grow_with_the_vocabulary_not_with_checkpointing(self) -> None:
        small, large = facts(vocab=1000), facts(vocab=101_000)
        tokens = 4 * 128
        for checkpointing in (False, True):
            spec = spec_for(stage=2, checkpointing=checkpointing)
            grown = activation_bytes(spec, large, width=4) - activation_bytes(spec, small, width=4)
            # fp32 logits, log-probabilities and two gradients of batch x seq x vocab.
            assert grown == tokens * 100_000 * 16

    def test_activations_grow_with_the_batch(self) -> None:
        spec = spec_for(stage=2)
        twice = spec.model_copy(
            update={"training": spec.training.model_copy(update={"batch_size_per_worker": 8})}
        )
        assert activation_bytes(twice, facts(), width=4) == 2 * activation_bytes(
            spec, facts(), width=4
        )


class TestPeak:
    def test_training_peak_is_the_sum_of_the_lines_but_the_load(self) -> None:
        memory = breakdown(spec_for(stage=2))
        lines = memory["lines"]
        training = sum(total(v) for k, v in lines.items() if k != "load_time_peak")
        assert memory["peak"]["total"] == max(
            training, RUNTIME_HOST_BYTES + total(lines["load_time_peak"])
        )
        assert memory["peak_phase"] == "training"

    def test_zero3_loads_partitioned_and_rank0_reads_the_checkpoint_in_host_memory(
        self,
    ) -> None:
        load = breakdown(spec_for(stage=3, gpu=True))["lines"]["load_time_peak"]
        assert load["host"] == 4 * PSI  # the checkpoint, read once by rank 0
        # The partition, and initialize's flat copy of it.
        assert load["device"] == pytest.approx(2 * 4 * PSI / 2, abs=1)

    def test_without_zero3_every_rank_builds_the_whole_model(self) -> None:
        load = breakdown(spec_for(stage=0, gpu=True))["lines"]["load_time_peak"]
        assert load == {"device": 4 * PSI, "host": 4 * PSI}
        # A checkpoint in another dtype is converted: read whole besides the new copy.
        converted = breakdown(spec_for(stage=0, gpu=True), facts(checkpoint_bytes=2 * PSI))
        assert converted["lines"]["load_time_peak"]["host"] == 4 * PSI + 2 * PSI

    def test_the_load_can_be_the_peak(self) -> None:
        # A huge checkpoint in another dtype on rank 0 outweighs a small batch's training.
        memory = breakdown(spec_for(stage=3), facts(checkpoint_bytes=200 * PSI))
        assert memory["peak_phase"] == "load"
        assert memory["peak"]["total"] == RUNTIME_HOST_BYTES + total(
            memory["lines"]["load_time_peak"]
        )


class TestModelFacts:
    def test_read_from_a_checkpoints_files(self, tiny_llama_dir: Path) -> None:
        import json

        config = json.loads((tiny_llama_dir / "config.json").read_text())
        model = ModelFacts.read(tiny_llama_dir, config)
        assert model is not None
        assert (model.layers, model.hidden, model.intermediate) == (2, 64, 128)
        assert (model.q_dim, model.kv_dim) == (64, 32)  # 4 heads, 2 key/value heads of 16
        assert model.gated_mlp and model.rotary
        assert model.checkpoint_bytes == 4 * model.parameters  # saved in fp32

    def test_a_folder_without_safetensors_says_nothing(self, tmp_path: Path) -> None:
        assert ModelFacts.read(tmp_path, {"hidden_size": 64, "num_hidden_layers": 2}) is None


class TestLora:
    """Under LoRA only the adapters train: counted from the checkpoint's tensors as peft
    counts the model it builds, and only they carry gradients and optimizer state."""

    @pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["c_attn"]])
    @pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_model_dir"])
    def test_trainable_parameters_are_what_peft_trains(
        self, model_fixture: str, targets: Any, request: pytest.FixtureRequest
    ) -> None:
        import json

        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        folder: Path = request.getfixturevalue(model_fixture)
        config = json.loads((folder / "config.json").read_text())
        model = ModelFacts.read(folder, config)
        assert model is not None
        spec = RunDefinition.model_validate(
            {
                "model": str(folder),
                "dataset": {"source": "/data.jsonl"},
                "lora": {"r": 4, "target_modules": targets},
            }
        )
        try:
            peft_model = get_peft_model(
                AutoModelForCausalLM.from_pretrained(folder),
                LoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM"),
            )
        except ValueError:  # a name the model does not have: peft refuses it
            assert trainable_parameters(spec, model) == 0
            return
        theirs, total = peft_model.get_nb_trainable_parameters()
        assert trainable_parameters(spec, model) == theirs > 0
        assert model.parameters < total  # peft's total includes the adapters

    def test_only_the_adapters_carry_gradients_and_optimizer_state(self) -> None:
        names = [f"model.layers.{i}.self_attn.{m}" for i in range(8) for m in ("q_proj", "v_proj")]
        linears = tuple((n, HIDDEN, HIDDEN) for n in names)
        full = spec_for(stage=2)
        lora = RunDefinition.model_validate(
            {**full.model_dump(), "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}
        )
        adapters = 16 * 8 * (HIDDEN + HIDDEN)
        model = facts(linears=linears)
        assert trainable_parameters(lora, model) == adapters
        config = resolve_deepspeed_config(full, bf16_supported=False, hidden_size=HIDDEN)
        ours = memory_per_worker(lora, model, config)["lines"]
        theirs = memory_per_worker(full, model, config)["lines"]
        # The frozen base is still held whole (ZeRO-2 keeps parameters whole) ...
        assert ours["parameters"] == theirs["parameters"]
        # ... but Adam's moments and the master copy are the adapters' partition only.
        assert ours["optimizer_states"]["host"] == 8 * adapters // 2
        assert ours["fp32_master_copy"]["host"] == 4 * adapters // 2
        states = model_states_bytes(lora, PSI, trainable=adapters)
        assert states["optimizer_states"] == 8 * adapters // 2
        assert states["parameters"] == 4 * PSI


GRPO_GRADER = {
    "type": "string_check",
    "name": "g",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


class TestGrpo:
    def _grpo(self, base: RunDefinition, *, lora: Any = None, **method: Any) -> RunDefinition:
        grpo = {"type": "grpo", "grader": GRPO_GRADER, "max_completion_tokens": 64, **method}
        return RunDefinition.model_validate(
            {
                **base.model_dump(by_alias=True),
                "dataset": {"source": "/data/d.jsonl", "format": "prompt"},
                "method": grpo,
                "lora": lora,
            }
        )

    def test_each_prompt_is_its_groups_rows_of_prompt_and_completion(self) -> None:
        sft, model = spec_for(stage=2), facts()
        grpo = self._grpo(sft, num_generations=4)
        # 4 completions a prompt, each 128 prompt + 64 completion tokens long.
        longer = RunDefinition.model_validate(
            {
                **sft.model_dump(by_alias=True),
                "training": {**sft.training.model_dump(), "seq_length": 192},
            }
        )
        assert activation_bytes(grpo, model, width=4) == 4 * activation_bytes(
            longer, model, width=4
        )

    @pytest.mark.parametrize("stage", [2, 3])
    def test_sampling_holds_the_kv_cache_and_at_zero3_the_gathered_model(self, stage: int) -> None:
        grpo = self._grpo(spec_for(stage=stage), num_generations=4)
        cache = 4 * 4 * (128 + 64) * 8 * 2 * HIDDEN * 4  # rows x tokens x layers x k,v x fp32
        gathered = 4 * PSI // 2 if stage == 3 else 0  # the other rank's half, at 2 workers
        assert total(breakdown(grpo)["lines"]["generation"]) == cache + gathered
        assert total(breakdown(spec_for(stage=stage))["lines"]["generation"]) == 0

    @pytest.mark.parametrize("gpu", [False, True])
    def test_each_judge_counts_once_whole_with_one_batchs_kv_cache(self, gpu: bool) -> None:
        from contract.graders.score_model import BATCH_TOKENS

        grpo = self._grpo(spec_for(stage=3, gpu=gpu))
        config = resolve_deepspeed_config(grpo, bf16_supported=True, hidden_size=HIDDEN)
        judge = facts(layers=2, kv_dim=64)
        memory = memory_per_worker(grpo, facts(), config, judges={"/j": judge, "org/hub": None})
        width = 2 if gpu else 4  # bf16 on a bf16 GPU, fp32 on CPU
        expected = width * (PSI + BATCH_TOKENS * 2 * 2 * 64)
        line = memory["lines"]["judge_models"]
        assert line == ({"device": expected, "host": 0} if gpu else {"device": 0, "host": expected})
        assert "org/hub" in memory["formulas"]["judge_models"]  # named as not counted
        assert total(breakdown(grpo)["lines"]["judge_models"]) == 0

    def test_a_reference_copy_only_with_a_kl_term_and_without_lora(self) -> None:
        sft = spec_for(stage=2)
        assert total(breakdown(self._grpo(sft))["lines"]["reference_model"]) == 0
        with_kl = breakdown(self._grpo(sft, beta=0.04))["lines"]
        assert with_kl["reference_model"] == with_kl["parameters"]
        lora = self._grpo(sft, beta=0.04, lora={"r": 8})
        assert total(breakdown(lora)["lines"]["reference_model"]) == 0


class TestDpo:
    def _dpo(self, base: RunDefinition, **change: Any) -> RunDefinition:
        return RunDefinition.model_validate(
            {**base.model_dump(), "method": {"type": "dpo"}, **change}
        )

    @pytest.mark.parametrize("stage", [2, 3])
    def test_a_full_parameter_run_holds_a_frozen_reference_like_its_parameters(
        self, stage: int
    ) -> None:
        sft = spec_for(stage=stage)
        lines = breakdown(self._dpo(sft))["lines"]
        # Whole at ZeRO-2 (as the parameters are), partitioned at ZeRO-3.
        assert lines["reference_model"] == lines["parameters"]
        assert total(breakdown(sft)["lines"]["reference_model"]) == 0

    def test_under_lora_the_reference_is_the_policy_itself(self) -> None:
        dpo = self._dpo(spec_for(stage=2), lora={"r": 8})
        assert total(breakdown(dpo)["lines"]["reference_model"]) == 0

    def test_each_pair_is_two_rows_of_activations(self) -> None:
        sft, model = spec_for(stage=2), facts()
        dpo = self._dpo(sft)
        assert activation_bytes(dpo, model, width=4) == 2 * activation_bytes(sft, model, width=4)
