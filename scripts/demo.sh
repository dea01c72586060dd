#!/usr/bin/env bash
# The main job: set-up (idempotent), the tiny local model, then real servers (plain SGLang, Naive-Evict, vToken;
# policies random and streaming) under the same memory-bound load, and the memory/capacity table
# (benchmark/serve_capacity.py --quick, about 4 minutes on 2 cores). Extra arguments go to serve_capacity.py
# (e.g. --json out.json, --policies random).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
export HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
exec "$root/.venv/bin/python" "$root/benchmark/serve_capacity.py" --quick "$@"
