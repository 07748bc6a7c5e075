"""For LLaMA-Factory's PPO run in bench/.venv-lf-ppo (bench/run.py --recipe ppo puts this folder on PYTHONPATH).

LLaMA-Factory 0.9.5's PPO trainer needs TRL 0.8.6-0.9.6 (TRL 0.10 replaced that PPOTrainer), but its CLI imports
every stage's trainer at start, and the KTO and DPO trainers import prepare_deepspeed / prepare_fsdp from
trl.models.utils, which TRL 0.9.6 does not have: the CLI stops with an ImportError before any stage runs. Stand-ins
with those names let it start; the PPO run never calls them (they are DeepSpeed / FSDP wrappers) and says so if
anything does."""


def _absent(*args, **kwargs):
    raise RuntimeError("bench/lf_ppo_shims: prepare_deepspeed / prepare_fsdp are stand-ins (TRL 0.9.6 has neither)")


try:
    import trl.models.utils as _utils
except ImportError:  # not the PPO venv
    pass
else:
    for _name in ("prepare_deepspeed", "prepare_fsdp"):
        if not hasattr(_utils, _name):
            setattr(_utils, _name, _absent)
