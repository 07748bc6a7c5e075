#!/usr/bin/env bash
# GPU checks for the paths this CPU machine cannot run: bf16 training, Liger kernels on CUDA, QLoRA
# on CUDA, and the fa2 request falling back to SDPA when flash-attn is not installed.
# Run on a CUDA machine from the repo root. Expects a tiny model in .gpu/tiny_llama and, where the
# machine lacks them, wheels in .whl/ (pydantic, datasets, liger-kernel, bitsandbytes, ...).
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TUNEBOARD_CACHE=/tmp/tb-cache
nvidia-smi -L
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available(), 'bf16', torch.cuda.is_bf16_supported())"
M=.gpu/tiny_llama
COMMON="model_name_or_path=$M template=llama3 dataset=identity max_steps=8 logging_steps=1 cutoff_len=128 per_device_train_batch_size=4 gradient_accumulation_steps=1 learning_rate=0.005 save_steps=1000"
run() {
  name=$1; shift
  echo "=== $name: $*"
  python3 -m backend.cli train $COMMON output_dir=/tmp/runs/$name "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"
  python3 - "$name" <<'PY'
import json, sys
d = f"/tmp/runs/{sys.argv[1]}"
st = json.load(open(f"{d}/status.json"))
rows = [json.loads(l) for l in open(f"{d}/trainer_log.jsonl")] if st.get("state") != "failed" else []
print("state", st["state"], "| warnings", st.get("warnings"), "| error", st.get("error"))
print("losses", [round(r["loss"], 3) for r in rows], "| tok/s", rows[-1]["tokens_per_s"] if rows else None, "| mem MB", rows[-1]["memory_mb"] if rows else None)
PY
  grep -iE "liger|attention|dtype|bf16|flash" "/tmp/runs/$name/running_log.txt" | head -5
}
run bf16_lora bf16=true
run fa2_fallback bf16=true flash_attn=fa2
run liger bf16=true enable_liger_kernel=true
run qlora4 bf16=true quantization_bit=4
run packing_bf16 bf16=true packing=true
run full_bf16 bf16=true finetuning_type=full
python3 - <<'PY'
# which dtype and attention did the bf16 run really use? (reload the saved adapter on the base)
import torch
from backend.core.spec import RunSpec
from backend.training.models import resolve_model, load_model
spec = RunSpec(model_name_or_path=".gpu/tiny_llama", bf16=True, flash_attn="fa2", enable_liger_kernel=True)
warnings = []
m = load_model(spec, resolve_model(spec.model_name_or_path), for_training=True, warn=warnings.append)
print("loaded dtype", m.dtype, "attn", m.config._attn_implementation, "device", m.device, "warnings", warnings)
print("liger patched forward:", type(m).forward.__module__)
PY
