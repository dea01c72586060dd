#!/usr/bin/env bash
# The test command: set-up (idempotent), ruff (lint and format check, seconds), then the whole suite (real SGLang on
# CPU; GPU tests skip without CUDA).
# --fast (first argument): tests/unit only, the tests that start no process (20-45 s; tests/conftest.py says which
# folder is which). Extra arguments go to pytest (e.g. -k manifest). pytest's "no tests ran" (exit 5) is a failure
# here.
set -uo pipefail
paths=()
if [[ ${1:-} == --fast ]]; then
  shift
  paths=(tests/unit)
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" || exit 1
cd "$root"
export HF_HUB_OFFLINE=1
"$root/.venv/bin/ruff" check . && "$root/.venv/bin/ruff" format --check . || { echo "test.sh: ruff failed" >&2; exit 1; }
"$root/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=40 "${paths[@]}" "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "test.sh: pytest collected no tests; failing" >&2
  exit 1
fi
exit $rc
