"""LLaMA-Factory keys that change what a run does, each shown on tiny models in-process: default_system,
dataset mixing, enable_thinking, new special tokens with vocab resize, preprocessing workers, rope scaling,
LoRA+ and GaLore (tests/backend/test_every_key.py names these tests as the proof that the keys work)."""
import json

import pytest
import torch

from backend.dataprep.data import load_examples
from backend.training.adapters import apply_finetuning
from backend.training.models import build_optimizer, install_optimizer, load_model, load_tokenizer, resolve_model
from backend.dataprep.preference import build_kto_dataset, build_preference_dataset
from backend.dataprep.preprocess import build_pt_dataset, build_sft_dataset
from backend.core.spec import SpecError, validate_spec
from backend.dataprep.templates import get_template, with_thinking


def spec(**kwargs):
    return validate_spec(kwargs, check_files=False)


class _Log:
    def __init__(self):
        self.lines = []

    def log(self, line):
        self.lines.append(line)

    warn = log


def _dataset_dir(tmp_path, sizes=(3, 5)):
    """Datasets a, b, ... with `sizes` rows; row i of x answers "x<i>"."""
    info = {}
    for name, n in zip("abcd", sizes):
        rows = [{"instruction": f"question {name}{i}", "output": f"{name}{i}"} for i in range(n)]
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
        info[name] = {"file_name": f"{name}.json", "columns": {"prompt": "instruction", "response": "output"}}
    rows = [{"instruction": "with its own system", "output": "s0", "system": "Own system."}]
    (tmp_path / "sys.json").write_text(json.dumps(rows))
    info["sys"] = {"file_name": "sys.json", "columns": {"prompt": "instruction", "response": "output", "system": "system"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    return tmp_path


def _answers(examples):
    return [e["messages"][-1]["content"] for e in examples]


# ------------------------------------------------------------------------------------ default_system
def test_default_system_is_in_training_and_eval_rows(tmp_path, tiny_qwen2):
    from backend.evaluation.evaluate import eval_examples
    from backend.stages.base import train_and_eval_rows

    folder = _dataset_dir(tmp_path)
    s = spec(model_name_or_path=str(tiny_qwen2), dataset="a,sys", dataset_dir=str(folder), val_size=1,
             default_system="You are Tuney.")
    train, held_out = train_and_eval_rows(s, _Log(), "sft")
    rows = train + held_out
    systems = [e["messages"][0] for e in rows]
    assert all(m["role"] == "system" for m in systems)
    # rows without a system message get the default; a row's own system prompt wins
    assert sorted(m["content"] for m in systems) == ["Own system.", "You are Tuney.", "You are Tuney.", "You are Tuney."]
    evaluated = eval_examples(s, log=lambda _: None)
    assert evaluated[0]["messages"][0] == {"role": "system", "content": "You are Tuney."} or \
        evaluated[0]["messages"][0]["content"] == "Own system."
    # the tokens: the prompt is the one chat serves (system first), and the system text is not trained
    tokenizer = load_tokenizer(resolve_model(str(tiny_qwen2)))
    template = get_template("auto", tokenizer)
    example = next(e for e in train if e["messages"][0]["content"] == "You are Tuney.")
    row = build_sft_dataset([example], template, tokenizer, 128)[0][0]
    text = tokenizer.decode(row["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are Tuney.<|im_end|>")
    trained = tokenizer.decode([i for i, lab in zip(row["input_ids"], row["labels"]) if lab != -100])
    assert "Tuney" not in trained
    # without default_system nothing is added
    plain = spec(model_name_or_path=str(tiny_qwen2), dataset="a", dataset_dir=str(folder))
    assert all(e["messages"][0]["role"] == "user" for e in train_and_eval_rows(plain, _Log(), "sft")[0])


# ------------------------------------------------------------------------------------ mix_strategy
def test_interleave_follows_datasets_semantics(tmp_path):
    folder = _dataset_dir(tmp_path)
    load = lambda **kw: _answers(load_examples("a,b", folder, seed=7, **kw)[0])  # noqa: E731
    assert load() == ["a0", "a1", "a2", "b0", "b1", "b2", "b3", "b4"]  # concat
    # round robin; under stops when the smaller dataset runs out, over until every row of each was used
    assert load(mix_strategy="interleave_under") == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert load(mix_strategy="interleave_over") == ["a0", "b0", "a1", "b1", "a2", "b2", "a0", "b3", "a1", "b4"]
    # probabilities: a seeded draw of the next dataset
    skewed = load(mix_strategy="interleave_over", interleave_probs="0.9,0.1")
    assert skewed == load(mix_strategy="interleave_over", interleave_probs="0.9,0.1")
    assert sum(x.startswith("a") for x in skewed) > 2 * sum(x.startswith("b") for x in skewed)
    assert {f"b{i}" for i in range(5)} <= set(skewed)  # over: every row of b appears
    under = load(mix_strategy="interleave_under", interleave_probs="0.9,0.1")
    assert under != load(mix_strategy="interleave_under")
    # the spec wires it into the stage's rows
    from backend.stages.base import train_and_eval_rows

    s = spec(dataset="a,b", dataset_dir=str(folder), mix_strategy="interleave_under", seed=7)
    assert _answers(train_and_eval_rows(s, _Log(), "sft")[0]) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    # bad combinations are refused at validate
    for bad, field in (({"dataset": "a", "mix_strategy": "interleave_under"}, "mix_strategy"),
                       ({"dataset": "a,b", "mix_strategy": "interleave_over", "interleave_probs": "0.5"}, "interleave_probs"),
                       ({"dataset": "a,b", "mix_strategy": "interleave_over", "interleave_probs": "0.5,0.6"}, "interleave_probs")):
        with pytest.raises(SpecError) as info:
            validate_spec(bad, check_files=False)
        assert field in [f for f, _ in info.value.errors]


# ------------------------------------------------------------------------------------ enable_thinking
CONVERSATION = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def test_enable_thinking_false_puts_an_empty_think_block_in_the_prompt(tiny_qwen2):
    qwen3 = get_template("qwen3")
    off = with_thinking(qwen3, False)
    assert with_thinking(qwen3, True) is qwen3 and with_thinking(qwen3, None) is qwen3
    # the same text as qwen3_nothink, segment for segment: the empty think block is untrained prompt
    nothink = get_template("qwen3_nothink")
    assert off.render(CONVERSATION) == nothink.render(CONVERSATION)
    block = "<think>\n\n</think>\n\n"
    on_segments = qwen3.render(CONVERSATION)
    assert any(block in seg.text and seg.trained for seg in on_segments)  # thinking on: the model emits the block
    assert not any(block in seg.text and seg.trained for seg in off.render(CONVERSATION))
    assert off.render_text(CONVERSATION[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n" + block)
    assert qwen3.render_text(CONVERSATION[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    # reasoning the row does carry stays trained
    with_reasoning = [CONVERSATION[0], {"role": "assistant", "content": "4", "reasoning_content": "add them"}]
    assert any("add them" in seg.text and seg.trained for seg in off.render(with_reasoning))
    # a template without a reasoning block: refused at validate (named), an error at run time
    with pytest.raises(SpecError, match="enable_thinking: not supported: template llama3 has no reasoning"):
        validate_spec({"template": "llama3", "enable_thinking": False})
    with pytest.raises(ValueError, match="has no reasoning"):
        with_thinking(get_template("llama3"), False)
    # the tokenizer's own template gets enable_thinking=False (Qwen3's jinja reads it)
    tokenizer = load_tokenizer(resolve_model(str(tiny_qwen2)))
    with pytest.raises(ValueError, match="no enable_thinking switch"):
        with_thinking(get_template("auto", tokenizer), False)
    tokenizer.chat_template += ("{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                                "<think>\n\n</think>\n\n{% endif %}")
    auto_off = with_thinking(get_template("auto", tokenizer), False)
    assert auto_off.render_text(CONVERSATION[:1], add_generation_prompt=True).endswith(block)
    assert not get_template("auto", tokenizer).render_text(CONVERSATION[:1], add_generation_prompt=True).endswith(block)


# ------------------------------------------------------------------------------------ new tokens + resize
NEW = "<tool_a>,<tool_b>"


def test_resize_vocab_grows_the_embeddings_to_the_tokenizer(tiny_llama):
    resolved = resolve_model(str(tiny_llama))
    base = len(load_tokenizer(resolved))
    tokenizer = load_tokenizer(resolved, new_special_tokens=NEW)
    assert len(tokenizer) == base + 2
    assert tokenizer.convert_tokens_to_ids("<tool_a>") in tokenizer.encode("x <tool_a> y", add_special_tokens=False)
    warnings = []
    model = load_model(spec(model_name_or_path=str(tiny_llama), new_special_tokens=NEW), resolved, warn=warnings.append)
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows >= len(tokenizer) and rows % 64 == 0
    assert model.get_output_embeddings().weight.shape[0] == rows
    # resize_vocab alone with a tokenizer that fits: nothing to do, and the run log says so
    warnings = []
    plain = load_model(spec(model_name_or_path=str(tiny_llama), resize_vocab=True), resolved, warn=warnings.append)
    assert plain.get_input_embeddings().weight.shape[0] == base
    assert any("nothing to resize" in w for w in warnings)


def test_new_special_tokens_are_trained_and_saved_with_the_adapter(tmp_path, tiny_llama):
    from peft import PeftModel
    from safetensors.torch import load_file

    resolved = resolve_model(str(tiny_llama))
    s = spec(model_name_or_path=str(tiny_llama), new_special_tokens=NEW, lora_rank=4)
    tokenizer = load_tokenizer(resolved, new_special_tokens=NEW)
    new_id = tokenizer.convert_tokens_to_ids("<tool_a>")
    model = apply_finetuning(load_model(s, resolved), s)
    before = model.get_input_embeddings().weight[new_id].detach().clone()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.tensor([tokenizer.encode("call <tool_a> now <tool_b>", add_special_tokens=False)])
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.get_input_embeddings().weight[new_id].detach()
    assert not torch.allclose(before, after)  # the new token's row learned
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    embed = [k for k in saved if "embed_tokens" in k]
    head = [k for k in saved if "lm_head" in k]
    assert embed and head and saved[embed[0]].shape[0] >= len(tokenizer)
    # the same spec at chat/export time rebuilds the shapes and gives the trained model back
    model.eval()
    reloaded = PeftModel.from_pretrained(load_model(s, resolved, for_training=False), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, reloaded(input_ids=ids).logits, atol=1e-5)


# ------------------------------------------------------------------------------------ workers
def test_preprocessing_workers_give_identical_rows(monkeypatch, tiny_qwen2):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    examples, _ = load_examples("identity,alpaca_en_demo", max_samples=30)
    tokenizer = load_tokenizer(resolve_model(str(tiny_qwen2)))
    template = get_template("auto", tokenizer)
    serial, serial_stats = build_sft_dataset(examples, template, tokenizer, 64)
    parallel, stats = build_sft_dataset(examples, template, tokenizer, 64, num_workers=3)
    assert parallel == serial and stats.workers == 3 and serial_stats.workers == 1
    assert (stats.rows, stats.truncated, stats.total_tokens) == (serial_stats.rows, serial_stats.truncated,
                                                                  serial_stats.total_tokens)
    assert "tokenized in 3 processes" in str(stats)
    texts, _ = load_examples("c4_demo", stage="pt", max_samples=20)
    assert build_pt_dataset(texts, tokenizer, 64, num_workers=2)[0] == build_pt_dataset(texts, tokenizer, 64)[0]
    pairs, _ = load_examples("dpo_en_demo", stage="dpo", max_samples=20)
    one = build_preference_dataset(pairs, template, tokenizer, 64)[0]
    assert build_preference_dataset(pairs, template, tokenizer, 64, num_workers=2)[0] == one and len(one) == 20
    tagged, _ = load_examples("kto_en_demo", stage="kto", max_samples=20)
    assert build_kto_dataset(tagged, template, tokenizer, 64, num_workers=2)[0] == \
        build_kto_dataset(tagged, template, tokenizer, 64)[0]


# ------------------------------------------------------------------------------------ rope scaling
def test_rope_scaling_kinds_change_the_positions(tiny_llama):
    resolved = resolve_model(str(tiny_llama))
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 1100))  # past the tiny model's 1024 positions (dynamic acts only there)

    def logits(**kw):
        model = load_model(spec(model_name_or_path=str(tiny_llama), **kw), resolved, for_training=False)
        with torch.no_grad():
            return model, model(input_ids=ids).logits[0, -50:]

    _, plain = logits()
    for kind in ("linear", "dynamic", "yarn", "llama3"):
        model, scaled = logits(rope_scaling=kind, cutoff_len=2048)
        params = model.config.rope_parameters
        assert params["rope_type"] == kind and params["factor"] == 2.0, params
        assert model.config.max_position_embeddings == (1024 if kind == "dynamic" else 2048)
        assert not torch.allclose(plain, scaled, atol=1e-4), kind
    # cutoff_len within the model's positions: nothing would change, so it is refused
    with pytest.raises(SpecError, match="rope_scaling: not supported: .*1024 positions"):
        validate_spec({"model_name_or_path": str(tiny_llama), "rope_scaling": "linear", "cutoff_len": 512})
    with pytest.raises(ValueError, match="cutoff_len 512 fits already"):
        load_model(spec(model_name_or_path="x", rope_scaling="linear", cutoff_len=512), resolved)


# ------------------------------------------------------------------------------------ LoRA+
def test_loraplus_gives_lora_b_a_higher_learning_rate(tmp_path, tiny_llama):
    from transformers import Trainer, TrainingArguments

    resolved = resolve_model(str(tiny_llama))
    s = spec(model_name_or_path=str(tiny_llama), loraplus_lr_ratio=16.0, learning_rate=1e-3)
    model = apply_finetuning(load_model(s, resolved), s)
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, report_to="none")
    trainer = Trainer(model=model, args=args)
    install_optimizer(trainer, s)  # what backend.stages.base.fit does
    optimizer = trainer.create_optimizer()
    lrs = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = next(n for n, q in model.named_parameters() if q is p)
            lrs[name] = group["lr"]
    a = {v for k, v in lrs.items() if "lora_A" in k}
    b = {v for k, v in lrs.items() if "lora_B" in k}
    assert a == {1e-3} and b == {16e-3}
    assert len(lrs) == sum(p.requires_grad for p in model.parameters())  # every trainable parameter, once
    # without the key the Trainer's own optimizer (one learning rate)
    plain = Trainer(model=model, args=args)
    install_optimizer(plain, spec(model_name_or_path=str(tiny_llama)))
    assert {g["lr"] for g in plain.create_optimizer().param_groups} == {1e-3}


# ------------------------------------------------------------------------------------ GaLore
def _galore_deltas(tiny_llama, tmp_path, steps=1, **kw):
    """Weight changes of q_proj and v_proj (layer 0) after `steps` optimizer steps of full training."""
    from transformers import TrainingArguments

    resolved = resolve_model(str(tiny_llama))
    s = spec(model_name_or_path=str(tiny_llama), finetuning_type="full", use_galore=True, **kw)
    model = apply_finetuning(load_model(s, resolved), s)
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-2, weight_decay=0.0, report_to="none")
    optimizer = build_optimizer(s, model, args)
    attn = model.model.layers[0].self_attn
    start = [attn.q_proj.weight.detach().clone(), attn.v_proj.weight.detach().clone()]
    torch.manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 1000, (2, 24))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer, attn.q_proj.weight.detach() - start[0], attn.v_proj.weight.detach() - start[1]


def _rank(delta):
    """Numerical rank: singular values above 1e-4 of the largest (float32 rounding of W + dW - W is ~1e-7)."""
    values = torch.linalg.svdvals(delta.double())
    return int((values > 1e-4 * values[0]).sum())


def test_galore_updates_are_low_rank(tmp_path, tiny_llama):
    optimizer, dq, dv = _galore_deltas(tiny_llama, tmp_path, galore_rank=2, galore_target="q_proj")
    assert type(optimizer).__module__.startswith("galore_torch")
    assert dq.abs().max() > 0 and _rank(dq) <= 2  # projected: the update lies in a rank-2 subspace
    assert _rank(dv) > 2  # not a GaLore target: a full-rank Adam update
    group = next(g for g in optimizer.param_groups if "rank" in g)
    assert (group["rank"], group["update_proj_gap"], group["scale"]) == (2, 200, 2.0)


def test_galore_update_interval_renews_the_projection(tmp_path, tiny_llama):
    _, kept, _ = _galore_deltas(tiny_llama, tmp_path, steps=3, galore_rank=2, galore_update_interval=100)
    _, renewed, _ = _galore_deltas(tiny_llama, tmp_path, steps=3, galore_rank=2, galore_update_interval=1)
    assert _rank(kept) <= 2  # one projection for all three steps
    assert _rank(renewed) > 2  # a new projection each step


def test_galore_scale_scales_the_update(tmp_path, tiny_llama):
    _, one, _ = _galore_deltas(tiny_llama, tmp_path, galore_scale=1.0)
    _, three, _ = _galore_deltas(tiny_llama, tmp_path, galore_scale=3.0)
    assert torch.allclose(three, 3 * one, rtol=1e-3, atol=1e-7)


def test_galore_trains_through_the_stage(tmp_path, tiny_llama):
    """The whole path: `stage: sft` with use_galore through backend.training.train (the Trainer, our optimizer hook)."""
    from safetensors.torch import load_file

    from backend.training import train

    out = tmp_path / "run"
    s = spec(model_name_or_path=str(tiny_llama), template="llama3", finetuning_type="full", use_galore=True,
             galore_rank=2, galore_target="q_proj", dataset="identity", max_samples=8, cutoff_len=64, max_steps=2,
             per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-2, save_strategy="no",
             plot_loss=False, output_dir=str(out))
    assert train.run(s) == 0, (out / "running_log.txt").read_text()[-2000:]
    before = load_file(tiny_llama / "model.safetensors")
    after = load_file(out / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert _rank(after[key] - before[key]) <= 4  # two steps, one projection of rank 2 (rank <= 2, any renewal <= 4)
    other = "model.layers.0.self_attn.v_proj.weight"
    assert _rank(after[other] - before[other]) > 4
    # refusals: LoRA has no full weights to project; an optimizer without a GaLore variant
    with pytest.raises(SpecError, match="GaLore trains full weights"):
        validate_spec({"use_galore": True}, check_files=False)
    with pytest.raises(SpecError, match="use_galore: not supported: GaLore has no variant of optim sgd"):
        validate_spec({"use_galore": True, "finetuning_type": "full", "optim": "sgd"}, check_files=False)
