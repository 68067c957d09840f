#!/usr/bin/env bash
# The GPU check in one call on a lent GPU node (issue 38): install the project on the node's
# own Python (it has torch, transformers and peft, and no package index), then profile
# tuneyard's step at ZeRO-2 and ZeRO-3, then the like-for-like check against the plain
# DeepSpeed script, then the ~1.5B model at ZeRO-3 against its memory estimate
# (bench/gpu_large.py). Everything worth keeping lands in $OUT: the tables (also appended to
# that copy of BENCHMARKS.md), the traces (gzipped), the versions and the GPU's name.
#
#   bash bench/gpu_node.sh [CARRIED]
#
# CARRIED (default .gpu, git-ignored): ../shared/gpu/install-on-node.sh and the wheelhouse
# ../shared/gpu/wheelhouse.py built (CARRIED/wheelhouse), copied beside the checkout so
# that they travel with it. Set TUNEYARD_PYTHON to a Python that has the project already
# to skip the install, and GPU_CHECK_ARGS=--dry-run to rehearse the rest on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
carried=${1:-.gpu}
out=${OUT:-gpu-results}
mkdir -p "$out/traces"
args=${GPU_CHECK_ARGS:-}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"; } \
    | tee "$out/gpu.txt"
if [[ -n ${TUNEYARD_PYTHON:-} ]]; then
    python=$TUNEYARD_PYTHON
else
    started=$SECONDS
    python=$(bash "$carried/install-on-node.sh" "$carried/wheelhouse" . /tmp/tuneyard-venv)
    echo "installed in $((SECONDS - started)) s"
fi
"$python" - <<'EOF' | tee "$out/versions.txt"
import deepspeed, ray, torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), DeepSpeed {deepspeed.__version__}, "
      f"Ray {ray.__version__}, transformers {transformers.__version__}")
EOF

status=0
# Where a step's time goes first: short, and the most to learn if the rest runs out of time.
"$python" -m bench.gpu_check --profile --trace-dir "$out/traces" $args 2>&1 | tee "$out/profile.txt" \
    || status=1
"$python" -m bench.gpu_check $args 2>&1 | tee "$out/check.txt" || status=1
"$python" -m bench.gpu_large $args 2>&1 | tee "$out/large.txt" || status=1
gzip -f "$out"/traces/*.json 2>/dev/null || true
cp BENCHMARKS.md "$out/BENCHMARKS.md"
exit $status
