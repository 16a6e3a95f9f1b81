#!/usr/bin/env bash
# What a bare GPU machine lacks for the benchmarks, prepared on the development machine in ignored folders to copy
# beside the checkout on the GPU machine (.whl, .bench-assets, .bench-env):
#   .whl/               wheels of the dependencies the GPU image does not ship (pydantic, xgrammar, jsonschema and
#                       theirs), at the versions of this checkout's .venv, for CPython 3.12 on x86-64 Linux
#   .bench-assets/tokenizer   SmolLM2's tokenizer and chat template, from the GGUF embedded in the package
#   .bench-env/setup.sh    sourced first by every GPU command: installs the wheels to /tmp/site, sets PYTHONPATH,
#                       prints the GPU's clocks and the commit
#   .bench-ray/ray.tar.xz  with --ray only: Ray (this checkout's .venv version) for CPython 3.12, without its Java
#                       jars, dashboard web client, RLlib, Tune, Train and Serve, xz-compressed (about 29 MB: the whole
#                       wheel, 79 MB, is over what a device call may carry). The GPU image ships Ray's dependencies.
#                       setup.sh unpacks it to /tmp/site when the folder was carried.
# Usage (repository root, after `make install`): bash bench/device_assets.sh [--ray]
# Then, on the GPU machine, for example: source .bench-env/setup.sh; OUT=/tmp/out bash bench/gpu_proofs.sh sweep
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "device_assets: no $PY: run \`make install\` first (or set PY)" >&2; exit 1; }
mkdir -p .git/info && touch .git/info/exclude
for p in /.whl/ /.bench-assets/ /.bench-env/ /.bench-ray/; do grep -qx "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
mkdir -p .whl .bench-assets .bench-env
PACKAGES="pydantic pydantic-core annotated-types typing-inspection xgrammar apache-tvm-ffi jsonschema attrs
          jsonschema-specifications referencing rpds-py"
for name in $PACKAGES; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "device_assets: $name is not installed in $PY's environment" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "$name==$version"
done
"$PY" -c "from pathlib import Path; from batchgen.bench.job import tokenizer_dir; tokenizer_dir(None, Path('.bench-assets'))"
if [ "${1:-}" = --ray ]; then
  version=$("$PY" -m pip show ray 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "device_assets: ray is not installed in $PY's environment (make test installs it)" >&2; exit 1; }
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$tmp" "ray==$version"
  (cd "$tmp" && python3 -m zipfile -e ray-*.whl tree && cd tree \
     && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/tune ray/train ray/serve \
     && find ray -name '*.map' -delete && chmod +x ray/core/src/ray/raylet/raylet ray/core/src/ray/gcs/gcs_server)
  mkdir -p .bench-ray && tar cJf .bench-ray/ray.tar.xz -C "$tmp/tree" .
fi
cat > .bench-env/setup.sh <<'SETUP'
# sourced at the start of every device command (written by bench/device_assets.sh)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
[ -f .bench-ray/ray.tar.xz ] && { tar xJf .bench-ray/ray.tar.xz -C /tmp/site || exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader
git log --oneline -1 2>/dev/null || true
SETUP
du -sh .whl .bench-assets .bench-env .bench-ray 2>/dev/null || true
