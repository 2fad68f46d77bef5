#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py, docs/gpus.md): every case side by side in one call,
# one table (markdown and JSON) in the output folder. On the lent GPU machine, as it is:
# what it lacks is installed from .gpu-wheels/ (scripts/gpu-wheels.sh, run beforehand
# where there is a network), runner runs from this checkout (no install), then the cases.
#
#   scripts/gpu-check.sh OUT_DIR          # on a GPU (about 6 minutes on one H100)
#   scripts/gpu-check.sh --cpu OUT_DIR    # the same cases, tiny, on a CPU (CI runs this)
#   scripts/gpu-check.sh OUT_DIR --only "runner, bf16;~0.5B from config, GRPO"   # some cases only
set -uo pipefail
cd "$(dirname "$0")/.."
CPU=""
if [ "${1:-}" = "--cpu" ]; then CPU="--cpu"; shift; fi
OUT=${1:-${OUT:-gpu-check}}
shift || true  # the rest goes to bench/gpu_check.py (--only)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d .gpu-wheels ]; then  # also with --cpu: a rehearsal of the install on a bare image
  missing=()
  for module_wheel in hydra:hydra-core omegaconf:omegaconf antlr4:antlr4-python3-runtime datasets:datasets \
      torchdata:torchdata liger_kernel:liger-kernel deepspeed:deepspeed pyarrow:pyarrow pandas:pandas dill:dill \
      multiprocess:multiprocess xxhash:xxhash hjson:hjson cpuinfo:py-cpuinfo msgpack:msgpack einops:einops dateutil:python-dateutil \
      pydantic:pydantic pydantic_core:pydantic-core annotated_types:annotated-types typing_inspection:typing-inspection; do
    python -c "import ${module_wheel%%:*}" 2>/dev/null || missing+=("${module_wheel#*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu-check: installing from .gpu-wheels: ${missing[*]}"
    python -m pip install -q --no-index --no-deps --find-links .gpu-wheels "${missing[@]}" 2>&1 | tail -5
  fi
fi
python - <<'PY'
import torch
print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PY
# The image's versions beside the lock's (runner/constraints.txt): its own torch, transformers,
# accelerate and peft are kept, and a fenced patch they do not engage is named in each run's banner.
python -m runner env | grep -E '\(locked|verified set' | tee "$OUT/versions.txt"
exec python bench/gpu_check.py $CPU --out "$OUT" "$@"
