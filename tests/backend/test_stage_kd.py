"""Stage kd (logit distillation) on tiny_llama: the loss terms against hand-computed KL, two short runs through the
real CLI (off-policy with kd_alpha and a teacher adapter; on-policy), the 4-bit teacher, and validate's refusal of a
teacher with another tokenizer (tiny_qwen2: the same base vocabulary, other special tokens)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.core.spec import RunSpec, SpecError, validate_spec
from backend.stages import get_stage

TUNEBOARD = [sys.executable, "-m", "backend.cli"]
COMMON = ("stage=kd", "dataset=identity", "template=llama3", "max_samples=8", "cutoff_len=96",
          "per_device_train_batch_size=2", "logging_steps=1", "save_steps=100", "plot_loss=false")


def train(out: Path, *args: str) -> list[dict]:
    proc = subprocess.run(TUNEBOARD + ["train", f"output_dir={out}", *COMMON, *args], cwd="/tmp",
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]


def test_kd_terms_are_the_kl_divergences_at_the_temperature():
    import torch
    import torch.nn.functional as F

    from backend.stages.kd import kd_terms

    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, -100, 3, 4, 5], [-100, 1, 2, -100, -100]])
    shifted = labels[:, 1:] != -100  # the positions whose next token is trained

    def kl(p_logits, q_logits, t):  # KL(p || q) per trained position, summed over the vocabulary
        p, q = F.log_softmax(p_logits[:, :-1] / t, -1), F.log_softmax(q_logits[:, :-1] / t, -1)
        return ((p.exp() * (p - q)).sum(-1))[shifted].mean()

    for beta, t, want in ((0.0, 1.0, kl(teacher, student, 1.0)), (1.0, 1.0, kl(student, teacher, 1.0)),
                          (0.0, 2.0, kl(teacher, student, 2.0))):
        divergence, ce = kd_terms(student, teacher, labels, beta=beta, temperature=t)
        assert divergence.item() == pytest.approx(want.item(), rel=1e-5), (beta, t)
    mid, _ = kd_terms(student, teacher, labels, beta=0.5, temperature=1.0)
    assert 0 < mid.item() < min(kl(teacher, student, 1.0).item(), kl(student, teacher, 1.0).item())
    want_ce = F.cross_entropy(student[:, :-1][shifted], labels[:, 1:][shifted])
    assert ce.item() == pytest.approx(want_ce.item(), rel=1e-5)


def test_kd_run_mixes_cross_entropy_and_distils_from_the_teacher_adapter(tiny_llama, random_llama_adapter, tmp_path):
    """Student and teacher share tiny_llama: only the teacher's adapter makes them differ at step 1 (the student's
    new LoRA adapter is the identity), so kd_loss > 0 there shows the adapter was loaded."""
    out = tmp_path / "run"
    rows = train(out, f"model_name_or_path={tiny_llama}", f"teacher_model_name_or_path={tiny_llama}",
                 f"teacher_adapter={random_llama_adapter}", "kd_alpha=0.25", "max_steps=2", "learning_rate=0.01")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert set(get_stage("kd").metrics) <= set(row)
        assert row["on_policy"] == 0
        assert row["loss"] == pytest.approx(0.75 * row["kd_loss"] + 0.25 * row["ce_loss"], rel=1e-3)
    assert rows[0]["kd_loss"] > 0.01
    assert (out / "adapter_model.safetensors").is_file()
    assert "teacher: " in (out / "running_log.txt").read_text()


def test_kd_on_policy_steps_generate_from_the_student(tiny_llama, tmp_path):
    """kd_lmbda 1: every step trains on the student's own completion; the teacher is the student's base, so the
    divergence at step 1 is 0."""
    rows = train(tmp_path / "run", f"model_name_or_path={tiny_llama}", f"teacher_model_name_or_path={tiny_llama}",
                 "kd_lmbda=1", "max_completion_length=4", "kd_beta=0.5", "max_steps=1")
    assert rows[0]["on_policy"] == 1
    assert rows[0]["kd_loss"] == pytest.approx(0, abs=1e-5)


def test_teacher_quantization_bit_loads_a_4bit_teacher(tiny_llama, tmp_path):
    import bitsandbytes as bnb

    from backend.core.rundir import RunDir
    from backend.stages.kd import load_teacher
    from backend.training.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(str(tiny_llama)))
    spec = RunSpec(model_name_or_path=str(tiny_llama), stage="kd", teacher_model_name_or_path=str(tiny_llama),
                   teacher_quantization_bit=4)
    teacher = load_teacher(spec, RunDir(tmp_path), tokenizer)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in teacher.modules())
    plain = load_teacher(spec.model_copy(update={"teacher_quantization_bit": None}), RunDir(tmp_path), tokenizer)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in plain.modules())


def test_a_teacher_with_another_tokenizer_is_refused_at_validate(tiny_llama, tiny_qwen2):
    with pytest.raises(SpecError) as caught:
        validate_spec({"model_name_or_path": str(tiny_llama), "stage": "kd",
                       "teacher_model_name_or_path": str(tiny_qwen2)})
    message = str(caught.value)
    line = next(line for line in message.splitlines() if "teacher_model_name_or_path" in line)
    assert str(tiny_llama) in line and str(tiny_qwen2) in line and "tokenizer" in line
    validate_spec({"model_name_or_path": str(tiny_llama), "stage": "kd", "teacher_model_name_or_path": str(tiny_llama)})


def test_kd_refuses_keys_its_loss_would_ignore(tiny_llama):
    base = {"model_name_or_path": str(tiny_llama), "stage": "kd", "teacher_model_name_or_path": str(tiny_llama)}
    with pytest.raises(SpecError, match="kd_alpha: not supported"):
        validate_spec({**base, "kd_alpha": 0.5, "kd_lmbda": 0.5})
    with pytest.raises(SpecError, match="teacher_model_name_or_path: stage kd needs a teacher"):
        validate_spec({"model_name_or_path": str(tiny_llama), "stage": "kd"})
    with pytest.raises(SpecError, match="packing: not supported"):
        validate_spec({**base, "packing": True})


def test_preflight_and_probe_count_the_teacher(tiny_llama):
    from backend.training.probe import suggestions
    from webui import preflight

    flat = {"model_name_or_path": "org/SmolLM2-135M", "stage": "kd", "teacher_model_name_or_path": "org/SmolLM2-360M",
            "cutoff_len": 256, "per_device_train_batch_size": 2}
    kd, sft = preflight.estimate(flat), preflight.estimate({**flat, "stage": "sft"})
    assert kd["teacher"] == pytest.approx(360e6 * 4) and sft["teacher"] == 0  # fp32 weights: no bf16 asked
    assert preflight.estimate({**flat, "teacher_quantization_bit": 4})["teacher"] == pytest.approx(360e6 * 0.55)
    logits = 2 * 256 * preflight.DEFAULT_VOCAB * 4 * preflight.TEACHER_LOGIT_COPIES
    assert kd["activations"] - sft["activations"] == pytest.approx(logits)
    assert kd["total"] > sft["total"] + (360e6 * 4 + logits)
    assert "teacher" in preflight.summary_md(flat)

    spec = RunSpec(model_name_or_path=str(tiny_llama), stage="kd", teacher_model_name_or_path=str(tiny_llama))
    measured = {"peak_mib": 3000.0, "baseline_mib": 2000.0, "teacher_weights_mib": 1400.0, "teacher_params": 360e6}
    offered = [s["change"] for s in suggestions(spec, measured, available_mib=2500.0)]
    assert {"teacher_quantization_bit": 4} in offered
    quantized = spec.model_copy(update={"teacher_quantization_bit": 4})
    assert {"teacher_quantization_bit": 4} not in [s["change"] for s in suggestions(quantized, measured, 2500.0)]
