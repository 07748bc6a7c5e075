"""PPO (online RL with a value head): prompts -> responses sampled from the policy -> scores (a reward model, or the
reward functions of stage grpo) -> per-token rewards with a KL penalty to the reference -> GAE -> clipped policy and
value losses, ppo_epochs passes over each batch.

Written here because TRL removed its PPOTrainer (TRL 1.16 has none in trl.trainer nor trl.experimental;
tests/backend/test_grpo_spec.py keeps the evidence). The arithmetic is backend/training/ppo_math.py (pure
functions, unit-tested); this module is the loop around it, on the transformers Trainer, so checkpoints, resume,
STOP, the run log and the plots are the ones every stage has.

Reads top to bottom: tokenizer/template -> prompt rows -> reward source -> policy (+adapter) with a value head ->
reference -> trainer -> train -> save.

The model, as LLaMA-Factory trains PPO:
- LoRA (any adapter method): one base model in memory. The policy is the base + the adapter, the value head a
  linear layer on the policy's last hidden state, and the reference the same base with the adapter disabled
  (also after SFT -> PPO with adapter_name_or_path: the reference is then the base, LLaMA-Factory's choice).
- full / freeze: the value head on the policy, and a frozen copy of the starting model as the reference.
- ref_model: that model as the reference instead (a second model in memory).
The reward model (`reward_model`: an rm run folder or a sequence-classification folder) is loaded as its own
model beside the policy (LLaMA-Factory swaps a LoRA reward adapter onto the policy's base instead: not done here);
with reward_model_type api it is a scoring endpoint (e.g. `tuneboard api --reward-model RM_RUN`) instead, asked once
per rollout batch (backend.evaluation.reward_api).

A step is one batch of rollouts: per_device_train_batch_size x gradient_accumulation_steps x ppo_buffer_size
prompts, one response each; then ppo_epochs passes over it, each in ppo_buffer_size optimizer steps of
per_device_train_batch_size x gradient_accumulation_steps responses (LLaMA-Factory's batch sizes). The learning
rate schedule counts these steps (max_steps = rollout batches). The step's last optimizer update is the
Trainer's own (gradient clipping, scheduler, logging); the ones before it are done the same way here.

Saved: the policy (adapter or weights), value_head.safetensors and ppo_state.json (the KL coefficient and the
score statistics of ppo_score_norm), in each checkpoint too: resume_from_checkpoint continues the same run.
Besides the metrics, each logging step appends a sample of the responses with their scores to completions.jsonl
(backend.core.rundir.COMPLETIONS_FILE), as stage grpo does.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file
from peft import set_peft_model_state_dict
from torch import nn
from transformers import Trainer, set_seed

from backend.core import teacher_access
from backend.core.methods import method
from backend.core.rewards import RewardError, build_reward_funcs, metric_name, split_names
from backend.distill.teacher import read_api_key
from backend.evaluation.reward_api import ApiReward
from backend.evaluation.reward_score import RewardModelReward
from backend.serving.engine import stop_token_ids
from backend.stages.base import RunError, StageResult, fit, load_rows, tokenizer_and_template, trainable_model
from backend.stages.base import reference_model as loaded_reference
from backend.stages.grpo import log_completions, prompt_rows
from backend.training import ppo_math
from backend.training.models import load_model

VALUE_HEAD_FILE = "value_head.safetensors"
STATE_FILE = "ppo_state.json"
SAMPLES_PER_LOG = 8  # responses written to completions.jsonl per logging step
KL_HORIZON = 10000  # the adaptive KL controller's horizon (TRL's and LLaMA-Factory's default)


def run(spec, run_dir, stop) -> StageResult:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # nproc_per_node auto on several GPUs (validate refuses the rest)
        raise RunError("stage ppo runs in one process (its rollout loop neither shards the model nor gathers rollouts "
                       "across ranks): set nproc_per_node 1")
    # 1. tokenizer and template
    resolved, tokenizer, template = tokenizer_and_template(spec, run_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    # 2. prompts rendered by our template, each with its reference answer (for the reward functions)
    one_each = spec.model_copy(update={"num_generations": 1})  # (stage grpo's line counts completions per prompt)
    rows, prompt_ids = prompt_rows(one_each, run_dir, load_rows(spec, run_dir, spec.dataset, spec.stage), template,
                                   tokenizer)

    # 3. the reward: a reward model or reward functions
    scorer = Scorer(spec, run_dir, template, tokenizer)

    # 4. policy with a value head, and the reference
    set_seed(spec.seed)
    policy = trainable_model(spec, run_dir, resolved)
    model = PolicyWithValueHead(policy)
    reference = reference_for(spec, run_dir, resolved, policy)

    # 5. train, save, plot
    rollout = spec.per_device_train_batch_size * spec.gradient_accumulation_steps * spec.ppo_buffer_size
    run_dir.log(f"ppo: {rollout} prompts a step, {spec.ppo_epochs} epochs x {spec.ppo_buffer_size} updates of "
                f"{spec.per_device_train_batch_size} x {spec.gradient_accumulation_steps} responses; KL coefficient "
                + (f"{spec.init_kl_coef:g}, adaptive to target {spec.ppo_target:g}" if spec.adap_kl_ctrl
                   else f"{spec.init_kl_coef:g}, fixed"))
    trainer_class = _ppo_trainer_class(spec, run_dir, prompt_ids, scorer, reference,
                                       stop_token_ids(tokenizer, template))
    try:
        return fit(spec, run_dir, stop, model=model, tokenizer=tokenizer, train_dataset=Dataset.from_list(rows),
                   collator=_as_rows, trainer_class=trainer_class,
                   config={"per_device_train_batch_size": rollout, "gradient_accumulation_steps": 1})
    except RewardError as exc:  # a user's reward function misbehaved: one line, no traceback
        raise RunError(str(exc)) from None


def _as_rows(features: list[dict]) -> list[dict]:
    return features  # prompts are generated from as they are: no tensors to collate


class PolicyWithValueHead(nn.Module):
    """The policy (a causal LM, or a peft model on one) and a linear value head on its last hidden state."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
        self.config = policy.config
        self.v_head = nn.Linear(config.hidden_size, 1, dtype=torch.float32)
        nn.init.normal_(self.v_head.weight, std=1 / math.sqrt(config.hidden_size + 1))
        nn.init.zeros_(self.v_head.bias)
        self.v_head.to(next(policy.parameters()).device)

    def forward(self, input_ids, attention_mask):
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                          use_cache=False)
        values = self.v_head(out.hidden_states[-1].float()).squeeze(-1)
        return out.logits, values

    def activation_checkpointing_enable(self, **kwargs):  # the Trainer turns it on through the model
        return self.policy.activation_checkpointing_enable(**kwargs)


def reference_for(spec, run_dir, resolved, policy):
    """The frozen model the KL penalty compares with, or None where it is the policy's base with the adapter
    disabled (LoRA: one base model in memory)."""
    if spec.ref_model:
        return loaded_reference(spec, run_dir, resolved, policy).eval()  # the dpo/kto loader of ref_model
    if method(spec.finetuning_type).adapter:
        run_dir.log("reference model: the base model (the adapter disabled; one base model in memory)"
                    + (f": {spec.adapter_name_or_path} is trained on, not part of the reference"
                       if spec.adapter_name_or_path else ""))
        return None
    run_dir.log(f"reference model: a frozen copy of {spec.model_name_or_path} ({spec.finetuning_type} training "
                "changes the weights themselves)")
    return load_model(spec, resolved, for_training=False, warn=run_dir.warn).requires_grad_(False).eval()


# -- rewards ---------------------------------------------------------------------------------------

class Scorer:
    """The score of each response: the weighted sum of the reward functions (reward_funcs, stage grpo's: built-ins,
    the user's, reward model folders; None counts 0), or the one reward model of `reward_model` (LLaMA-Factory's
    key), which scores the prompt's conversation + the response rendered by the reward model's own template
    (backend.evaluation.reward_score.RewardModelReward, a second model in memory), or with reward_model_type api
    the scoring endpoint at that URL, sent the texts rendered by the policy's template, one request per rollout
    batch (backend.evaluation.reward_api.ApiReward)."""

    def __init__(self, spec, run_dir, template=None, tokenizer=None):
        def reward_model(path: str):
            run_dir.log(f"reward model {metric_name(path)}: loading {path} (a second model in memory)")
            try:
                return RewardModelReward(path, metric_name(path), batch_size=spec.per_device_train_batch_size,
                                         warn=run_dir.warn)
            except ValueError as exc:  # not a reward model, or its base cannot be found: one line naming it
                raise RunError(f"{'reward_model' if spec.reward_model else 'reward_funcs'}: {path}: {exc}") from None

        if spec.reward_model and spec.reward_model_type == "api":
            self.funcs, self.weights = [scoring_endpoint(spec, run_dir, template, tokenizer)], [1.0]
            return
        if spec.reward_model:
            self.funcs, self.weights = [reward_model(spec.reward_model)], [1.0]
            run_dir.log(f"rewards: the reward model {spec.reward_model}")
            return
        try:
            self.funcs = build_reward_funcs(spec.reward_funcs, max_completion_length=spec.max_completion_length,
                                            regex=spec.reward_regex, reward_model=reward_model)
        except RewardError as exc:
            raise RunError(str(exc)) from None
        self.weights = [float(w) for w in split_names(spec.reward_weights)] or [1.0] * len(self.funcs)
        run_dir.log("rewards: " + ", ".join(f"{n} x {w:g}" for n, w in zip(split_names(spec.reward_funcs),
                                                                           self.weights)))

    def __call__(self, rows, prompts, completions, completion_ids) -> tuple[list[float], list[dict]]:
        """(total score of each response, {function name: its score} of each), as stage grpo's rows pass them."""
        columns = {key: [r.get(key) for r in rows] for key in rows[0] if key != "prompt"}
        per_func = {func.__name__: func(prompts, completions, completion_ids=completion_ids, **columns)
                    for func in self.funcs}
        totals, parts = [], []
        for i in range(len(completions)):
            values = {name: scores[i] for name, scores in per_func.items()}
            totals.append(sum(w * (v or 0.0) for w, v in zip(self.weights, values.values())))
            parts.append(values)
        return totals, parts


def scoring_endpoint(spec, run_dir, template, tokenizer) -> ApiReward:
    """reward_model_type api: the endpoint at reward_model, its key read now from reward_model_api_key_env or
    reward_model_api_key_file (never logged); a process the web UI started checks the UI's endpoint policy again
    (backend.core.teacher_access: the key's variable offered for this URL, no internal address unless allowed)."""
    if teacher_access.restricted():
        refused = teacher_access.endpoint_refusals(spec.reward_model, spec.reward_model_api_key_env,
                                                   spec.reward_model_api_key_file, "reward_model",
                                                   url_field="reward_model")
        if refused:
            raise RunError("; ".join(str(r) for r in refused))
    try:
        key = read_api_key(spec.reward_model_api_key_env, spec.reward_model_api_key_file)
    except OSError as exc:
        raise RunError(f"reward_model_api_key_file: {spec.reward_model_api_key_file}: {exc.strerror or exc}") from None
    source = (f"the file {spec.reward_model_api_key_file}" if spec.reward_model_api_key_file
              else f"${spec.reward_model_api_key_env}" if spec.reward_model_api_key_env else None)
    reward = ApiReward(spec.reward_model, key, template=template, tokenizer=tokenizer, cutoff_len=spec.cutoff_len)
    run_dir.log(f"rewards: the scoring endpoint {reward.url}, one request per rollout batch, "
                + (f"with the API key from {source}" if key else
                   f"no API key ({source} holds none)" if source else "no API key"))
    return reward


# -- the trainer -----------------------------------------------------------------------------------

def _gather(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities of `tokens` under logits / temperature (the distribution they were sampled from)."""
    logp = torch.log_softmax(logits.float() / max(temperature, 1e-7), dim=-1)
    return torch.gather(logp, 2, tokens.unsqueeze(-1)).squeeze(-1)


def kl_controller(spec) -> ppo_math.KLController:
    """init_kl_coef, adapted towards ppo_target unless adap_kl_ctrl is false."""
    return ppo_math.KLController(spec.init_kl_coef, spec.ppo_target if spec.adap_kl_ctrl else None, KL_HORIZON)


def advantages_and_returns(spec, scores, logprobs, ref_logprobs, values, mask, kl_coef: float,
                           moments: ppo_math.RunningMoments):
    """(whitened advantages, returns, per-token kl) of a rollout batch: the scores normalised by every score seen
    (ppo_score_norm), the KL penalty to the reference, the rewards whitened (ppo_whiten_rewards), GAE (gamma, lam)."""
    if spec.ppo_score_norm:
        scores = moments.normalize(scores)
    rewards, kl = ppo_math.token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef)
    if spec.ppo_whiten_rewards:
        rewards = ppo_math.whiten(rewards, mask, shift_mean=False)
    advantages, returns = ppo_math.gae(rewards, values, mask, spec.gamma, spec.lam)
    return ppo_math.whiten(advantages, mask), returns, kl


def ppo_loss(spec, logprobs, old_logprobs, advantages, values, old_values, returns, mask) -> tuple[torch.Tensor, dict]:
    """(policy loss + vf_coef x value loss, the logged figures) of a minibatch (cliprange, cliprange_value)."""
    pg_loss, pg_stats = ppo_math.policy_loss(logprobs, old_logprobs, advantages, mask, spec.cliprange)
    vf_loss, vf_stats = ppo_math.value_loss(values, old_values, returns, mask, spec.cliprange_value)
    stats = {"policy_loss": pg_loss.item(), "value_loss": vf_loss.item(), **pg_stats, **vf_stats}
    return pg_loss + spec.vf_coef * vf_loss, stats


def _ppo_trainer_class(spec, run_dir, prompt_ids: dict[str, list[int]], scorer, reference, stop_ids: list[int]):

    class _PPOTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kl_ctl = kl_controller(spec)
            self.moments = ppo_math.RunningMoments()
            self.ppo_stats: dict[str, list[float]] = defaultdict(list)
            self.samples: list[dict] = []

        # one step = one rollout batch and ppo_epochs passes over it
        def training_step(self, model, inputs, num_items_in_batch=None):
            batch = self.rollout(model, inputs)
            return self.optimize(model, batch)

        def _track_num_input_tokens(self, inputs):
            pass  # counted in rollout(): the generated tokens are not in the inputs

        @torch.no_grad()
        def rollout(self, model, rows: list[dict]) -> dict:
            wrapper = self.accelerator.unwrap_model(model)
            policy, tok = wrapper.policy, self.processing_class
            device = next(wrapper.parameters()).device
            prompts = [prompt_ids[r["prompt"]] for r in rows]
            width = max(len(p) for p in prompts)
            query = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
            query_mask = torch.zeros_like(query)
            for i, p in enumerate(prompts):  # left-padded: every response starts at column `width`
                query[i, width - len(p):], query_mask[i, width - len(p):] = torch.tensor(p), 1
            query, query_mask = query.to(device), query_mask.to(device)
            model.eval()
            out = policy.generate(input_ids=query, attention_mask=query_mask, do_sample=True,
                                  temperature=spec.temperature, top_p=spec.top_p, top_k=0,
                                  max_new_tokens=spec.max_completion_length, eos_token_id=stop_ids,
                                  pad_token_id=tok.pad_token_id, use_cache=True)
            response = out[:, width:]
            mask = torch.ones_like(response)
            for i in range(len(rows)):  # a response ends with its first end-of-turn token (kept)
                ends = [j for j, t in enumerate(response[i].tolist()) if t in stop_ids]
                if ends:
                    mask[i, ends[0] + 1:] = 0
            keep = int(mask.sum(1).max())
            response, mask = response[:, :keep], mask[:, :keep]
            response = response.masked_fill(mask == 0, tok.pad_token_id)
            sequence = torch.cat([query, response], dim=1)
            attention = torch.cat([query_mask, mask], dim=1)
            logits, values = model(input_ids=sequence, attention_mask=attention)
            logprobs = _gather(logits[:, width - 1:-1], response, spec.temperature)
            values = values[:, width - 1:-1].float()
            if reference is None:
                with policy.disable_adapter():
                    ref_logits = policy(input_ids=sequence, attention_mask=attention, use_cache=False).logits
            else:
                ref_logits = reference(input_ids=sequence, attention_mask=attention, use_cache=False).logits
            ref_logprobs = _gather(ref_logits[:, width - 1:-1], response, spec.temperature)
            self.state.num_input_tokens_seen += int(attention.sum())

            ids = [response[i][mask[i].bool()].tolist() for i in range(len(rows))]
            texts = [tok.decode(x, skip_special_tokens=True) for x in ids]
            prompt_texts = [r["prompt"] for r in rows]
            raw, parts = scorer(rows, prompt_texts, texts, ids)
            mask = mask.float()
            scores = torch.tensor(raw, dtype=torch.float32, device=device)
            advantages, returns, kl = advantages_and_returns(spec, scores, logprobs, ref_logprobs, values, mask,
                                                             self.kl_ctl.value, self.moments)

            sequence_kl = kl.sum(1).mean().item()
            stats = self.ppo_stats
            stats["reward"].append(float(sum(raw) / len(raw)))
            stats["reward_std"].append(float(torch.tensor(raw).std().item()) if len(raw) > 1 else 0.0)
            for name in parts[0]:
                given = [part[name] for part in parts if part[name] is not None]
                if given:
                    stats[f"rewards/{name}/mean"].append(sum(given) / len(given))
            stats["kl"].append(sequence_kl)
            stats["kl_coef"].append(self.kl_ctl.value)
            stats["completions/mean_length"].append(float(mask.sum(1).mean()))
            stats["completions/clipped_ratio"].append(float(sum(len(x) == spec.max_completion_length
                                                               and x[-1] not in stop_ids for x in ids) / len(ids)))
            self.kl_ctl.update(sequence_kl, len(rows))
            self.samples = [{"prompt": p, "completion": c, "reward": s, "rewards": part}
                            for p, c, s, part in zip(prompt_texts, texts, raw, parts)]
            return {"sequence": sequence, "attention": attention, "response": response, "mask": mask,
                    "logprobs": logprobs, "values": values, "advantages": advantages, "returns": returns,
                    "width": width}

        def optimize(self, model, batch: dict) -> torch.Tensor:
            """ppo_epochs passes, each in ppo_buffer_size updates of per_device_train_batch_size x
            gradient_accumulation_steps responses; every update but the last is stepped here, the last by the
            Trainer (its gradients are left in place)."""
            model.train()
            n = batch["sequence"].shape[0]
            micro = spec.per_device_train_batch_size
            per_update = micro * spec.gradient_accumulation_steps
            updates = [(epoch, start) for epoch in range(spec.ppo_epochs) for start in range(0, n, per_update)]
            losses = []
            order = None
            for k, (epoch, start) in enumerate(updates):
                if start == 0:
                    order = torch.randperm(n)
                chosen = order[start:start + per_update]
                chunks = [chosen[i:i + micro] for i in range(0, len(chosen), micro)]
                for idx in chunks:
                    loss = self.minibatch_loss(model, batch, idx) * (len(idx) / len(chosen))
                    self.accelerator.backward(loss)
                    losses.append(loss.detach() * len(chunks))
                if k < len(updates) - 1:
                    if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                        self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
            self.ppo_stats["ppo/updates"].append(float(len(updates)))
            return torch.stack(losses).mean().to(self.args.device)

        def minibatch_loss(self, model, batch: dict, idx: torch.Tensor) -> torch.Tensor:
            width = batch["width"]
            mask = batch["mask"][idx]
            logits, values = model(input_ids=batch["sequence"][idx], attention_mask=batch["attention"][idx])
            logits = logits[:, width - 1:-1]
            logprobs = _gather(logits, batch["response"][idx], spec.temperature)
            loss, stats = ppo_loss(spec, logprobs, batch["logprobs"][idx], batch["advantages"][idx],
                                   values[:, width - 1:-1].float(), batch["values"][idx], batch["returns"][idx], mask)
            with torch.no_grad():
                stats["entropy"] = ppo_math.masked_mean(ppo_math.entropy(logits.detach()), mask).item()
            for key, value in stats.items():
                self.ppo_stats[key].append(value)
            return loss

        def log(self, logs, start_time=None):
            if self.model.training and "loss" in logs and self.ppo_stats:
                logs.update({k: sum(v) / len(v) for k, v in self.ppo_stats.items()})
                self.ppo_stats.clear()
                write_samples(run_dir, self.state.global_step, self.samples)
            super().log(logs, start_time)

        def _save(self, output_dir=None, state_dict=None):
            out = Path(output_dir or self.args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            wrapper = self.accelerator.unwrap_model(self.model)
            wrapper.policy.save_pretrained(str(out))
            save_file({k: v.detach().cpu().contiguous() for k, v in wrapper.v_head.state_dict().items()},
                      str(out / VALUE_HEAD_FILE))
            (out / STATE_FILE).write_text(json.dumps(
                {"kl_coef": self.kl_ctl.value, "score_mean": self.moments.mean, "score_var": self.moments.var,
                 "score_count": self.moments.count}), encoding="utf-8")
            if self.processing_class is not None:
                self.processing_class.save_pretrained(str(out))

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            folder = Path(resume_from_checkpoint)
            wrapper = self.accelerator.unwrap_model(model or self.model)
            if (folder / "adapter_model.safetensors").is_file():
                set_peft_model_state_dict(wrapper.policy, load_file(str(folder / "adapter_model.safetensors")))
            else:
                weights = {}
                for shard in sorted(folder.glob("model*.safetensors")):
                    weights.update(load_file(str(shard)))
                if not weights:
                    raise RunError(f"resume_from_checkpoint: {folder} holds no policy weights")
                wrapper.policy.load_state_dict(weights, strict=False)
            if not (folder / VALUE_HEAD_FILE).is_file():
                raise RunError(f"resume_from_checkpoint: {folder} has no {VALUE_HEAD_FILE} (not a PPO checkpoint)")
            wrapper.v_head.load_state_dict(load_file(str(folder / VALUE_HEAD_FILE)))
            state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
            self.kl_ctl.value = state["kl_coef"]
            self.moments = ppo_math.RunningMoments(state["score_mean"], state["score_var"], state["score_count"])
            run_dir.log(f"resumed the policy, the value head and the KL coefficient ({state['kl_coef']:.4g}) "
                        f"from {folder.name}")

    return _PPOTrainer


def write_samples(run_dir, step: int, samples: list[dict]) -> None:
    """The latest rollout's responses -> completions.jsonl (as stage grpo's), and the best into the run log."""
    log_completions(run_dir, [{"step": step, **s} for s in samples[-SAMPLES_PER_LOG:]])
