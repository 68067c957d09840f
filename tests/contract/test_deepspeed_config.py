"""contract/deepspeed_config.py: the DeepSpeed config a run trains with."""

from __future__ import annotations

from typing import Any

import pytest

from contract.deepspeed_config import (
    global_batch_size,
    hidden_size_of,
    resolve_deepspeed_config,
    resolve_precision,
    torch_dtype_name,
)
from contract.run_request import RunSpec


def make_spec(**groups: dict[str, Any]) -> RunSpec:
    data: dict[str, Any] = {
        "run_id": "run_ds",
        "attempt": 1,
        "storage_path": "/srv/storage",
        "model": "/models/m",
        "dataset": {"source": "/data/d.jsonl"},
    }
    data.update(groups)
    return RunSpec.model_validate(data)


def offloads_for(stage: int) -> dict[str, Any]:
    """Every offload the service allows at this stage."""
    return {
        "zero_stage": stage,
        "offload_optimizer": "cpu" if stage >= 1 else "none",
        "offload_params": "cpu" if stage == 3 else "none",
    }


@pytest.fixture
def deepspeed_config_cls(monkeypatch: pytest.MonkeyPatch) -> Any:
    """DeepSpeed's own config parser, on its CPU accelerator."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


class TestZeroStages:
    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_stage_without_offload(self, stage: int) -> None:
        zero = resolve_deepspeed_config(make_spec(deepspeed={"zero_stage": stage}))[
            "zero_optimization"
        ]

        assert zero["stage"] == stage
        assert "offload_optimizer" not in zero
        assert "offload_param" not in zero

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_offload_optimizer_to_cpu(self, stage: int) -> None:
        spec = make_spec(deepspeed={"zero_stage": stage, "offload_optimizer": "cpu"})
        zero = resolve_deepspeed_config(spec)["zero_optimization"]

        assert zero["offload_optimizer"]["device"] == "cpu"
        assert "offload_param" not in zero

    def test_offload_params_to_cpu_at_stage_3(self) -> None:
        spec = make_spec(deepspeed={"zero_stage": 3, "offload_params": "cpu"})
        zero = resolve_deepspeed_config(spec)["zero_optimization"]

        assert zero["offload_param"]["device"] == "cpu"
        assert "offload_optimizer" not in zero

    @pytest.mark.parametrize(("use_gpu", "pinned"), [(False, False), (True, True)])
    def test_offload_pins_memory_only_with_a_gpu(self, use_gpu: bool, pinned: bool) -> None:
        spec = make_spec(deepspeed=offloads_for(3), resources={"use_gpu": use_gpu})
        zero = resolve_deepspeed_config(spec)["zero_optimization"]

        assert zero["offload_optimizer"]["pin_memory"] is pinned
        assert zero["offload_param"]["pin_memory"] is pinned

    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_16bit_weights_gathered_on_save_only_at_stage_3(self, stage: int) -> None:
        zero = resolve_deepspeed_config(make_spec(deepspeed={"zero_stage": stage}))[
            "zero_optimization"
        ]
        assert zero.get("stage3_gather_16bit_weights_on_model_save", False) is (stage == 3)


class TestBatchSize:
    @pytest.mark.parametrize(
        ("micro", "accum", "workers", "tp", "expected"),
        [(1, 1, 1, 1, 1), (2, 4, 4, 1, 32), (3, 2, 4, 2, 12), (5, 3, 2, 1, 30), (2, 1, 6, 3, 4)],
    )
    def test_train_batch_size_is_micro_times_accum_times_data_parallel(
        self, micro: int, accum: int, workers: int, tp: int, expected: int
    ) -> None:
        spec = make_spec(
            training={"batch_size_per_worker": micro, "gradient_accumulation_steps": accum},
            resources={"num_workers": workers},
            deepspeed={"zero_stage": 1, "tensor_parallel_size": tp},
        )
        config = resolve_deepspeed_config(spec)

        assert global_batch_size(spec) == expected
        if tp == 1:
            assert config["train_batch_size"] == expected
            assert "tensor_parallel" not in config
        else:
            # DeepSpeed checks train_batch_size against the whole world before it knows
            # the TP size, so under AutoTP it is left for DeepSpeed to derive.
            assert "train_batch_size" not in config
            assert config["tensor_parallel"] == {"autotp_size": tp}
        assert config["train_micro_batch_size_per_gpu"] == micro
        assert config["gradient_accumulation_steps"] == accum

    def test_gradient_clipping_is_max_grad_norm(self) -> None:
        config = resolve_deepspeed_config(make_spec(training={"max_grad_norm": 0.25}))
        assert config["gradient_clipping"] == 0.25


class TestPrecision:
    @pytest.mark.parametrize(
        ("precision", "use_gpu", "bf16_supported", "expected"),
        [
            ("auto", False, True, "fp32"),
            ("auto", False, False, "fp32"),
            ("auto", True, True, "bf16"),
            ("auto", True, False, "fp16"),
            ("bf16", False, False, "bf16"),
            ("bf16", True, False, "bf16"),
            ("fp32", True, True, "fp32"),
            ("fp16", True, True, "fp16"),
        ],
    )
    def test_resolution(
        self, precision: str, use_gpu: bool, bf16_supported: bool, expected: str
    ) -> None:
        spec = make_spec(deepspeed={"precision": precision}, resources={"use_gpu": use_gpu})

        assert resolve_precision(spec, bf16_supported=bf16_supported) == expected
        config = resolve_deepspeed_config(spec, bf16_supported=bf16_supported)
        assert config["bf16"]["enabled"] is (expected == "bf16")
        assert config["fp16"]["enabled"] is (expected == "fp16")


class TestAcceptedByDeepSpeed:
    """DeepSpeed's own parser reads the config (pydantic, extra keys forbidden in ZeRO).

    Without a process group DeepSpeedConfig takes world size 1, so these specs use one
    worker; its batch-size check then holds the config to micro * accumulation * 1.
    """

    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    @pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "cpu-offload"])
    def test_every_stage_parses_on_cpu(
        self, deepspeed_config_cls: Any, stage: int, offload: bool
    ) -> None:
        deepspeed = offloads_for(stage) if offload else {"zero_stage": stage}
        spec = make_spec(
            deepspeed=deepspeed,
            training={"batch_size_per_worker": 3, "gradient_accumulation_steps": 2},
            resources={"num_workers": 1},
        )

        parsed = deepspeed_config_cls(resolve_deepspeed_config(spec, bf16_supported=False))

        assert parsed.zero_optimization_stage == stage
        assert parsed.train_batch_size == 6
        assert parsed.train_micro_batch_size_per_gpu == 3
        assert parsed.gradient_accumulation_steps == 2
        assert parsed.gradient_clipping == spec.training.max_grad_norm
        assert not parsed.bfloat16_config.enabled
        assert not parsed.float16_config.enabled
        zero = parsed.zero_config
        optimizer_device = zero.offload_optimizer.device if zero.offload_optimizer else "none"
        param_device = zero.offload_param.device if zero.offload_param else "none"
        assert optimizer_device == deepspeed.get("offload_optimizer", "none")
        assert param_device == deepspeed.get("offload_params", "none")
        assert zero.gather_16bit_weights_on_model_save is (stage == 3)

    @pytest.mark.parametrize(("bf16_supported", "expected"), [(True, "bf16"), (False, "fp16")])
    def test_gpu_precisions_parse(
        self, deepspeed_config_cls: Any, bf16_supported: bool, expected: str
    ) -> None:
        spec = make_spec(deepspeed=offloads_for(3), resources={"num_workers": 1, "use_gpu": True})

        parsed = deepspeed_config_cls(resolve_deepspeed_config(spec, bf16_supported=bf16_supported))

        assert parsed.bfloat16_config.enabled is (expected == "bf16")
        assert parsed.float16_config.enabled is (expected == "fp16")
        assert parsed.zero_config.overlap_comm is True

    def test_parser_checks_the_batch_size_against_the_world_size(
        self, deepspeed_config_cls: Any
    ) -> None:
        """The check above is live: two workers' batch size is wrong for a world of one."""
        spec = make_spec(resources={"num_workers": 2})
        with pytest.raises(AssertionError, match="train_batch_size"):
            deepspeed_config_cls(resolve_deepspeed_config(spec))


class TestBucketsSizedFromTheModel:
    """Hugging Face's "auto" sizes instead of DeepSpeed's 5e8-element defaults."""

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_parsed_by_deepspeed_as_given(self, deepspeed_config_cls: Any, stage: int) -> None:
        spec = make_spec(deepspeed={"zero_stage": stage}, resources={"num_workers": 1})
        hidden = 4096

        zero = deepspeed_config_cls(
            resolve_deepspeed_config(spec, bf16_supported=False, hidden_size=hidden)
        ).zero_config

        assert zero.reduce_bucket_size == hidden * hidden
        if stage == 3:
            assert zero.prefetch_bucket_size == int(0.9 * hidden * hidden)
            assert zero.param_persistence_threshold == 10 * hidden
        else:
            assert zero.allgather_bucket_size == hidden * hidden

    def test_unknown_width_and_stage_0_keep_deepspeeds_defaults(self) -> None:
        for stage, hidden in ((3, None), (0, 4096)):
            spec = make_spec(deepspeed={"zero_stage": stage})
            zero = resolve_deepspeed_config(spec, hidden_size=hidden)["zero_optimization"]
            assert not {"reduce_bucket_size", "stage3_prefetch_bucket_size"} & zero.keys()

    @pytest.mark.parametrize(
        ("config", "hidden"),
        [
            ({"hidden_size": 896}, 896),  # Llama, Qwen
            ({"n_embd": 768}, 768),  # GPT-2
            ({"d_model": 512}, 512),  # T5, OPT
            ({"text_config": {"hidden_size": 2048}}, 2048),  # multimodal wrappers
            ({"vocab_size": 10}, None),
        ],
    )
    def test_the_width_is_read_from_the_models_config(
        self, config: dict[str, Any], hidden: int | None
    ) -> None:
        assert hidden_size_of(config) == hidden


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")]
)
def test_the_load_dtype_is_the_trained_precision(precision: str, dtype: str) -> None:
    assert torch_dtype_name(precision) == dtype
