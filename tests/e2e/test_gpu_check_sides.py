"""bench.gpu_check's two sides on CPU: a tuneyard run through the real service and the plain
DeepSpeed script, on the same request, train the same examples in the same order, so their
losses agree in fp32 and only then does the check compare their speeds.

The whole dry run (`python -m bench.gpu_check --dry-run`: a service and Ray head of its own,
both ZeRO stages on both sides) takes minutes on 2 cores; here one stage runs on the
session's service, with the check's own functions.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import PLAIN, TUNEYARD, CheckSettings
from tests.e2e.conftest import Service

pytestmark = pytest.mark.e2e

# The dry run's settings, one step fewer.
SETTINGS = CheckSettings(dry_run=True, steps=3, warmup_steps=1, batch_size=2, seq_length=64)


def test_both_sides_train_alike_and_only_then_are_compared(
    service: Service, tmp_path: Path
) -> None:
    model, data = gpu_check.build_assets(service.data_dir / "gpu-check", SETTINGS)
    # ZeRO-3: the stage with the most to go wrong (the model created partitioned).
    body = gpu_check.run_request(model, data, zero_stage=3, settings=SETTINGS)
    ours = gpu_check.measure_service(service, body, timeout_s=600)
    plain = gpu_check.measure_plain(body, workdir=tmp_path, settings=SETTINGS, timeout_s=600)

    assert (plain.side, plain.zero_stage, plain.precision) == (PLAIN, 3, "fp32")
    assert (ours.side, ours.zero_stage, ours.precision) == (TUNEYARD, 3, "fp32")
    # Packed blocks: every step trains batch x seq_length tokens, on both sides.
    assert plain.tokens == [2 * 64] * 3
    assert ours.tokens == pytest.approx([2 * 64] * 3)
    assert all(t > 0 for t in plain.step_times + ours.step_times)
    assert plain.memory_kind == ours.memory_kind == "rss"
    assert plain.peak_memory_bytes and ours.peak_memory_bytes
    # A random model over a 512-token vocabulary starts near ln(512), and learns.
    assert abs(plain.losses[0] - math.log(512)) < 1.0
    assert plain.losses[-1] < plain.losses[0]

    # The same examples through the same weights, optimizer and schedule: the same losses
    # to rounding (the plain script fed the attention mask with the packed blocks once,
    # and its first loss was 0.02 off).
    assert ours.losses == pytest.approx(plain.losses, abs=gpu_check.FP32_LOSS_GAP)
    assert gpu_check.mismatches([ours, plain]) == {}
    rows = gpu_check.table_rows([ours, plain], warmup_steps=1, flops_per_token=1e6, peak_flops=None)
    assert isinstance(rows[0]["tokens/s vs plain"], float)

    # One example out of place would show, and the ratio is then withheld.
    moved = gpu_check.Measurement(
        **{**vars(ours), "losses": [ours.losses[0] + 2e-4, *ours.losses[1:]]}
    )
    assert 3 in gpu_check.mismatches([moved, plain])
