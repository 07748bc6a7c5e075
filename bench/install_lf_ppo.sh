#!/bin/bash
# LLaMA-Factory's PPO in its own venv, bench/.venv-lf-ppo (bench/run.py --recipe ppo; see bench/rl.py).
# LLaMA-Factory 0.9.5's PPO trainer is TRL 0.9.6's PPOTrainer (it refuses any TRL outside 0.8.6-0.9.6; TRL 0.10
# replaced that trainer), and TRL 0.9.6 predates transformers 5, so this venv holds transformers 4.55.4 (the oldest
# LLaMA-Factory 0.9.5 admits) and trl 0.9.6 over llamafactory 0.9.5, with the local torch CPU wheel first as
# bench/install_lf.sh does. LLaMA-Factory's start-up check (trl >= 0.18) is switched off for the run by its own
# DISABLE_VERSION_CHECK=1, and bench/lf_ppo_shims gives its CLI the two TRL names its other trainers import.
# Exits non-zero (and bench/run.py skips LLaMA-Factory's PPO, saying why) when it cannot install.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$HERE/.venv-lf-ppo"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
if [ -x "$VENV/bin/llamafactory-cli" ] && "$VENV/bin/python" -c "import llamafactory, trl; assert trl.__version__ == '0.9.6'" 2>/dev/null; then
  echo "LLaMA-Factory's PPO venv already installed in $VENV"; exit 0
fi
python3 -m venv "$VENV"
PIP="$VENV/bin/pip -q --disable-pip-version-check"
$PIP install --upgrade pip
$PIP install "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" > "$VENV/constraints.txt"
$PIP install -c "$VENV/constraints.txt" "llamafactory==0.9.5" "transformers==4.55.4"
$PIP install -c "$VENV/constraints.txt" --no-deps "trl==0.9.6"
for package in torchvision torchaudio; do  # as in bench/install_lf.sh: no build of either loads against this torch
  if ! "$VENV/bin/python" -c "import $package" 2>/dev/null; then $PIP uninstall -y $package; fi
done
"$VENV/bin/python" -c "import llamafactory, torch, transformers, trl; print('llamafactory', llamafactory.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
