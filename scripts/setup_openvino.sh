#!/usr/bin/env bash
# The peer's set-up for benchmark/peer_openvino.py (not part of the tests): .venv-openvino/ at the repository root
# with OpenVINO GenAI and optimum-intel (requirements/peer/openvino.txt), and SmolLM2-135M-Instruct, the float32
# checkpoint the project builds (scripts/setup.sh), exported to OpenVINO IR in fp32 under
# ~/.cache/vtoken-sglang/openvino/. Idempotent; prints the IR's directory last. optimum-intel's exporter brings torch
# and torchvision (here 2.14.1 / 0.29.1, CUDA builds that run on the CPU): about 6 GB in all.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" >&2
venv="$root/.venv-openvino"
stamp="$venv/.setup-stamp"
want="$(cat "$root/requirements/peer/openvino.txt" "$root/scripts/setup_openvino.sh" | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  [[ -x "$venv/bin/python" ]] || "${PYTHON:-python3}" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  "${pip[@]}" -r "$root/requirements/peer/openvino.txt" >&2
  echo "$want" > "$stamp"
fi
src="$("$root/.venv/bin/python" -c 'from vtoken_sglang.tools import pretrained; print(pretrained.build("smollm2"))')"
out="$HOME/.cache/vtoken-sglang/openvino/$(basename "$src")-fp32"
if [[ ! -f "$out/openvino_model.xml" ]]; then
  HF_HUB_OFFLINE=1 "$venv/bin/optimum-cli" export openvino --model "$src" --task text-generation-with-past \
    --weight-format fp32 "$out.tmp" >&2
  rm -rf "$out" && mv "$out.tmp" "$out"
fi
echo "$out"
