#!/usr/bin/env bash
# Build the qwen-tts 0.1.1 reference side environment that reuses torch/numpy/etc.
# from the project venv (appended to sys.path AFTER the side env's own site-packages).
#   usage: make-ref-env.sh [SIDE_VENV] [PROJECT_VENV]
set -euo pipefail
SIDE=${1:-/tmp/qtts/ref-venv}
PROJ=${2:-/work/main/.venv}
PY=$(readlink -f "$PROJ/bin/python")           # same interpreter as the project venv
PROJ_SP=$("$PROJ/bin/python" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
start=$(date +%s)
rm -rf "$SIDE"
"$PY" -m venv --without-pip "$SIDE"   # pip comes from the project venv (pip --python)
SIDE_SP=$("$SIDE/bin/python" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
# Install with --no-deps BEFORE the .pth exists, so pip never sees (or tries to
# uninstall) the project venv's transformers 5.19 / tokenizers / huggingface_hub.
# torch, torchaudio, numpy, numba, einops, safetensors, regex, requests, tqdm, pyyaml,
# packaging, filelock, psutil, fsspec, hf_xet, cffi, decorator, msgpack, platformdirs,
# typing_extensions, protobuf, sympy come from the project venv.
"$PROJ/bin/python" -m pip --python "$SIDE/bin/python" install -q --no-deps --no-compile \
  qwen-tts==0.1.1 \
  transformers==4.57.3 accelerate==1.12.0 \
  tokenizers==0.22.2 huggingface_hub==0.36.2 \
  librosa==0.11.0 audioread==3.1.0 lazy_loader==0.6 pooch==1.9.0 soxr==1.1.0 \
  scipy==1.17.1 joblib==1.6.0 \
  soundfile==0.14.0 sox==1.5.0 \
  onnxruntime==1.32.0 flatbuffers==25.12.19 coloredlogs==15.0.1 humanfriendly==10.0
echo "$PROJ_SP" > "$SIDE_SP/zz-omnipipe-project-venv.pth"
# list what the side env holds (only its own site-packages)
"$PROJ/bin/python" -m pip list --path "$SIDE_SP" --format=freeze
end=$(date +%s)
echo "built $SIDE in $((end-start)) s; size $(du -sh "$SIDE" | cut -f1)"
"$SIDE/bin/python" - <<'PY'
import sys, torch, numpy, transformers, tokenizers, huggingface_hub, accelerate, qwen_tts
print("python", sys.version.split()[0], "torch", torch.__version__, torch.__file__)
print("numpy", numpy.__version__, "transformers", transformers.__version__, transformers.__file__)
print("tokenizers", tokenizers.__version__, "hub", huggingface_hub.__version__, "accelerate", accelerate.__version__)
print("qwen_tts", qwen_tts.__file__)
PY
