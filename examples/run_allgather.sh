#!/bin/bash
# The launch loop of MindSpore's CPU/GPU dynamic-networking tutorial, unchanged but for the
# script it starts: one scheduler and MS_WORKER_NUM workers of the same script, in the
# background, with only MS_ROLE differing. Exits non-zero when any process failed.
#
#   bash examples/run_allgather.sh          # 8 workers on 127.0.0.1:8118, logs in ./logs
set -u
export MS_WORKER_NUM=${MS_WORKER_NUM:-8}
export MS_SCHED_HOST=${MS_SCHED_HOST:-127.0.0.1}
export MS_SCHED_PORT=${MS_SCHED_PORT:-8118}
PYTHON=${PYTHON:-python}
LOG_DIR=${LOG_DIR:-logs}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$LOG_DIR"

pids=()
for ((i = 0; i < MS_WORKER_NUM; i++)); do
  export MS_ROLE=MS_WORKER
  "$PYTHON" "$HERE/allgather_check.py" > "$LOG_DIR/worker_$i.log" 2>&1 &
  pids+=($!)
done
export MS_ROLE=MS_SCHED
"$PYTHON" "$HERE/allgather_check.py" > "$LOG_DIR/scheduler.log" 2>&1 &
pids+=($!)

status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
cat "$LOG_DIR"/worker_*.log | grep '^allgather'
exit $status
