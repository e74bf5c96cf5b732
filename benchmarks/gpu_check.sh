#!/usr/bin/env bash
# The whole GPU check in one command, for whoever has a GPU (issue 28): the GPU tests, the
# checkpoint benchmark on CUDA tensors, and examples/train_torch.py over NCCL under
# `mscluster run --worker-num 1`; then a summary, one line per part. Exit 0 when every part
# passed, 1 when one failed, 2 when torch sees no CUDA device or an option is wrong (nothing was
# checked).
#
#   benchmarks/gpu_check.sh [--sizes MB,...] [--repeat N] [--steps N] [OUT_DIR]
#
# OUT_DIR: default gpu-check-<date>; logs and JSON land there. --sizes and --repeat go to the
# checkpoint benchmark (default: its own, 100,1000 MB and 5 rounds), --steps to train_torch.py
# (default 100): small values make a quick check of the script itself.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
checkpoint_args=()
steps=100
while [ $# -gt 0 ]; do
    case "$1" in
        --sizes | --repeat | --steps)
            if [ $# -lt 2 ]; then
                echo "gpu_check: $1 needs a value (see the usage at the top of $0)" >&2
                exit 2
            fi
            if [ "$1" = --steps ]; then steps="$2"; else checkpoint_args+=("$1" "$2"); fi
            shift 2
            ;;
        -*)
            echo "gpu_check: unknown option $1: give [--sizes MB,...] [--repeat N] [--steps N] [OUT_DIR]" >&2
            exit 2
            ;;
        *) break ;;
    esac
done
OUT="${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device here: nothing checked"
    exit 2
fi
"$PYTHON" -c 'import torch; print("gpu_check:", torch.cuda.device_count(), "x",
    torch.cuda.get_device_name(), "torch", torch.__version__)' | tee "$OUT/device.txt"

summary=()
failed=0
part() {  # part NAME LOG COMMAND...: run it, its output to LOG and the terminal
    local name="$1" log="$2"
    shift 2
    echo "== $name: $*"
    "$@" 2>&1 | tee "$log"
    local code="${PIPESTATUS[0]}"
    if [ "$code" -eq 0 ]; then
        summary+=("PASS  $name")
    else
        summary+=("FAIL  $name (exit $code; see $log)")
        failed=1
    fi
}

# A GPU machine's image may lack pytest-asyncio, whose ini keys (pyproject.toml) pytest then
# warns of as unknown, and `filterwarnings = error` would make that warning end the run.
part "GPU tests" "$OUT/tests.log" \
    "$PYTHON" -m pytest -q -rs -p no:cacheprovider -W ignore::pytest.PytestConfigWarning \
    tests/integration/test_gpu.py
part "checkpoint benchmark --device cuda" "$OUT/checkpoint.log" \
    "$PYTHON" benchmarks/checkpoint.py --device cuda ${checkpoint_args[@]+"${checkpoint_args[@]}"} \
    --json "$OUT/checkpoint_cuda.json"
part "train_torch.py over NCCL" "$OUT/train.log" \
    "$PYTHON" -m cluster run --worker-num 1 --log-dir "$OUT/train-logs" \
    examples/train_torch.py --device cuda --backend nccl --steps "$steps" --out "$OUT/train"
if grep -q "destroy_process_group() was not called" "$OUT"/train-logs/*.log 2>/dev/null; then
    summary+=("FAIL  NCCL group left at exit (torch warned; see $OUT/train-logs)")
    failed=1
else
    summary+=("PASS  no NCCL group left at exit")
fi

echo
echo "gpu_check summary ($OUT):"
for line in "${summary[@]}"; do echo "  $line"; done
grep -E "^(D2H floor|cluster async|torch dcp|torch.save)|MB state" "$OUT/checkpoint.log" | sed 's/^/  /'
exit "$failed"
