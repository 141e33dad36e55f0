#!/usr/bin/env bash
# The worker engine on a GPU, in one prepared run: parity, then the decode step's and the engine's tables. Each step
# has its own time limit and writes its output to OUT (default /tmp/cuda-check); a failing step does not stop the next.
#
#     bash bench/cuda_check.sh [CHECK_DIR] [PART...]
#
# PARTs (default: parity steps throughput, at most 7 minutes: one device command):
#   parity      eager against captured: batches 3, 13, 63 and one prompt at the context limit, float32 and bfloat16
#   steps       the decode step's time by rows (replay and eager, CUDA events), host time per step, capture cost
#   throughput  the engine with graphs and eager beside transformers' continuous batching, 16 and 64 streams
#   context     decode steps by context length (bench/engine.py --context-steps)
#   engine      bench/engine.py's table against model.generate (its sequential baseline alone takes a minute)
#
# Prepare it here first: `bash bench/cuda_prepare.sh`, then carry ".cudarun" and ".whl" to the device.
# CHECK_DIR (default .cudarun) holds what cannot be built there without the network:
#   smollm2/       SmolLM2-135M-Instruct's config and tokenizer; the weights are drawn at random there (the
#                  checkpoint does not travel), which times the same architecture: the engine's timings do not
#                  depend on the weights' values (end-of-sequence is off in every timed run).
#   pdserve-tiny/  the embedded model, for the float32 parity check.
#   ../.whl/       wheels the machine lacks (llguidance; protobuf at this project's version), installed first.
set -u
CHECK_DIR=${1:-.cudarun}
shift $(( $# > 0 ? 1 : 0 ))
PARTS=${*:-parity steps throughput}
OUT=${OUT:-/tmp/cuda-check}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu runs the same steps here, to check the script itself
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1  # no network there: nothing may wait on the Hub
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PDSERVE_CACHE=/tmp/pdserve-cache  # bench/engine.py builds pdserve-bench-512x8 here
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"

smollm2=/tmp/smollm2-random
$PY - "$CHECK_DIR/smollm2" "$smollm2" <<'EOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, out = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
model.save_pretrained(out)
for f in src.glob("*.json"):
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
print("random-weight SmolLM2-135M built", file=sys.stderr)
EOF

run() {  # run NAME SECONDS COMMAND...: one timed step, its output kept
    local name=$1 limit=$2
    shift 2
    echo "== $name" >&2
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>"$OUT/$name.err"
    echo "rc=$?" >>"$OUT/$name.txt"
    cat "$OUT/$name.txt"
}
graphs="$PY bench/decode_graphs.py"
for part in $PARTS; do
    case $part in
    parity)
        run parity-tiny 60 $graphs parity --model "$CHECK_DIR/pdserve-tiny" --dtype float32 --device "$DEVICE"
        run parity-smollm2 90 $graphs parity --model "$smollm2" --dtype bfloat16 --device "$DEVICE" ;;
    steps)
        run steps 90 $graphs steps --model "$smollm2" --dtype bfloat16 --device "$DEVICE" ;;
    context)
        run context 60 $PY bench/engine.py --device "$DEVICE" --context-steps --model "$smollm2" --dtype bfloat16 \
            --contexts 256 2048 --rows 64 ;;
    throughput)
        run throughput 240 $graphs throughput --model "$smollm2" --dtype bfloat16 --device "$DEVICE" \
            --concurrency 16 64 ;;
    engine)
        run engine 150 $PY bench/engine.py --device "$DEVICE" --model "$smollm2" --dtype bfloat16 --requests 64 \
            --new-tokens 64 --concurrency 4 16 64 ;;
    *) echo "unknown part $part (parity, steps, throughput, context, engine)" >&2 ;;
    esac
done
