"""Stage grpo's keys at validate, its prompts, and the evidence that TRL has no PPO trainer (stage ppo is written in
backend/stages/ppo.py) (no torch training here)."""
from __future__ import annotations

import importlib
import json
import pkgutil

import pytest

from backend.core.spec import SpecError, spec_fields, validate_spec
from backend.stages import get_stage, matches

BASE = {"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "dataset": "extraction_demo"}
GRPO_KEYS = ("reward_funcs", "reward_weights", "reward_schema", "reward_regex", "num_generations",
             "max_completion_length", "grpo_beta", "grpo_epsilon", "use_vllm")


def errors(**keys) -> dict[str, str]:
    try:
        validate_spec({**BASE, **keys})
    except SpecError as exc:
        return dict(exc.errors)
    return {}


def test_trl_ships_no_ppo_trainer_so_ppo_is_written_here():
    """The evidence backend/stages/ppo.py's docstring cites: no module or class named PPO anywhere in trl.trainer or
    trl.experimental. Stage ppo validates with a reward, and says what it needs without one."""
    import trl

    found = []
    for package in ("trl.trainer", "trl.experimental"):
        module = importlib.import_module(package)
        found += [m.name for m in pkgutil.walk_packages(module.__path__, package + ".") if "ppo" in m.name.split(".")[-1]]
    assert not found and not hasattr(trl, "PPOTrainer") and not hasattr(trl, "PPOConfig")
    assert not hasattr(importlib.import_module("trl.experimental"), "PPOTrainer")
    assert errors(stage="ppo")["reward_model"].startswith("stage ppo needs a reward: reward_model")
    assert errors(stage="ppo", reward_funcs="json_valid", ppo_epochs=2, ppo_whiten_rewards=True) == {}
    # it generates while it trains (the Train tab shows its completions table), with transformers only
    assert get_stage("ppo").generates
    assert errors(stage="ppo", reward_funcs="json_valid", use_vllm=True)["use_vllm"].startswith(
        "not supported: stage ppo generates its responses with transformers")


def test_grpo_keys_are_documented_for_the_online_rl_stages():
    rows = {f["name"]: f for f in spec_fields()}
    for key in GRPO_KEYS:  # stage rloo reads every key of grpo
        assert {"grpo", "rloo"} <= set(rows[key]["stages"]) and "sft" not in rows[key]["stages"], key
        assert rows[key]["description"], key
    assert {"grpo", "rloo"} <= set(rows["stage"]["choices"])
    assert get_stage("grpo").shared_fields == get_stage("rloo").shared_fields == ("temperature", "top_p")
    assert matches("rewards/json_valid/mean", "rewards/*/mean") and not matches("reward", "rewards/*")


def test_grpo_settings_checked_at_validate(tmp_path):
    assert errors(stage="grpo")["reward_funcs"].startswith("stage grpo needs at least one reward function")
    ok = validate_spec({**BASE, "stage": "grpo", "reward_funcs": ["json_schema", "field_f1"], "reward_weights": [1, 0.5]})
    assert ok.reward_funcs == "json_schema,field_f1" and ok.reward_weights == "1,0.5"
    assert "not a built-in reward" in errors(stage="grpo", reward_funcs="json_vaild")["reward_funcs"]
    assert "is not a file" in errors(stage="grpo", reward_funcs="nowhere.py:f")["reward_funcs"]
    assert "1 weights for 2 reward functions" in errors(stage="grpo", reward_funcs="json_valid,field_f1",
                                                        reward_weights="1")["reward_weights"]
    assert errors(stage="grpo", reward_funcs="json_valid", reward_regex="x")["reward_regex"].startswith("not supported")
    assert "not a valid regular expression" in errors(stage="grpo", reward_funcs="format_regex",
                                                      reward_regex="(")["reward_regex"]
    assert errors(stage="grpo", reward_funcs="json_valid", reward_schema="{}")["reward_schema"].startswith("not supported")
    assert "not a valid JSON Schema" in errors(stage="grpo", reward_funcs="json_schema",
                                               reward_schema='{"type": 5}')["reward_schema"]
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "required": ["a"]}')
    assert not errors(stage="grpo", reward_funcs="json_schema", reward_schema=str(schema))
    assert "must be a multiple of num_generations" in errors(
        stage="grpo", reward_funcs="json_valid", per_device_train_batch_size=3, gradient_accumulation_steps=1,
        num_generations=2)["num_generations"]
    assert "must be below cutoff_len" in errors(stage="grpo", reward_funcs="json_valid", cutoff_len=64,
                                                max_completion_length=64)["max_completion_length"]
    assert "temperature must be above 0" in errors(stage="grpo", reward_funcs="json_valid", temperature=0)["temperature"]
    for key, value in (("packing", True), ("val_size", 0.1), ("do_predict", True), ("mask_history", True)):
        assert errors(stage="grpo", reward_funcs="json_valid", **{key: value})[key].startswith("not supported"), key
    assert not errors(stage="grpo", reward_funcs="json_valid", grpo_beta=0, grpo_epsilon=0.1)


@pytest.mark.parametrize("stage", ["grpo", "rloo"])
def test_grpo_keys_reach_trls_config(stage, tmp_path):
    """Each GRPO key lands on GRPOConfig (stage rloo: RLOOConfig) under TRL's name (built the way the stage builds
    it)."""
    from trl import GRPOConfig, RLOOConfig

    from backend.stages.base import training_arguments
    from backend.stages.grpo import grpo_config
    from backend.stages.rloo import rloo_config

    spec = validate_spec({**BASE, "stage": stage, "reward_funcs": "json_valid,field_f1", "reward_weights": "2,0.5",
                          "num_generations": 2, "max_completion_length": 40, "grpo_beta": 0.1, "grpo_epsilon": 0.3,
                          "temperature": 0.7, "top_p": 0.9, "per_device_train_batch_size": 2,
                          "gradient_accumulation_steps": 3}, check_files=False)
    args_class, config = (GRPOConfig, grpo_config) if stage == "grpo" else (RLOOConfig, rloo_config)
    args = training_arguments(spec, tmp_path, has_eval=False, args_class=args_class, extra=config(spec))
    assert (args.num_generations, args.max_completion_length, args.beta, args.epsilon) == (2, 40, 0.1, 0.3)
    assert (args.temperature, args.top_p, args.reward_weights, args.use_vllm) == (0.7, 0.9, [2.0, 0.5], False)
    assert args.generation_batch_size == 6  # completions per optimizer step: 3 prompts x 2 generations
    assert grpo_config(validate_spec({**BASE, "stage": "grpo", "reward_funcs": "json_valid", "use_vllm": False},
                                     check_files=False))["reward_weights"] is None


def test_use_vllm_refused_without_vllm_or_a_gpu():
    message = errors(stage="grpo", reward_funcs="json_valid", use_vllm=True)["use_vllm"]
    assert "vllm is not installed" in message or "needs a GPU" in message


def test_prompts_are_rendered_by_our_template_with_their_reference(tmp_path):
    """Each row's prompt is the conversation up to the assistant's turn, as our template renders it for
    generation; its answer is the reference; a long prompt keeps its newest tokens."""
    from backend.dataprep.data import load_examples
    from backend.core.rundir import RunDir
    from backend.stages.grpo import prompt_rows
    from backend.dataprep.templates import get_template
    from transformers import AutoTokenizer

    from backend.training.models import materialize_gguf
    from backend.core.paths import default_model_file

    tokenizer = AutoTokenizer.from_pretrained(materialize_gguf(default_model_file()))
    template = get_template("qwen")
    spec = validate_spec({**BASE, "stage": "grpo", "reward_funcs": "json_valid", "cutoff_len": 160,
                          "max_completion_length": 32}, check_files=False)
    examples, _ = load_examples("extraction_demo", stage="grpo", max_samples=6)
    run_dir = RunDir(tmp_path)
    rows, ids = prompt_rows(spec, run_dir, examples, template, tokenizer)
    assert len(rows) == 6
    first = examples[0]["messages"]
    assert rows[0]["prompt"] == template.render_text(first[:-1], add_generation_prompt=True)
    assert rows[0]["prompt"].endswith("<|im_start|>assistant\n") and rows[0]["reference"] == first[-1]["content"]
    assert all(len(ids[r["prompt"]]) <= 160 - 32 for r in rows)
    long = [r for r in rows if len(tokenizer(r["prompt"], add_special_tokens=False).input_ids) > 128]
    assert long, "the test wants a prompt longer than cutoff_len - max_completion_length"
    full = tokenizer(long[0]["prompt"], add_special_tokens=False).input_ids
    assert ids[long[0]["prompt"]] == full[-128:]
    assert "oldest tokens were cut" in (tmp_path / "running_log.txt").read_text()
    # reward_schema travels with every row (json_schema and a user's function read it as `schema`)
    spec = validate_spec({**BASE, "stage": "grpo", "reward_funcs": "json_schema", "cutoff_len": 160,
                          "max_completion_length": 32, "reward_schema": '{"type": "object", "required": ["a"]}'},
                         check_files=False)
    rows, _ = prompt_rows(spec, run_dir, examples[:2], template, tokenizer)
    assert [json.loads(r["schema"]) for r in rows] == [{"type": "object", "required": ["a"]}] * 2
    # a prompts row may have no answer (no reference): a conversation that ends with the user's turn
    no_answer = [{"messages": [{"role": "user", "content": "Say hi"}], "tools": None}]
    rows, _ = prompt_rows(spec, run_dir, no_answer, template, tokenizer)
    assert rows[0]["reference"] is None


def test_a_prompts_dataset_may_hold_rows_without_an_answer(tmp_path):
    """For stage grpo a row whose conversation ends with the user (or an alpaca row without output) is a
    prompt with no reference; for sft the same rows are bad rows."""
    from backend.dataprep.data import load_examples

    (tmp_path / "chat.json").write_text(json.dumps([
        {"messages": [{"role": "user", "content": "Give JSON"}]},
        {"messages": [{"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": "{}"}]}]))
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "Give JSON", "output": ""},
                                                      {"instruction": "Give JSON", "output": "{}"}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "chat": {"file_name": "chat.json", "formatting": "openai", "columns": {"messages": "messages"}},
        "alpaca": {"file_name": "alpaca.json"}}))
    for name in ("chat", "alpaca"):
        examples, _ = load_examples(name, tmp_path, stage="grpo")
        assert [e["messages"][-1]["role"] for e in examples] == ["user", "assistant"], name
        assert len(load_examples(name, tmp_path, stage="sft")[0]) == 1, name
