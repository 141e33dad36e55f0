#!/usr/bin/env bash
# Makes here what bench/cuda_check.sh needs on a GPU machine that has no network: CHECK_DIR (default .cudarun)
# with SmolLM2-135M-Instruct's config and tokenizer (its weights are drawn at random there) and the embedded model,
# and .whl/ with the wheels such a machine lacked the last time (llguidance; protobuf at this project's version).
# Both are ignored by git: name them in the device run's carry (".cudarun", ".whl"; about 10 MiB).
#
#     bash bench/cuda_prepare.sh [CHECK_DIR]
set -eu
CHECK_DIR=${1:-.cudarun}
PY=${PY:-.venv/bin/python}
real=$($PY -c "from embedded_model.real_checkpoint import ensure_real_checkpoint as e; print(e())")
tiny=$($PY -c "from embedded_model import ensure_default_model as e; print(e())")
rm -rf "$CHECK_DIR"
mkdir -p "$CHECK_DIR/smollm2"
cp "$real"/*.json "$CHECK_DIR/smollm2/"
cp -r "$tiny" "$CHECK_DIR/pdserve-tiny"
versions=$($PY -c "from importlib.metadata import version as v
print(' '.join(f'{name}=={v(name)}' for name in ('llguidance', 'protobuf')))")
# This machine's wheels: abi3 (llguidance) or pure Python where they can be; a GPU machine on another Python
# may need others (the check names what failed to import).
$PY -m pip download -q --no-deps --only-binary=:all: -d .whl $versions
du -sh "$CHECK_DIR" .whl
