#!/usr/bin/env bash
# Recovery by hand, as the tutorials describe it: a job of MS_WORKER_NUM workers with recovery on;
# one worker is SIGKILLed and started again with the same environment (it waits out the guard and
# rejoins with its rank), then the scheduler is SIGKILLed and started again (it resumes the job and
# every worker reconnects). Exits 0 when every process of the job exited 0.
#
#   MS_WORKER_NUM=4 MS_SCHED_PORT=8118 bash examples/run_recovery.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
LOG_DIR=${LOG_DIR:-logs}
HOLD=${HOLD:-20}
export MS_WORKER_NUM=${MS_WORKER_NUM:-4} MS_SCHED_HOST=${MS_SCHED_HOST:-127.0.0.1}
export MS_SCHED_PORT=${MS_SCHED_PORT:-8118} MS_NODE_TIMEOUT=${MS_NODE_TIMEOUT:-5}
export MS_ENABLE_RECOVERY=1 MS_RECOVERY_PATH=${MS_RECOVERY_PATH:-$LOG_DIR/recovery}
mkdir -p "$LOG_DIR"
rm -rf "$MS_RECOVERY_PATH"  # a new job; a leftover state of a running job would be resumed

start_scheduler() { MS_ROLE=MS_SCHED "$PYTHON" examples/allgather_check.py >> "$LOG_DIR/scheduler.log" 2>&1 & }
start_worker() {  # $1: node id, which is also the rank
  MS_ROLE=MS_WORKER MS_NODE_ID=$1 "$PYTHON" examples/allgather_check.py --hold "$HOLD" \
    >> "$LOG_DIR/worker_$1.log" 2>&1 &
}
wait_for() {  # $1: text, $2: log file; at most 60 s
  for _ in $(seq 600); do grep -q "$1" "$2" 2>/dev/null && return 0; sleep 0.1; done
  echo "timed out waiting for '$1' in $2" >&2; exit 1
}

: > "$LOG_DIR/scheduler.log"
start_scheduler; scheduler=$!
workers=()
for ((i = 0; i < MS_WORKER_NUM; i++)); do
  : > "$LOG_DIR/worker_$i.log"; start_worker "$i"; workers[i]=$!
done
for ((i = 0; i < MS_WORKER_NUM; i++)); do wait_for "allgather rank=" "$LOG_DIR/worker_$i.log"; done

echo "SIGKILL worker 1 and start it again at once"
kill -9 "${workers[1]}"; wait "${workers[1]}" || true
start_worker 1; workers[1]=$!
wait_for "rejoined rank=1" "$LOG_DIR/worker_1.log"
grep -h "rejoined\|refused for now" "$LOG_DIR/worker_1.log"

echo "SIGKILL the scheduler and start it again"
kill -9 "$scheduler"; wait "$scheduler" || true
start_scheduler; scheduler=$!
wait_for "every node is back" "$LOG_DIR/scheduler.log"
grep -h "resuming job\|every node is back" "$LOG_DIR/scheduler.log"

status=0
for pid in "${workers[@]}" "$scheduler"; do wait "$pid" || status=1; done
echo "job exit status: $status"
exit "$status"
