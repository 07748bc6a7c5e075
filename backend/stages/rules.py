"""The stages' own validation rules: what each stage refuses or needs, beside the stage declarations
(backend/stages/__init__.py names, per stage, which of these run, in order). backend.core.spec runs them after the
rules of every stage and names no stage itself.

Light (no torch): the web UI validates forms through backend.core.spec. A rule is `rule(spec, stage, check_files)`
-> [(field, message, fields involved)]; `stage` is the stage's declaration (an alias's fixed pref_loss, say).
The involved set lets validate_spec() drop a rule whose inputs were themselves invalid."""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

from backend.core import rewards, teacher_access
from backend.core.methods import field_applies, is_adapter
from backend.core.refusals import REFUSED

Errors = list[tuple[str, str, frozenset]]


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def kto_batches(spec, stage, check_files: bool = True) -> Errors:
    """KTO's KL term: two or more rows a batch (TRL's trainer refuses one); TRL's KTO has no SFT term."""
    errors: Errors = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field,) + involved)))

    if spec.per_device_train_batch_size < 2:
        err("per_device_train_batch_size", "KTO estimates its KL term from the batch's prompts paired with other "
            "rows' answers: TRL's KTO trainer needs 2 or more rows per batch for it", "stage")
    if spec.pref_ftx > 0:
        err("pref_ftx", "TRL's KTO trainer has no SFT loss term: set pref_ftx to 0 for stage kto "
            "(stage dpo takes it)", "stage")
    return errors


def whole_sequences(spec, stage, check_files: bool = True) -> Errors:
    """A stage that scores whole prompt + answer sequences (reward and preference stages): no packing, and
    no LoRA dropout (TRL's trainers switch it off)."""
    errors: Errors = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field,) + involved)))

    if spec.resolved_packing:
        err("packing", f"stage {spec.stage} scores whole prompt + answer sequences: packing does not apply "
            "(set packing and neat_packing to false)", "stage", "neat_packing")
    if spec.lora_dropout and field_applies(spec, "lora_dropout"):
        err("lora_dropout", f"{REFUSED}: TRL's preference and reward trainers switch dropout off (the policy "
            "and the reference must score the same sequence the same way), so lora_dropout would do nothing: "
            "set it to 0", "stage", "finetuning_type")
    return errors


def no_prompt_loss(spec, stage, check_files: bool = True) -> Errors:
    """A stage that scores the answer given the prompt has no prompt loss to switch on."""
    if spec.train_on_prompt:
        return [("train_on_prompt", f"stage {spec.stage} scores the answer given the prompt: there is no prompt "
                 "loss to switch on", frozenset(("train_on_prompt", "stage")))]
    return []


def preference(spec, stage, check_files: bool = True) -> Errors:
    """Stage dpo and its aliases (orpo, simpo): combinations that cannot run, and keys its loss would ignore."""
    loss = stage.pref_loss or spec.pref_loss
    errors: Errors = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field, "stage", "pref_loss") + involved)))

    default = type(spec).model_fields
    if stage.pref_loss and spec.pref_loss not in (default["pref_loss"].default, stage.pref_loss):
        err("pref_loss", f"stage {spec.stage} trains with pref_loss {stage.pref_loss}: drop pref_loss, or use "
            f"stage {stage.module} with pref_loss {spec.pref_loss}")
    if spec.pref_beta <= 0:
        err("pref_beta", f"must be above 0 for pref_loss {loss} (it scales the preference margin)")
    if spec.ref_model and loss in ("orpo", "simpo"):
        err("ref_model", f"{REFUSED}: {loss} trains without a reference model (drop ref_model, or use pref_loss "
            "sigmoid, hinge or ipo)")
    if spec.dpo_label_smoothing and loss != "sigmoid":
        err("dpo_label_smoothing", f"{REFUSED}: label smoothing (conservative DPO) is a variant of pref_loss "
            f"sigmoid; the {loss} loss has none", "dpo_label_smoothing")
    if spec.dpo_label_smoothing >= 0.5:
        err("dpo_label_smoothing", "must be below 0.5 (at 0.5 chosen and rejected weigh the same: nothing is learnt)")
    if spec.simpo_gamma != default["simpo_gamma"].default and loss != "simpo":
        err("simpo_gamma", f"{REFUSED}: the SimPO target margin is used by pref_loss simpo only (this run uses {loss})")
    if spec.pref_ftx and loss == "orpo":
        err("pref_ftx", f"{REFUSED}: the ORPO loss has its SFT term built in (weight 1; pref_beta weighs the "
            "odds-ratio term), and TRL's ORPO trainer takes no second SFT weight: set pref_ftx to 0")
    if spec.train_on_prompt:
        why = ("ORPO's SFT term always covers the prompt and the chosen answer (TRL's ORPOTrainer, as the ORPO "
               "paper's code) and its odds ratio the answers only" if loss == "orpo" else
               f"the {loss} loss scores the answers given the prompt: there is no prompt loss to switch on")
        err("train_on_prompt", f"{REFUSED}: {why}")
    if spec.mask_history:
        err("mask_history", f"{REFUSED}: stage {spec.stage} always trains on the last turn only (the chosen and "
            "rejected answers): drop mask_history")
    if spec.do_predict:
        err("do_predict", f"{REFUSED}: stage {spec.stage} writes no predictions: run `tuneboard chat` or "
            "`tuneboard eval` (stage sft) with the trained adapter")
    return errors


def _reward_function_errors(spec, names: list[str], err, check_files: bool) -> None:
    """reward_funcs / reward_weights / reward_schema / reward_regex, as every stage with reward functions reads them
    (grpo, rloo, ppo): each name loadable, one weight per function, the schema and regex read by a function that
    takes them."""
    for name in names:
        problem = rewards.name_problem(name, check_files=check_files)
        if problem:
            err("reward_funcs", problem)
    users = [n for n in names if n not in rewards.BUILTINS and not rewards.is_model_name(n)]
    if spec.reward_weights:
        try:
            weights = [float(w) for w in _split(spec.reward_weights)]
        except ValueError:
            err("reward_weights", f"{spec.reward_weights!r}: expected numbers, comma-separated")
        else:
            if len(weights) != len(names):
                err("reward_weights", f"{len(weights)} weights for {len(names)} reward functions: give one weight "
                    "per function, in the order of reward_funcs", "reward_funcs")
    if spec.reward_schema:
        if "json_schema" not in names and not users:
            err("reward_schema", f"{REFUSED}: only the json_schema reward (or your own function, as `schema`) reads "
                "it: add json_schema to reward_funcs or drop reward_schema", "reward_funcs")
        else:
            try:
                rewards.load_schema(spec.reward_schema)
            except ValueError as exc:
                err("reward_schema", str(exc))
    if spec.reward_regex:
        if "format_regex" not in names:
            err("reward_regex", f"{REFUSED}: only the format_regex reward reads it: add format_regex to reward_funcs "
                "or drop reward_regex", "reward_funcs")
        else:
            try:
                re.compile(spec.reward_regex)
            except re.error as exc:
                err("reward_regex", f"not a valid regular expression: {exc}")


def _trains_on_its_own_outputs(spec, stage, err, outputs: str) -> None:
    """Keys an online RL stage (grpo, rloo, ppo) would ignore: it trains on the `outputs` it generates, writes no
    predictions, and its rewards are its live measure (no held-out evaluation while it trains)."""
    for name, why in (("train_on_prompt", f"{stage.title}'s loss covers the generated {outputs} only"),
                      ("mask_history", f"{stage.title} trains on its own {outputs}, not on the dataset's answers"),
                      ("do_predict", f"stage {spec.stage} writes no predictions: run `tuneboard eval` (stage sft) "
                       "with the trained adapter")):
        if getattr(spec, name):
            err(name, f"{REFUSED}: {why}")
    if spec.eval_strategy != "no" or spec.val_size or spec.eval_dataset:
        field = "eval_strategy" if spec.eval_strategy != "no" else ("val_size" if spec.val_size else "eval_dataset")
        err(field, f"{REFUSED}: stage {spec.stage} does not evaluate while it trains (its rewards are the live measure): "
            "compare adapters with `tuneboard eval` or the Evaluate tab", "val_size", "eval_dataset")


def grpo(spec, stage, check_files: bool = True) -> Errors:
    """The online RL stages (grpo, rloo): reward functions that can be loaded, settings TRL's GRPOTrainer and
    RLOOTrainer can run with, keys they ignore."""
    errors: Errors = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field, "stage") + involved)))

    names = rewards.split_names(spec.reward_funcs)
    if not names:
        err("reward_funcs", f"stage {spec.stage} needs at least one reward function ({', '.join(rewards.BUILTINS)}, "
            "module:function / path/to/file.py:function, or a reward model folder)")
    _reward_function_errors(spec, names, err, check_files)
    rows_per_step = spec.per_device_train_batch_size * spec.gradient_accumulation_steps
    if rows_per_step % spec.num_generations:
        err("num_generations", f"per_device_train_batch_size x gradient_accumulation_steps ({rows_per_step}) must be "
            f"a multiple of num_generations ({spec.num_generations}): each step scores whole groups of completions "
            "of one prompt", "per_device_train_batch_size", "gradient_accumulation_steps")
    if spec.max_completion_length >= spec.cutoff_len:
        err("max_completion_length", f"must be below cutoff_len ({spec.cutoff_len}): prompt and completion share it",
            "cutoff_len")
    if spec.temperature <= 0:
        err("temperature", f"{stage.title} samples its completions: temperature must be above 0", "stage")
    if spec.use_vllm:
        if importlib.util.find_spec("vllm") is None:
            err("use_vllm", "vllm is not installed (pip install -e '.[vllm]', on a machine with a GPU): leave "
                "use_vllm off to generate with transformers")
        elif not Path("/dev/nvidiactl").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES"):
            err("use_vllm", "vLLM generation needs a GPU and none is visible here: leave use_vllm off to generate "
                "with transformers")
    if spec.resolved_packing:
        err("packing", f"{REFUSED}: {stage.title} generates completions for whole prompts: packing does not apply",
            "neat_packing")
    _trains_on_its_own_outputs(spec, stage, err, "completions")
    return errors


def _tokenizer_vocab(name: str) -> dict | None:
    """{token: id} of a model folder's tokenizer.json (its model vocabulary and added tokens); None where there is
    no such file to read here (a .gguf file, a hub id: the kd stage compares the loaded tokenizers instead)."""
    path = Path(name).expanduser() / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        vocab = dict(vocab) if isinstance(vocab, dict) else {row[0]: i for i, row in enumerate(vocab)}
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        return vocab
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def vocab_mismatch(student: str, teacher: str) -> str | None:
    """One line saying how the teacher's tokenizer differs from the student's; None when they agree or one of them
    cannot be read from a folder here."""
    if Path(student).expanduser().resolve() == Path(teacher).expanduser().resolve():
        return None
    mine, theirs = _tokenizer_vocab(student), _tokenizer_vocab(teacher)
    if mine is None or theirs is None or mine == theirs:
        return None
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
    return (f"the teacher {teacher} has another tokenizer than the student {student} ({len(theirs)} vs {len(mine)} "
            f"tokens, {len(differ)} token/id pairs differ, first {differ[0][0]!r}): logit distillation compares their "
            "next-token distributions token by token, so both need the same vocabulary")


def kd(spec, stage, check_files: bool = True) -> Errors:
    """Stage kd: a teacher with the student's tokenizer, and keys the distillation loss would ignore."""
    errors: Errors = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field, "stage") + involved)))

    teacher = spec.teacher_model_name_or_path
    if not teacher:
        err("teacher_model_name_or_path", "stage kd needs a teacher model: a local folder, .gguf file or cached hub "
            "id with the student's tokenizer (an SFT run's adapter goes in teacher_adapter)")
    elif check_files:
        problem = vocab_mismatch(str(spec.model_name_or_path), teacher)
        if problem:
            err("teacher_model_name_or_path", problem, "model_name_or_path")
    if spec.teacher_adapter and check_files and not (Path(spec.teacher_adapter).expanduser() / "adapter_config.json").is_file():
        err("teacher_adapter", f"{spec.teacher_adapter} is not an adapter folder (no adapter_config.json)")
    if spec.kd_alpha and spec.kd_lmbda:
        err("kd_alpha", f"{REFUSED}: kd_alpha mixes in the cross-entropy on the dataset's answers, and with kd_lmbda "
            "> 0 a share of the steps trains on the student's own completions, which have none: set kd_alpha or "
            "kd_lmbda to 0", "kd_lmbda")
    if spec.kd_lmbda and spec.max_completion_length >= spec.cutoff_len:
        err("max_completion_length", f"must be below cutoff_len ({spec.cutoff_len}): the prompt and the student's "
            "completion share it", "cutoff_len", "kd_lmbda")
    if spec.resolved_packing:
        err("packing", f"{REFUSED}: stage kd compares teacher and student over whole rows: packing does not apply "
            "(set packing and neat_packing to false)", "neat_packing")
    return errors


def _url(text: str | None) -> str | None:
    """`text` normalised if it is an http(s) base URL, else None (backend.core.teacher_access, the URL rule)."""
    try:
        return teacher_access.normalize_url(text) if text else None
    except ValueError:
        return None


def ppo(spec, stage, check_files: bool = True) -> Errors:
    """Stage ppo: one reward source (a reward model folder or reward functions), settings its loop can run with,
    keys it would ignore."""
    errors: Errors = []

    def err(field: str, message: str, *involved: str) -> None:
        errors.append((field, message, frozenset((field, "stage") + involved)))

    names = rewards.split_names(spec.reward_funcs)
    url = _url(spec.reward_model)
    if spec.reward_model and names:
        err("reward_model", "stage ppo takes one reward source: a reward_model or reward_funcs, not both",
            "reward_funcs")
    elif not spec.reward_model and not names:
        err("reward_model", "stage ppo needs a reward: reward_model (an rm run or sequence-classification folder, or "
            "a scoring endpoint's URL with reward_model_type api) or reward_funcs "
            f"({', '.join(rewards.BUILTINS)}, or module:function / path/to/file.py:function)", "reward_funcs")
    elif spec.reward_model_type == "api":
        if not url:
            err("reward_model", f"{spec.reward_model} is not an http(s) URL: with reward_model_type api, reward_model "
                "is the scoring endpoint (http://host:port, which answers POST /v1/score/evaluation)",
                "reward_model_type")
    elif spec.reward_model and url:
        err("reward_model_type", f"{spec.reward_model} is a URL: set reward_model_type api to score through that "
            "endpoint (lora and full load a reward model folder)", "reward_model")
    elif spec.reward_model and check_files:
        folder = Path(spec.reward_model).expanduser()
        adapter = (folder / "adapter_config.json").is_file()
        if not folder.is_dir():
            err("reward_model", f"{spec.reward_model} is not a folder (give a stage rm run's output_dir or a "
                "sequence-classification model folder)")
        elif adapter != is_adapter(spec.reward_model_type):  # reward_model_type names the method of the rm run
            err("reward_model_type", f"{spec.reward_model} holds " + ("an adapter: set reward_model_type lora" if adapter
                else "a full model (no adapter_config.json): set reward_model_type full"), "reward_model")
    for key in ("reward_model_api_key_env", "reward_model_api_key_file"):
        if getattr(spec, key) and not (spec.reward_model_type == "api" and spec.reward_model):
            err(key, f"{REFUSED}: {key} is the key of a scoring endpoint: it applies with reward_model_type api and "
                "reward_model the endpoint's URL only", "reward_model_type")
    key_file = spec.reward_model_api_key_file
    if key_file and check_files and not Path(key_file).expanduser().is_file():
        err("reward_model_api_key_file", f"{key_file} is not a file")
    _reward_function_errors(spec, names, err, check_files)
    if spec.ppo_target != type(spec).model_fields["ppo_target"].default and not spec.adap_kl_ctrl:
        err("ppo_target", f"{REFUSED}: the KL weight is fixed (adap_kl_ctrl false), so no target steers it: drop "
            "ppo_target or set adap_kl_ctrl true", "adap_kl_ctrl")
    if spec.max_completion_length >= spec.cutoff_len:
        err("max_completion_length", f"must be below cutoff_len ({spec.cutoff_len}): prompt and response share it",
            "cutoff_len")
    if spec.temperature <= 0:
        err("temperature", "PPO samples its responses: temperature must be above 0")
    several = str(spec.nproc_per_node) not in ("1", "auto") or spec.nnodes > 1  # auto: checked at launch (ppo.py)
    if several or spec.deepspeed or spec.accelerate_config:
        field = "deepspeed" if spec.deepspeed else ("accelerate_config" if spec.accelerate_config else "nproc_per_node")
        err(field, f"{REFUSED}: stage ppo's rollout loop (generate, score, ppo_epochs updates) is written for one "
            "process: it neither shards the model nor gathers rollouts across ranks; run it on one device")
    if spec.use_vllm:
        err("use_vllm", f"{REFUSED}: stage ppo generates its responses with transformers (its rollout loop has no "
            "vLLM engine); stage grpo or rloo can generate with vLLM")
    if spec.resolved_packing:
        err("packing", f"{REFUSED}: PPO generates responses for whole prompts: packing does not apply", "neat_packing")
    _trains_on_its_own_outputs(spec, stage, err, "responses")
    return errors
