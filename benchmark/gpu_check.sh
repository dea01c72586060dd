#!/usr/bin/env bash
# The prepared device check (issue 6): copy engine order and fences, reclaim integrity on device buffers, copy
# timings, the Triton scoring kernel against the torch reference, scoring cost, SnapKV window scores, sliding-window
# indices by logical position (and FlashInfer's kernel over them where it is installed), decode queries
# written by CUDA graph replays (score policies under graphs) and their cost; one table.
# Needs only python3 with torch and triton (no sglang, no pytest, nothing downloaded); about 1-2 min on one GPU,
# killed at 480 s (exit 124; the rows printed so far stay).
#
# With the session's device tool (its command line runs in the repo root of a copy of the working tree; files
# written under $OUT come back):
#     run(command="bash benchmark/gpu_check.sh --json $OUT/gpu_check.json", timeout_s=540)
# Arguments go to gpu_check.py: --quick, --device cuda|cpu, --json PATH. Exit status: 0 all ok, 1 a correctness
# check failed, 2 only a timing failed, 124 timed out.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# vToken's CPU kernels (the host Token Table's, the CPU scoring's) would be compiled here first, on device time
# (~40 s where a compiler and ninja are found); this check is about CUDA, so the host side runs torch ops
export VTOKEN_SGLANG_CPU_KERNEL="${VTOKEN_SGLANG_CPU_KERNEL:-0}"
exec timeout 480 python3 -u benchmark/gpu_check.py "$@"
