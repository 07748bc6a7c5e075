"""Gradient checkpointing follows LLaMA-Factory's default (on for training unless gradient_checkpointing:
false or disable_gradient_checkpointing: true), and it changes memory, not the numbers: with the seed fixed,
one step with it on gives the loss and gradients of the same step with it off."""
from __future__ import annotations

import pytest
import torch

from backend.training.adapters import apply_finetuning
from backend.training.models import gradient_checkpointing_on, load_model, resolve_model
from backend.core.spec import RunSpec, training_args_fields

CKPT_KEY = "activation_checkpointing" if "activation_checkpointing" in training_args_fields() else "gradient_checkpointing"


def is_checkpointing(model) -> bool:
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


@pytest.mark.parametrize("given, expected", [
    ({}, True),  # LLaMA-Factory's default
    ({"gradient_checkpointing": True}, True),
    ({"gradient_checkpointing": False}, False),
    ({"disable_gradient_checkpointing": True}, False),
    ({"gradient_checkpointing": True, "disable_gradient_checkpointing": True}, False),
])
def test_checkpointing_default_and_switches(given, expected):
    spec = RunSpec(**given)
    assert spec.resolved_gradient_checkpointing is expected
    assert gradient_checkpointing_on(spec) is expected
    assert spec.training_arguments()[CKPT_KEY] is expected


def test_recipe_yaml_default_is_on_and_round_trips(tmp_path):
    """A run_spec.yaml written with defaults keeps 'unset' (not an explicit false that would switch it off)."""
    from backend.core.spec import load_spec

    path = tmp_path / "run_spec.yaml"
    path.write_text(RunSpec(output_dir=str(tmp_path / "o")).to_yaml())
    assert load_spec(path).resolved_gradient_checkpointing is True


def one_step(folder, checkpointing: bool):
    """Loss and gradients of one LoRA forward/backward, model and adapter drawn from seed 0."""
    from transformers import set_seed

    set_seed(0)
    spec = RunSpec(model_name_or_path=str(folder), gradient_checkpointing=checkpointing, lora_rank=4,
                   lora_dropout=0.1)  # dropout: the recomputed forward must draw the same mask
    model = apply_finetuning(load_model(spec, resolve_model(str(folder))), spec)
    assert is_checkpointing(model.get_base_model()) is checkpointing
    init = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():  # non-zero B, so the A matrices get gradients too
            if "lora_B" in name:
                param.normal_(std=0.02, generator=init)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    labels = ids.clone()
    labels[:, :8] = -100
    set_seed(2)  # same dropout masks in both runs
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("selective", ["1", "0"])  # backend/core/checkpointing.py: keep matmul/attention outputs, or not
def test_checkpointing_on_and_off_give_the_same_step(tiny_models, family, selective, monkeypatch):
    monkeypatch.setenv("TUNEBOARD_SELECTIVE_CHECKPOINT", selective)
    loss_on, grads_on = one_step(tiny_models[family], True)
    loss_off, grads_off = one_step(tiny_models[family], False)
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert grads_on.keys() == grads_off.keys() and len(grads_on) > 0
    assert any(g.abs().sum() > 0 for n, g in grads_on.items() if "lora_A" in n)
    for name in grads_on:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=1e-5, atol=1e-7, msg=name)


def test_selective_checkpointing_keeps_the_costly_outputs_and_recomputes_the_rest(tiny_models):
    """What the policy keeps, counted while a checkpointed forward/backward runs: the attention op and the
    narrowing products are kept; the widening (gate/up) products and element-wise ops are recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    from backend.core import checkpointing

    seen: dict[str, list] = {"saved": [], "recomputed": []}
    original = checkpointing._policy

    def counting(ctx, op, *args, **kwargs):
        decision = original(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            kind = "saved" if decision == CheckpointPolicy.MUST_SAVE else "recomputed"
            seen[kind].append((str(op), tuple(args[-1].shape) if op in (torch.ops.aten.mm.default,) else None))
        return decision

    checkpointing._policy = counting
    try:
        one_step(tiny_models["llama"], True)
    finally:
        checkpointing._policy = original
    saved_ops = {op for op, _ in seen["saved"]}
    assert any("scaled_dot_product" in op for op in saved_ops), saved_ops
    saved_mm = [shape for op, shape in seen["saved"] if op == "aten.mm.default"]
    recomputed_mm = [shape for op, shape in seen["recomputed"] if op == "aten.mm.default"]
    assert saved_mm and all(n <= k for k, n in saved_mm)  # narrowing: output no wider than the inner dimension
    assert recomputed_mm and all(n > k for k, n in recomputed_mm)
    assert any(op.startswith(("aten.mul", "aten.silu", "aten.add")) for op, _ in seen["recomputed"])


def test_selective_only_where_its_extra_memory_fits(monkeypatch):
    """The bench recipe's micro-batch (4 x 512 tokens, SmolLM2: hidden 576, 30 layers, fp32) keeps ~0.6 GiB more:
    selective with 20 GiB free, plain with 4 GiB free; the guide's recipe (4 x 4096 packed) keeps ~5 GiB more:
    plain with 20 GiB free. The environment variable forces either."""
    from backend.core.checkpointing import ENV, decide, extra_bytes

    monkeypatch.delenv(ENV, raising=False)
    gib = 2 ** 30
    bench, guide = extra_bytes(4 * 512, 576, 30, 4), extra_bytes(4 * 4096, 576, 30, 4)
    assert 0.5 * gib < bench < 0.7 * gib and 4.5 * gib < guide < 5.5 * gib
    assert decide(bench, 20 * gib)[0] and not decide(bench, 4 * gib)[0]
    selective, why = decide(guide, 20 * gib)
    assert not selective and why.startswith("plain") and "MiB free" in why
    monkeypatch.setenv(ENV, "1")
    assert decide(guide, 1 * gib)[0]
    monkeypatch.setenv(ENV, "0")
    assert not decide(bench, 100 * gib)[0]


def test_checkpoint_kwargs_given_by_the_spec_are_left_as_they_are(tiny_models):
    """A spec that passes activation_checkpointing_kwargs to the Trainer gets those: no selective context, and the
    run log's line says whose they are."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from backend.core import checkpointing

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    spec = SimpleNamespace(stage="sft", per_device_train_batch_size=1, cutoff_len=16,
                           passthrough={"activation_checkpointing_kwargs": {"use_reentrant": True}})
    assert checkpointing.choose(spec, model) == "as the spec's activation_checkpointing_kwargs say"
    assert "context_fn" not in checkpointing.checkpoint_kwargs()
    spec.passthrough = {}
    assert checkpointing.choose(spec, model).startswith("selective")  # a tiny model's extra fits
    assert "context_fn" in checkpointing.checkpoint_kwargs()


@pytest.mark.parametrize("stage, method, selective", [("kto", "lora", False), ("dpo", "lora", False),
                                                      ("sft", "lora", True), ("kto", "full", True)])
def test_an_adapter_under_zero3_is_checkpointed_plain_where_trl_makes_it_reentrant(tiny_models, stage, method,
                                                                                   selective):
    """TRL's trainers switch an adapter's checkpointing under DeepSpeed ZeRO-3 to torch's reentrant form, which
    refuses selective contexts at the first step ("Passing `context_fn` ... only supported when use_reentrant=False"):
    plain there, saying why; SFT's own Trainer and full fine-tuning keep selective."""
    from transformers import AutoModelForCausalLM

    from backend.core import checkpointing
    from backend.core.spec import validate_spec

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    spec = validate_spec({"stage": stage, "finetuning_type": method, "dataset": "unused", "cutoff_len": 16,
                          "per_device_train_batch_size": 2, "nproc_per_node": 2,
                          "deepspeed": "examples/deepspeed/ds_z3_config.json"}, check_files=False)
    line = checkpointing.choose(spec, model)
    assert line.startswith("selective" if selective else f"plain: the {stage} stage's TRL trainer"), line
    assert ("context_fn" in checkpointing.checkpoint_kwargs()) == selective
