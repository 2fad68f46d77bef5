#!/usr/bin/env bash
# Set this machine up for the tests and run them: the README's test command, and what
# CI runs (.ci/run calls this script).
#
#   scripts/test.sh         every tier: unit, e2e and multiprocess on two pytest-xdist
#                           workers, then the cluster tier alone
#   scripts/test.sh unit    the unit tier only (a minute; once set up, `python -m pytest`)
#
# Set-up, with the pip of the python that runs this (a venv's, if one is active):
# - torch at the lock's version (2.13.0, the CPU build here) only when no torch is installed:
#   on a GPU machine, install the torch build you want first and it is kept;
# - the project, editable, with its dev extras; then deepspeed (its sdist imports torch
#   while building, hence --no-build-isolation, after torch); every version from the lock,
#   runner/constraints.txt (the verified set: a release since cannot turn main red;
#   scripts/newest.sh tries the newest on purpose);
# - for the cluster tier, as root where apt-get exists, the Debian packages of
#   scripts/test-cluster.sh when any is missing, in the background while the other tiers
#   run. Elsewhere (not root, not Debian) the cluster tests skip, naming what to install.
# Exits non-zero if any tier fails (pytest's exit 5, no tests collected, counts as failing).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

case "${1:-all}" in
    all | unit) tiers=${1:-all} ;;
    *) echo "usage: $0 [all|unit]" >&2; exit 2 ;;
esac

# The cluster tier runs last: its Debian packages install in the background meanwhile
# (apt and dpkg beside pip and the other tiers), and it waits for them.
cluster_install=""
if [ "$tiers" = all ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    cluster_log=$(mktemp)
    scripts/test-cluster.sh install >"$cluster_log" 2>&1 &
    cluster_install=$!
fi
python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' ||
    python -m pip install -q "torch==$(sed -n 's/^# torch==//p' runner/constraints.txt)"
python -m pip install -q -c runner/constraints.txt -e ".[dev]"
# deepspeed by itself (--no-build-isolation builds it against the torch installed, and would
# need the project's own build backend here too), its range pyproject.toml's extra.
python -m pip install -q -c runner/constraints.txt --no-build-isolation "$(python scripts/lock.py --extra deepspeed)"
# The versions installed beside the locked ones (and a line naming any that differ).
python -m runner env | grep -E '^- ([A-Za-z_-]+: .*\(locked|verified set)'

if [ "$tiers" = unit ]; then
    exec python -m pytest -m unit
fi
# Both tiers run even when the first fails; the cluster tier alone, because under the
# other tests' load its two-host run lost a worker once.
status=0
# loadgroup: each module of training runs on one worker (tests/conftest.py), its shared runs built once.
durations=$(mktemp --suffix=.xml)
python -m pytest -m "unit or e2e or multiprocess" -n 2 --dist loadgroup --junitxml="$durations" || status=$?
# Where the main tiers' time went, printed before the cluster tier so that a run stopped
# there still shows it.
python scripts/test_durations.py "$durations" || true
rm -f "$durations"
if [ -n "$cluster_install" ]; then
    wait "$cluster_install" || { cat "$cluster_log" >&2; echo "scripts/test-cluster.sh install failed" >&2; status=1; }
    rm -f "$cluster_log"
fi
python -m pytest -m cluster || status=$?
exit "$status"
