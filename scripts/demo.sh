#!/usr/bin/env bash
# The main job: set-up (idempotent), the tiny model, a vToken server, a short load, the printed summary.
# Extra arguments go to benchmark/quickstart.py (e.g. -- --vtoken-policy none).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
export HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
exec "$root/.venv/bin/python" "$root/benchmark/quickstart.py" "$@"
