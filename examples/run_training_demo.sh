#!/usr/bin/env bash
# Training that survives a fault: examples/train_mlp.py with 4 workers under `mscluster run`,
# once without faults and once with worker 2 SIGKILLed mid-run (the launcher starts it again; it
# rejoins after the guard and every worker rolls back to the newest common checkpoint). Prints
# both final parameter hashes and exits 0 when they are equal.
#
#   bash examples/run_training_demo.sh        # logs and results in ./demo
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-demo}
PORT=${PORT:-8118}
STEPS=${STEPS:-120}
rm -rf "$OUT"
mkdir -p "$OUT"

run() {  # $1: name; the job's results go to $OUT/$1
  "$PYTHON" -m cluster run --worker-num 4 --local-worker-num 4 --master-port "$PORT" \
    --log-dir "$OUT/$1/logs" --enable-recovery --recovery-path "$OUT/$1/recovery" \
    --max-restarts 2 --node-timeout "${MS_NODE_TIMEOUT:-3}" \
    examples/train_mlp.py --steps "$STEPS" --save-every 10 --step-delay 0.05 --out "$OUT/$1"
}

pid_of_node() {  # the pid of this demo's train_mlp.py process with MS_NODE_ID=$1
  local proc
  for proc in /proc/[0-9]*; do
    if grep -q "examples/train_mlp.py" "$proc/cmdline" 2>/dev/null &&
      tr '\0' '\n' < "$proc/environ" 2>/dev/null | grep -qx "MS_NODE_ID=$1"; then
      echo "${proc#/proc/}"
      return 0
    fi
  done
  return 1
}

echo "== run 1: no faults"
run clean > "$OUT/clean.log" 2>&1
echo "== run 2: worker 2 is SIGKILLed at step 45"
run faulty > "$OUT/faulty.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  grep -q "^epoch: 3 step: 13," "$OUT/faulty/logs/worker_2.log" 2>/dev/null && break
  sleep 0.1
done
kill -9 "$(pid_of_node 2)"
wait "$launcher"

grep -h "restarting it\|job finished" "$OUT/faulty.log" || true
grep -h "resuming from step" "$OUT/faulty/logs/worker_2.log" | tail -1 || true
clean=$(cat "$OUT/clean/final.sha256")
faulty=$(cat "$OUT/faulty/final.sha256")
echo "final parameters without faults: $clean"
echo "final parameters with the kill:   $faulty"
if [ "$clean" = "$faulty" ]; then echo "identical"; else echo "DIFFERENT" >&2; exit 1; fi
