#!/usr/bin/env bash
# Try the newest releases against the lock (runner/constraints.txt), on purpose, in a venv
# of their own, and print the table a lock bump's commit message carries (docs/versions.md).
#
#   scripts/newest.sh [OUT]                    every dependency at the newest its range allows
#   scripts/newest.sh --only accelerate [OUT]  the lock, but one library at its newest
#   scripts/newest.sh --torch newest [OUT]     torch too (default: the locked torch; on a CPU
#                                              machine the registry's newest is a CUDA build, GBs)
#
# OUT (default newest/, ignored by git) gets the venv, each check's log, checks.json, the
# registry's answers, the candidate lock (constraints.txt, from scripts/lock.py) and
# table.md. The checks: every fenced patch's tests (runner/distributed/patches.py), the
# certify smoke (one architecture, every strategy) and the unit tier. Exits 0 when every
# check passed; then `cp OUT/constraints.txt runner/constraints.txt` and commit with the table.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
ONLY="" TORCH=locked
while [ $# -gt 0 ]; do
    case "$1" in
        --only) ONLY=$2; shift 2 ;;
        --torch) TORCH=$2; shift 2 ;;
        -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
        -*) echo "newest: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
case "$TORCH" in locked | newest) ;; *) echo "newest: --torch takes locked or newest" >&2; exit 2 ;; esac
OUT=$(realpath -m "${1:-newest}")
LOCK=$PWD/runner/constraints.txt
rm -rf "$OUT" && mkdir -p "$OUT"
locked() { sed -n "s/^#* *$1==\([^ ;]*\).*/\1/p" "$LOCK" | head -1; }

echo "newest: a fresh venv in $OUT/venv"
python -m venv "$OUT/venv" || exit 1
PY=$OUT/venv/bin/python
$PY -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" | tail -3
pip_install() { $PY -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location"; return "${PIPESTATUS[0]}"; }
if [ "$TORCH" = newest ]; then pip_install --upgrade torch; else pip_install "torch==$(locked torch)"; fi || exit 1
if [ -n "$ONLY" ]; then
    # The lock without that one library's pin, then that library upgraded within it.
    grep -viE "^$ONLY==" "$LOCK" | grep -viE "^$(echo "$ONLY" | tr '_-' '-_')==" >"$OUT/lock-but-$ONLY.txt"
    constraint=(-c "$OUT/lock-but-$ONLY.txt")
    pip_install "${constraint[@]}" -e ".[dev]" || exit 1
    pip_install "${constraint[@]}" --no-build-isolation "$($PY scripts/lock.py --extra deepspeed)" || exit 1
    pip_install "${constraint[@]}" --upgrade --upgrade-strategy only-if-needed "$ONLY" || exit 1
else
    pip_install --upgrade --upgrade-strategy eager -e ".[dev]" || exit 1
    pip_install --upgrade --no-build-isolation "$($PY scripts/lock.py --extra deepspeed)" || exit 1
fi
$PY scripts/lock.py --out "$OUT/constraints.txt" >/dev/null
$PY scripts/newest.py registry "$OUT/registry.json" || echo '{}' >"$OUT/registry.json"

declare -A status
check() {  # name, command...: its log in OUT/NAME.log, its exit code in checks.json
    local name=$1; shift
    echo "newest: $name: $*"
    local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    status[$name]=$?
    echo "newest: $name: exit ${status[$name]} after $((SECONDS - start)) s ($(tail -1 "$OUT/$name.log"))"
}
mapfile -t patch_tests < <($PY scripts/newest.py patch-tests)
check patches "$PY" -m pytest -p no:cacheprovider -m "unit or e2e or multiprocess" "${patch_tests[@]}"
check certify "$OUT/venv/bin/runner" certify gpt2 --work-dir "$OUT/certify"
check unit "$PY" -m pytest -p no:cacheprovider -m unit -n 2

{
    echo "{"
    first=1
    for name in patches certify unit; do
        [ $first = 1 ] || echo ","
        printf '"%s": %s' "$name" "${status[$name]}"
        first=0
    done
    echo "}"
} >"$OUT/checks.json"
$PY scripts/newest.py table --checks "$OUT/checks.json" --registry "$OUT/registry.json" --lock "$LOCK" | tee "$OUT/table.md"
for name in patches certify unit; do [ "${status[$name]}" = 0 ] || exit 1; done
echo "newest: every check passed; to adopt: cp $OUT/constraints.txt runner/constraints.txt, commit with the table above"
