#!/usr/bin/env bash
# Training that survives a fault: examples/train_mlp.py with 4 workers under `mscluster run`,
# once without faults and once with worker 2 SIGKILLed mid-run (the launcher starts it again; it
# rejoins after the guard and every worker resumes from the last step the survivors finished,
# worker 2 fetching it from a peer; the newest common checkpoint is the fallback). Prints
# both final parameter hashes and exits 0 when they are equal.
#
# Worker 2 is found through the launcher this demo started: `mscluster run` lists the pid of each
# process it started in <log-dir>/pids, and the demo signals that pid only while it is still
# that launcher's child; never a process found by its script's name on the machine (another job
# may run train_mlp.py with the same node ids). And the demo fails unless its faulty run shows
# the fault it injected: the launcher restarting worker 2, the scheduler's `failed` and
# `rejoined` events for node 2 and a new generation, and worker 2 resuming from a step.
#
#   bash examples/run_training_demo.sh        # logs and results in ./demo
#   PORT=8119 bash scripts/demo               # the same, its scheduler on another port
#
# PORT (8118) is the scheduler's port, on 127.0.0.1: another job's scheduler (or another demo)
# there fails the run, and the demo shows the end of that run's log and says to set PORT.
# STEPS (120) and KILL_STEP (45) size it; SIGNAL (KILL) is what worker 2 gets; OUT (demo) is
# where its results and logs go.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-demo}
PORT=${PORT:-8118}
STEPS=${STEPS:-120}
KILL_STEP=${KILL_STEP:-45}
SIGNAL=${SIGNAL:-KILL}
rm -rf "$OUT"
mkdir -p "$OUT"

run() {  # $1: name; the job's results go to $OUT/$1. It execs: run it in a subshell of its own
  exec "$PYTHON" -m cluster run --worker-num 4 --local-worker-num 4 --master-port "$PORT" \
    --log-dir "$OUT/$1/logs" --enable-recovery --recovery-path "$OUT/$1/recovery" \
    --max-restarts 2 --node-timeout "${MS_NODE_TIMEOUT:-3}" \
    examples/train_mlp.py --steps "$STEPS" --save-every 10 --step-delay 0.05 --out "$OUT/$1"
}

parent_of() {  # $1: a pid; its parent's pid (fails when it is gone)
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  read -r -a fields <<< "${stat##*) }"
  echo "${fields[1]}"
}

launched_pid() {  # $1: a launcher's pid, $2: its log dir, $3: a name in its pids file (worker_2)
  local listed pid
  listed=$(awk '$1 == "launcher" { print $2 }' "$2/pids" 2>/dev/null) || return 1
  pid=$(awk -v name="$3" '$1 == name { print $2 }' "$2/pids" 2>/dev/null) || return 1
  [ "$listed" = "$1" ] && [ -n "$pid" ] && [ "$(parent_of "$pid")" = "$1" ] && echo "$pid"
}

run_failed() {  # $1: a run's name, $2: its exit status; says why, from the end of its log
  echo "demo: the $1 run failed (exit status $2); the end of $OUT/$1.log:" >&2
  tail -n 15 "$OUT/$1.log" | sed 's/^/  /' >&2
  echo "demo: its scheduler listens on 127.0.0.1:$PORT (PORT); if that port is in use (another" >&2
  echo "job, another demo), run the demo on a free one: PORT=<port> bash scripts/demo" >&2
  exit 1
}

did_not_land() {  # $1: what is missing
  echo "the kill of worker 2 did not land: $1 (see $OUT/faulty.log and $OUT/faulty/logs/)" >&2
  exit 1
}

shows() {  # $1: an extended regular expression, $2: a file; whether it is there
  grep -Eq -- "$1" "$2" 2>/dev/null
}

echo "== run 1: no faults"
(run clean) > "$OUT/clean.log" 2>&1 || run_failed clean $?
echo "== run 2: worker 2 is SIG$SIGNAL'd at step $KILL_STEP"
run faulty > "$OUT/faulty.log" 2>&1 &
launcher=$!
trap 'kill -TERM "$launcher" 2>/dev/null || true' EXIT  # this demo's launcher, if still running
logs="$OUT/faulty/logs"
steps_of_worker_2() { grep -c "^epoch: " "$logs/worker_2.log" 2>/dev/null || true; }
for _ in $(seq 600); do
  [ "$(steps_of_worker_2)" -ge "$KILL_STEP" ] 2>/dev/null && break
  if ! kill -0 "$launcher" 2>/dev/null; then
    status=0
    wait "$launcher" || status=$?
    [ "$status" = 0 ] || run_failed faulty "$status"
    did_not_land "the run ended before step $KILL_STEP"
  fi
  sleep 0.1
done
[ "$(steps_of_worker_2)" -ge "$KILL_STEP" ] 2>/dev/null ||
  did_not_land "worker 2 did not reach step $KILL_STEP within 60 s"
victim=$(launched_pid "$launcher" "$logs" worker_2) ||
  did_not_land "$logs/pids lists no worker_2 running under this demo's launcher ($launcher)"
kill -s "$SIGNAL" "$victim"
echo "sent SIG$SIGNAL to worker 2 (pid $victim, a child of this demo's launcher $launcher)"
status=0
wait "$launcher" || status=$?
trap - EXIT

grep -h "restarting it\|job finished\|job failed" "$OUT/faulty.log" || true
grep -h "resuming from step" "$logs/worker_2.log" | tail -1 || true
[ "$status" = 0 ] || run_failed faulty "$status"
shows "worker 2 \(.*\) was killed .*; restarting it" "$OUT/faulty.log" ||
  did_not_land "no restart of worker 2 in the launcher's output"
shows '"event":"failed".*"node_id":"2"' "$logs/events.jsonl" ||
  did_not_land "no 'failed' event for node 2 in $logs/events.jsonl"
shows '"event":"rejoined".*"node_id":"2"' "$logs/events.jsonl" ||
  did_not_land "no 'rejoined' event for node 2 in $logs/events.jsonl"
shows '"event":"generation","generation":([2-9]|[1-9][0-9]+)[,}]' "$logs/events.jsonl" ||
  did_not_land "no new generation in $logs/events.jsonl"
shows "resuming from step" "$logs/worker_2.log" ||
  did_not_land "worker 2 did not resume from a step ($logs/worker_2.log)"
clean=$(cat "$OUT/clean/final.sha256")
faulty=$(cat "$OUT/faulty/final.sha256")
echo "final parameters without faults: $clean"
echo "final parameters with the kill:   $faulty"
if [ "$clean" = "$faulty" ]; then echo "identical"; else echo "DIFFERENT" >&2; exit 1; fi
