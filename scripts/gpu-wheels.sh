#!/usr/bin/env bash
# Download here, beforehand, what scripts/gpu-check.sh installs on a lent GPU machine that
# has no network: its image has torch, transformers, accelerate and peft, not hydra-core,
# omegaconf, datasets, deepspeed or liger-kernel. Into .gpu-wheels/ (ignored by git), for
# the image's Python (default 3.12: give another as the first argument), the lock's
# versions (runner/constraints.txt) but for pyarrow (below), at most 64 MiB in all (what
# travels with the working tree). The image's own torch, transformers, accelerate and peft
# are kept: the check's `runner env` prints them beside the lock's.
#
#   scripts/gpu-wheels.sh            # then: run scripts/gpu-check.sh with carry [".gpu-wheels"]
#   scripts/gpu-wheels.sh 3.11
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
OUT=.gpu-wheels
rm -rf "$OUT" && mkdir -p "$OUT"
version() {  # the lock's pin of a distribution (its canonical name)
  local v
  v=$(sed -n "s/^$1==\([^ ;]*\).*/\1/p" runner/constraints.txt)
  [ -n "$v" ] || { echo "gpu-wheels: $1 is not in runner/constraints.txt" >&2; exit 1; }
  echo "$v"
}
# Binary wheels for that Python on x86-64 Linux, without their dependencies: each is named.
# Left out as the image has them (its package list: ../.library/device/KINDS.md) or the check does not
# need them: pyarrow and pandas (49 and 12 MB: with the working tree they would pass the 64 MiB that
# travels), huggingface-hub (transformers 5's),
# ninja (deepspeed's JIT ops only), tzdata (pandas reads time zones from the system's). `import deepspeed`
# itself needs einops, msgpack and pydantic (with pydantic-core, annotated-types, typing-inspection).
download() {
  python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$OUT" \
    --python-version "$PY" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
download "hydra-core==$(version hydra-core)" "omegaconf==$(version omegaconf)" "datasets==$(version datasets)" \
  "torchdata==$(version torchdata)" "liger-kernel==$(version liger-kernel)" \
  "dill==$(version dill)" "multiprocess==$(version multiprocess)" \
  "xxhash==$(version xxhash)" "fsspec==$(version fsspec)" "python-dateutil==$(version python-dateutil)" \
  "hjson==$(version hjson)" "py-cpuinfo==$(version py-cpuinfo)" "msgpack==$(version msgpack)" "einops==$(version einops)" \
  "pydantic==$(version pydantic)" "pydantic-core==$(version pydantic-core)" "annotated-types==$(version annotated-types)" \
  "typing-inspection==$(version typing-inspection)"
# Only sources on PyPI: built into wheels here (pure Python; deepspeed's ops build on first use).
python -m pip wheel -q --disable-pip-version-check --no-deps -w "$OUT" "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
python -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$OUT" "deepspeed==$(version deepspeed)"
total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
ls -l "$OUT"
echo "gpu-wheels: $(ls "$OUT"/*.whl | wc -l) wheels, $((total / 1048576)) MiB of 64 MiB, for Python $PY"
if [ "$total" -gt $((64 * 1048576)) ]; then
  echo "gpu-wheels: over the 64 MiB that travel with the working tree: leave out what the image has" >&2
  exit 1
fi
