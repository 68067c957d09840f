"""bench/gpu_check.py without a GPU: its arithmetic, its table, the requests it submits and
when it compares the two sides' speeds. Both sides trained for real on CPU, through the
service and the plain script, are tests/e2e/test_gpu_check_sides.py.

The whole dry run (`python -m bench.gpu_check --dry-run`: the service, its Ray head, two
runs and two plain runs) takes minutes on a 2-core machine, too long for the suite; its
pieces are checked here instead.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bench import common, gpu_check
from bench.gpu_check import (
    GPU_MODEL,
    PLAIN,
    TUNEYARD,
    CheckSettings,
    Measurement,
    ModelFacts,
)
from contract.run_request import RunRequest

DRY = CheckSettings.defaults(dry_run=True)
GPU = CheckSettings.defaults(dry_run=False)


class TestArithmetic:
    def test_flops_per_token_is_palms_formula(self) -> None:
        facts = ModelFacts(parameters=1_000, num_layers=2, hidden_size=8)
        # 6 N + 12 L h T
        assert gpu_check.flops_per_token(facts, seq_length=16) == 6 * 1_000 + 12 * 2 * 8 * 16

    def test_the_gpu_model_is_about_half_a_billion_parameters(self) -> None:
        vocab, h, i, layers = 512, GPU_MODEL.hidden_size, GPU_MODEL.intermediate_size, 24
        config = gpu_check.llama_config(GPU_MODEL, vocab_size=vocab, max_positions=1024)
        facts = gpu_check.facts_of(config)
        # Per layer: q, k, v, o (h x h each), gate, up, down (h x i each), two norms; then the
        # input and output embeddings (not tied) and the final norm.
        expected = layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * vocab * h + h
        assert facts == ModelFacts(parameters=expected, num_layers=layers, hidden_size=h)
        assert 0.45e9 < facts.parameters < 0.55e9
        # The layers' matrix products dominate the FLOPs: a small vocabulary adds under 1%.
        assert 2 * vocab * h / facts.parameters < 0.01

    @pytest.mark.parametrize(
        ("device", "peak"),
        [
            ("NVIDIA H100 80GB HBM3", 989e12),
            ("NVIDIA H100 PCIe", 756e12),
            ("NVIDIA H100 NVL", 835e12),
            ("NVIDIA H200", 989e12),
            ("NVIDIA GH200 480GB", 989e12),
            ("NVIDIA A100-SXM4-80GB", 312e12),
            ("NVIDIA A100-PCIE-40GB", 312e12),
            ("NVIDIA L4", 121e12),
            ("NVIDIA L40S", 362e12),
            ("NVIDIA A10G", 125e12),
            ("Tesla V100-SXM2-16GB", None),
        ],
    )
    def test_peak_bf16_flops_by_device_name(self, device: str, peak: float | None) -> None:
        assert gpu_check.peak_bf16_flops(device) == peak

    def test_mfu(self) -> None:
        util = gpu_check.mfu(flops_per_token=3e9, tokens_per_second=1e5, peak_flops=989e12)
        assert util == pytest.approx(3e14 / 989e12)
        assert gpu_check.mfu(flops_per_token=3e9, tokens_per_second=1e5, peak_flops=None) is None


def measurement(
    side: str,
    stage: int,
    *,
    step_s: float,
    kind: str = "gpu_allocated",
    losses: tuple[float, ...] = (6.2, 6.0, 5.9, 5.8),
) -> Measurement:
    # The first step is slow (warm-up) and must not count.
    return Measurement(
        side=side,
        zero_stage=stage,
        precision="bf16",
        step_times=[10.0, step_s, step_s, step_s],
        tokens=[4096.0] * 4,
        losses=list(losses),
        peak_memory_bytes=3 * gpu_check.GIB,
        memory_kind=kind,
    )


# Out of order on purpose: the table sorts them.
MEASUREMENTS = (
    measurement(PLAIN, 3, step_s=0.5),
    measurement(TUNEYARD, 3, step_s=0.5),
    measurement(PLAIN, 2, step_s=0.1),
    measurement(TUNEYARD, 2, step_s=0.125),
)


class TestTable:
    def test_rows_left_out_warm_up_and_compare_with_the_plain_script(self) -> None:
        rows = gpu_check.table_rows(
            list(MEASUREMENTS), warmup_steps=1, flops_per_token=3e9, peak_flops=989e12
        )
        assert [(r["side"], r["ZeRO"]) for r in rows] == [
            (TUNEYARD, 2),
            (PLAIN, 2),
            (TUNEYARD, 3),
            (PLAIN, 3),
        ]
        tuneyard2 = rows[0]
        assert tuneyard2["steps timed"] == 3
        assert tuneyard2["tokens/s"] == pytest.approx(4096 / 0.125)
        assert tuneyard2["tokens/s vs plain"] == pytest.approx(0.8)
        assert tuneyard2["MFU"] == f"{3e9 * 4096 / 0.125 / 989e12:.1%}"
        assert tuneyard2["peak GPU memory (GiB)"] == "3.00"
        assert tuneyard2["loss, last step"] == 5.8
        assert rows[1]["tokens/s vs plain"] == 1

    def test_without_a_peak_mfu_is_na_and_cpu_memory_is_named_rss(self) -> None:
        cpu = [measurement(TUNEYARD, 2, step_s=1.0, kind="rss")]
        (row,) = gpu_check.table_rows(cpu, warmup_steps=1, flops_per_token=1e6, peak_flops=None)
        assert row["MFU"] == "n/a"
        assert row["tokens/s vs plain"] == "n/a"
        assert row["peak RSS (GiB)"] == "3.00"

    def test_a_dry_run_prints_the_table_and_leaves_benchmarks_md_alone(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.setenv("TUNEYARD_BENCH_DRY_RUN", "1")
        monkeypatch.setenv("COLUMNS", "250")  # rich would cut cells to an 80-column terminal
        before = common.BENCHMARKS_MD.read_text()
        rows = gpu_check.table_rows(
            list(MEASUREMENTS), warmup_steps=1, flops_per_token=3e9, peak_flops=None
        )
        common.record("GPU check (dry run)", rows, notes=["a note"])
        printed = capsys.readouterr().out
        assert common.BENCHMARKS_MD.read_text() == before
        for text in ("GPU check (dry run)", TUNEYARD, PLAIN, "MFU", "n/a", "32,768", "a note"):
            assert text in printed

    def test_no_step_left_after_warm_up_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="warm-up"):
            measurement(PLAIN, 2, step_s=1.0).tokens_per_second(warmup_steps=4)


class TestLikeForLike:
    """The speeds are compared only where both sides trained alike."""

    def test_fp32_losses_within_1e_4_at_every_step_agree(self) -> None:
        assert gpu_check.loss_mismatch([6.2, 6.0], [6.20005, 5.99995], precision="fp32") is None

    def test_fp32_losses_apart_name_the_first_step_that_parts(self) -> None:
        # The dry run's first losses before the plain script fed the model the run's inputs.
        reason = gpu_check.loss_mismatch([6.2269, 6.0], [6.2080, 6.0], precision="fp32")
        assert reason is not None
        assert reason.startswith("step 1: loss 6.2269 against the plain script's 6.208")
        assert reason.endswith("apart by more than 0.0001 (fp32)")

    def test_bf16_allows_rounding_but_not_another_curve(self) -> None:
        assert gpu_check.loss_mismatch([6.45, 4.0], [6.451, 4.1], precision="bf16") is None
        # The H100's first run: the same start, then another curve from step 2 on.
        reason = gpu_check.loss_mismatch([6.453, 3.659], [6.451, 5.023], precision="bf16")
        assert reason is not None and reason.startswith("step 2:")
        reason = gpu_check.loss_mismatch([6.6, 3.0], [6.45, 3.0], precision="bf16")
        assert reason is not None and reason.startswith("step 1:") and "1%" in reason

    def test_a_nan_or_a_missing_step_is_unlike(self) -> None:
        assert gpu_check.loss_mismatch([math.nan], [6.2], precision="fp32")
        reason = gpu_check.loss_mismatch([6.2], [6.2, 6.1], precision="fp32")
        assert reason == "1 steps against the plain script's 2"

    def test_the_ratio_is_withheld_for_a_stage_trained_unlike(self) -> None:
        unlike = measurement(TUNEYARD, 3, step_s=0.5, losses=(6.2, 5.0, 4.0, 3.0))
        measured = [m for m in MEASUREMENTS if (m.side, m.zero_stage) != (TUNEYARD, 3)]
        rows = gpu_check.table_rows(
            [*measured, unlike], warmup_steps=1, flops_per_token=3e9, peak_flops=989e12
        )
        by_side = {(r["side"], r["ZeRO"]): r for r in rows}
        assert by_side[TUNEYARD, 3]["tokens/s vs plain"] == "withheld: trained unlike"
        assert by_side[TUNEYARD, 3]["loss gap to plain, largest"] == "2.80e+00"
        assert by_side[TUNEYARD, 2]["tokens/s vs plain"] == pytest.approx(0.8)
        assert by_side[TUNEYARD, 2]["loss gap to plain, largest"] == "0.00e+00"
        assert by_side[PLAIN, 2]["loss gap to plain, largest"] == "n/a"
        assert set(gpu_check.mismatches([*measured, unlike])) == {3}


class TestRequests:
    @pytest.mark.parametrize("settings", [DRY, GPU], ids=["dry", "gpu"])
    @pytest.mark.parametrize("stage", gpu_check.ZERO_STAGES)
    def test_the_contract_accepts_what_the_check_submits(
        self, tmp_path: Path, settings: CheckSettings, stage: int
    ) -> None:
        body = gpu_check.run_request(
            tmp_path / "model", tmp_path / "data.jsonl", zero_stage=stage, settings=settings
        )
        request = RunRequest.model_validate(body)
        assert request.deepspeed.zero_stage == stage
        assert request.resources.num_workers == 1
        assert request.resources.use_gpu is settings.use_gpu
        assert request.deepspeed.precision == ("bf16" if settings.use_gpu else "fp32")
        assert request.training.max_steps == settings.steps
        # Full blocks: every step trains batch x seq_length tokens, the T of the FLOPs.
        assert request.training.packing is True
        assert request.training.log_every_n_steps == 1
        assert request.checkpointing.export_hf is False

    def test_gpu_defaults(self) -> None:
        assert (GPU.steps, GPU.warmup_steps, GPU.precision) == (50, 10, "bf16")
        # Enough text for one epoch of packed blocks at about ten tokens a line.
        assert GPU.dataset_rows() * 8 >= GPU.steps * GPU.batch_size * GPU.seq_length


@pytest.fixture(scope="module")
def dry_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpu-check")
    return gpu_check.build_assets(root / "assets", DRY)


class TestDryRun:
    @pytest.mark.parametrize("stage", gpu_check.ZERO_STAGES)
    def test_the_service_accepts_the_dry_runs_requests(
        self,
        client: TestClient,
        auth: dict[str, str],
        dry_assets: tuple[Path, Path],
        stage: int,
    ) -> None:
        model, data = dry_assets
        body = gpu_check.run_request(model, data, zero_stage=stage, settings=DRY)
        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        assert report["valid"] is True, report["errors"]
        zero = report["resolved"]["deepspeed_config"]["zero_optimization"]
        assert zero["stage"] == stage


class TestEntryPoints:
    def test_make_bench_leaves_it_out(self) -> None:
        """`make bench` runs on CPU machines; the GPU check has a target of its own."""
        from bench.run_all import benchmarks

        assert not {"gpu_check", "gpu_check_plain", "gpu_large"} & set(benchmarks())

    @pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
    def test_make_gpu_check_runs_it(self, tmp_path: Path) -> None:
        done = subprocess.run(
            ["make", "-n", "-B", "gpu-check", f"VENV={tmp_path}", "GPU_CHECK_ARGS=--dry-run"],
            cwd=common.REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"{tmp_path}/bin/python -m bench.gpu_check --dry-run" in done.stdout


class TestProfile:
    """`bench.gpu_check --profile`: tuneyard's step under torch.profiler, in one process."""

    def test_busy_time_is_the_union_of_the_kernels_intervals(self) -> None:
        from bench.gpu_profile import busy_ms

        # Overlapping (two streams), nested, and apart: 0-4, then 6-7.
        assert busy_ms([(0, 3), (1, 4), (2, 3), (6, 7)]) == 5
        assert busy_ms([]) == 0

    def test_a_cpu_profile_of_the_runs_own_step(
        self, dry_assets: tuple[Path, Path], tmp_path: Path
    ) -> None:
        import json

        model, data = dry_assets
        settings = CheckSettings(dry_run=True, steps=3, warmup_steps=1, batch_size=2, seq_length=64)
        body = gpu_check.run_request(model, data, zero_stage=2, settings=settings)
        traces = tmp_path / "traces"
        summary = gpu_check.profile_stage(
            body, workdir=tmp_path / "work", trace_dir=traces, settings=settings
        )
        assert (summary["zero_stage"], summary["precision"], summary["device"]) == (
            2,
            "fp32",
            "cpu",
        )
        assert len(summary["steps"]) == 2  # the warm-up step left out
        for step in summary["steps"]:
            assert step["step_ms"] > 0 and step["host_cpu_ms"] > 0
        assert summary["gpu_busy_ms"] is None  # no GPU
        names = [o["name"] for o in summary["top"]]
        # The model's matrix products are among the operators that took time of their own.
        assert "aten::mm" in names or "aten::addmm" in names, names
        assert all(o["self_ms"] > 0 and o["calls"] > 0 for o in summary["top"])
        trace = json.loads(Path(summary["trace"]).read_text())
        assert Path(summary["trace"]).parent == traces.resolve() and trace["traceEvents"]

        steps, operators = gpu_check.profile_tables([summary])
        (row,) = steps
        assert row["ZeRO"] == 2 and row["GPU busy (ms)"] == "n/a"
        assert row["step (ms)"] == pytest.approx(sum(s["step_ms"] for s in summary["steps"]) / 2)
        assert [o["operator"] for o in operators] == names
