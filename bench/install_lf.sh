#!/bin/bash
# LLaMA-Factory (PyPI `llamafactory`) in its own venv, bench/.venv-lf: its pins differ from ours. torch goes in
# first (the local CPU wheel), then llamafactory constrained to that torch so nothing replaces it.
# Exits non-zero (and bench/run.py skips LLaMA-Factory, saying why) when it cannot install.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$HERE/.venv-lf"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
if [ -x "$VENV/bin/llamafactory-cli" ] && "$VENV/bin/python" -c "import llamafactory" 2>/dev/null; then
  echo "LLaMA-Factory already installed in $VENV"; exit 0
fi
python3 -m venv "$VENV"
PIP="$VENV/bin/pip -q --disable-pip-version-check"
$PIP install --upgrade pip
$PIP install "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" > "$VENV/constraints.txt"
$PIP install -c "$VENV/constraints.txt" llamafactory
# PyPI's torchvision/torchaudio builds do not load against the local CPU torch ("operator torchvision::nms does
# not exist" when transformers imports torchvision; torchaudio's library fails): text fine-tuning needs neither.
# LLaMA-Factory still imports torchaudio at start: bench/run.py gives its run the stub in bench/lf_shims.
for package in torchvision torchaudio; do
  if ! "$VENV/bin/python" -c "import $package" 2>/dev/null; then $PIP uninstall -y $package; fi
done
"$VENV/bin/python" -c "import llamafactory, torch; print('llamafactory', llamafactory.__version__, 'torch', torch.__version__)"
