"""Gradient checkpointing follows LLaMA-Factory's default (on for training unless gradient_checkpointing:
false or disable_gradient_checkpointing: true), and it changes memory, not the numbers: with the seed fixed,
one step with it on gives the loss and gradients of the same step with it off."""
from __future__ import annotations

import pytest
import torch

from backend.models import apply_finetuning, gradient_checkpointing_on, load_model, resolve_model
from backend.spec import RunSpec, training_args_fields

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
    from backend.spec import load_spec

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
def test_checkpointing_on_and_off_give_the_same_step(tiny_models, family):
    loss_on, grads_on = one_step(tiny_models[family], True)
    loss_off, grads_off = one_step(tiny_models[family], False)
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert grads_on.keys() == grads_off.keys() and len(grads_on) > 0
    assert any(g.abs().sum() > 0 for n, g in grads_on.items() if "lora_A" in n)
    for name in grads_on:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=1e-5, atol=1e-7, msg=name)
