#!/usr/bin/env bash
# Start pdserve on one machine by hand: one prefill worker, one decode worker, one coordinator,
# each its own process on fixed ports (what `pdserve up` does for you with free ports).
# Usage: deploy/local/start-cluster.sh [MODEL_DIR]   (default: the embedded model)
set -euo pipefail
MODEL_ARGS=()
if [[ $# -ge 1 ]]; then MODEL_ARGS=(--model "$1"); fi
CONFIG="$(dirname "$0")/ms_coordinator.json"
PREFILL="" DECODE="" COORD=""

pdserve worker --role prefill --host 127.0.0.1 --port 50051 "${MODEL_ARGS[@]}" &
PREFILL=$!
pdserve worker --role decode --host 127.0.0.1 --port 50052 "${MODEL_ARGS[@]}" &
DECODE=$!
trap 'kill -TERM $PREFILL $DECODE $COORD 2>/dev/null; wait' EXIT
trap 'exit 0' INT TERM
sleep 1
pdserve coordinator --config "$CONFIG" &
COORD=$!
wait -n
