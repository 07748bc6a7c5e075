"""Stage dpo (pref_loss sigmoid / hinge / ipo / orpo / simpo) and its aliases orpo, simpo.

In-process (fast tier, tiny Llama): the loss terms our spec keys turn into (cDPO label smoothing, pref_ftx),
gradient-accumulation invariance, the reference model each setup gets, the aliases, the refusals.
Through the real CLI (slow tier): every loss learns a toy preference set, the adapter chats, continuing an
adapter keeps it as the reference, and LoRA DPO keeps no second model in memory.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backend.core.spec import SpecError, validate_spec

TUNEBOARD = [sys.executable, "-m", "backend.cli"]
TOPICS = ["the sea", "a cat", "music", "trees", "the moon", "bread", "rain", "a bicycle", "winter", "coffee",
          "a library", "mountains", "the wind", "a garden", "stars", "a river"]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> Path:
    """16 pairs a tiny model learns in a few steps: the chosen answer is always friendly, the rejected one rude."""
    folder = tmp_path_factory.mktemp("toy_pairs")
    rows = [{"instruction": f"Tell me something about {t}.", "input": "",
             "chosen": f"Gladly! {t.capitalize()} is wonderful.", "rejected": "No. Go away."} for t in TOPICS]
    (folder / "toy_pairs.json").write_text(json.dumps(rows), encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"toy_pairs": {
        "file_name": "toy_pairs.json", "ranking": True,
        "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}}}))
    return folder


# ============================================================================ in-process (fast tier)
class _QuietRunDir:
    def log(self, message):
        pass

    warn = log


def _spec(tiny_llama, toy_dir, **overrides):
    data = {"model_name_or_path": str(tiny_llama), "stage": "dpo", "dataset": "toy_pairs", "dataset_dir": str(toy_dir),
            "template": "llama3", "cutoff_len": 128, "lora_rank": 4, "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1, "max_steps": 1, "logging_steps": 1, "learning_rate": 1e-3,
            "lr_scheduler_type": "constant", "save_strategy": "no", "report_to": "none"}
    return validate_spec({**data, **overrides}, check_files=False)


@pytest.fixture(scope="module")
def toy_rows(tiny_llama, toy_dir) -> list[dict]:
    """The toy pairs as the stage tokenizes them (llama3 template)."""
    from backend.dataprep.data import load_examples
    from backend.training.models import load_tokenizer, resolve_model
    from backend.dataprep.preference import build_preference_dataset
    from backend.dataprep.templates import get_template

    tokenizer = load_tokenizer(resolve_model(str(tiny_llama)))
    examples, _ = load_examples("toy_pairs", toy_dir, stage="dpo")
    rows, _ = build_preference_dataset(examples, get_template("llama3", tokenizer), tokenizer, 128)
    return rows


def _other_model(tiny_llama):
    """The tiny model with its weights moved a little: a reference the policy differs from at step 0."""
    from backend.training.models import load_model, resolve_model

    model = load_model(_spec_plain(tiny_llama), resolve_model(str(tiny_llama)), for_training=False)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.requires_grad_(False)


def _spec_plain(tiny_llama):
    return validate_spec({"model_name_or_path": str(tiny_llama)}, check_files=False)


def _trainer(spec, rows, tmp_path, ref_model=None):
    """The stage's trainer, built as backend.stages.dpo.run builds it (trainer_for + training_arguments)."""
    from datasets import Dataset
    from transformers import set_seed

    from backend.training.models import load_tokenizer, resolve_model
    from backend.stages import dpo
    from backend.stages.base import trainable_model, training_arguments

    set_seed(0)  # the same LoRA initialisation in every trainer of a comparison
    resolved = resolve_model(spec.model_name_or_path)
    model = trainable_model(spec, _QuietRunDir(), resolved)
    loss = dpo.preference_loss(spec)
    trainer_class, args_class, config = dpo.trainer_for(spec, loss)
    args = training_arguments(spec, tmp_path / f"bs{spec.per_device_train_batch_size}", has_eval=False,
                              args_class=args_class, extra=config)
    extra = {"ref_model": ref_model} if loss in dpo.REFERENCE_LOSSES else {}
    return trainer_class(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=load_tokenizer(resolved), **extra)


def _loss_of(trainer, index: int) -> float:
    """The trainer's loss on one pair of its (prepared) training rows."""
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[index]])
    with torch.no_grad():
        return float(trainer.compute_loss(trainer.model, batch))


def _chosen_nll(tiny_llama, row) -> float:
    """Mean negative log-likelihood of the chosen answer's tokens under the untrained model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    ids = torch.tensor([row["prompt_ids"] + row["chosen_ids"]])
    with torch.no_grad():
        logps = F.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    token_logps = logps.gather(-1, targets[:, None])[:, 0]
    return float(-token_logps[len(row["prompt_ids"]) - 1:].mean())


def test_label_smoothing_is_conservative_dpo(tiny_llama, toy_dir, toy_rows, tmp_path):
    """dpo_label_smoothing e gives LLaMA-Factory's cDPO loss (1-e)*L(m) + e*L(-m), L(m) = -log sigmoid(m),
    m the logged reward margin: through TRL's own loss code, for single pairs."""
    eps = 0.2
    smoothed = _trainer(_spec(tiny_llama, toy_dir, dpo_label_smoothing=eps), toy_rows, tmp_path, _other_model(tiny_llama))
    plain = _trainer(_spec(tiny_llama, toy_dir), toy_rows, tmp_path, _other_model(tiny_llama))
    for index in (0, 1):
        loss = _loss_of(smoothed, index)
        margin = torch.tensor(smoothed._metrics["train"]["rewards/margins"][-1])
        assert abs(float(margin)) > 0.05  # the policy and this reference differ: the check can tell losses apart
        expected = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        assert loss == pytest.approx(float(expected), rel=1e-4)
        assert _loss_of(plain, index) == pytest.approx(float(-F.logsigmoid(margin)), rel=1e-4)


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_pref_ftx_adds_the_chosen_answers_nll(loss, tiny_llama, toy_dir, toy_rows, tmp_path):
    """pref_ftx w adds w x (mean NLL of the chosen answer's tokens) to the preference loss (TRL's "sft" term for
    DPO, cpo_alpha for SimPO)."""
    without = _loss_of(_trainer(_spec(tiny_llama, toy_dir, pref_loss=loss), toy_rows, tmp_path), 0)
    with_ftx = _loss_of(_trainer(_spec(tiny_llama, toy_dir, pref_loss=loss, pref_ftx=0.5), toy_rows, tmp_path), 0)
    nll = _chosen_nll(tiny_llama, toy_rows[0])
    assert nll > 1  # an untrained model: the term is large enough to see
    assert with_ftx - without == pytest.approx(0.5 * nll, rel=1e-3)


def test_dpo_gradient_accumulation_invariance(tiny_llama, toy_dir, toy_rows, tmp_path):
    """batch 4 x GA 1 == batch 1 x GA 4: the same first-step loss and gradient norm (the loss is a mean over
    pairs, so accumulating four single-pair losses must give the same step)."""
    rows = toy_rows[:4]
    runs = []
    for batch, accum in ((4, 1), (1, 4)):
        spec = _spec(tiny_llama, toy_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=accum)
        trainer = _trainer(spec, rows, tmp_path, _other_model(tiny_llama))
        trainer.train()
        runs.append(next(h for h in trainer.state.log_history if "loss" in h))
    one_batch, accumulated = runs
    assert abs(one_batch["loss"] - 0.6931) > 1e-2  # not the trivial log 2 of a policy equal to its reference
    assert accumulated["loss"] == pytest.approx(one_batch["loss"], rel=1e-4)
    assert accumulated["grad_norm"] == pytest.approx(one_batch["grad_norm"], rel=1e-3)
    assert accumulated["rewards/accuracies"] == pytest.approx(one_batch["rewards/accuracies"])


def test_aliases_are_dpo_with_their_loss(tiny_llama, toy_dir):
    """stage orpo / simpo = stage dpo with pref_loss orpo / simpo: the same trainer and the same config."""
    from backend.stages import dpo

    for alias in ("orpo", "simpo"):
        by_alias, by_loss = _spec(tiny_llama, toy_dir, stage=alias), _spec(tiny_llama, toy_dir, pref_loss=alias)
        assert dpo.preference_loss(by_alias) == dpo.preference_loss(by_loss) == alias
        assert dpo.trainer_for(by_alias, alias) == dpo.trainer_for(by_loss, alias)
    assert dpo.trainer_for(_spec(tiny_llama, toy_dir, stage="orpo"), "orpo")[0].__mro__[1].__name__ == "ORPOTrainer"
    assert dpo.trainer_for(_spec(tiny_llama, toy_dir, stage="simpo"), "simpo")[2]["loss_type"] == "simpo"


def test_reference_model_per_setup(tiny_llama, toy_dir):
    """LoRA: none (the base model while the new adapter is the identity, TRL's frozen copy of the starting
    adapter once it is not); full / freeze: a frozen second copy with the policy's weights; ref_model: that
    model, refused when it lacks embeddings for the policy's tokens; orpo / simpo: none. One rule for DPO and
    KTO (stages.base.reference_model), so the run log says which."""
    from safetensors.torch import load_file

    from backend.training.models import resolve_model
    from backend.stages.base import RunError, trainable_model
    from backend.stages.dpo import preference_reference

    class Log(_QuietRunDir):
        def __init__(self):
            self.lines = []

        def log(self, message):
            self.lines.append(message)

    resolved, log = resolve_model(str(tiny_llama)), Log()
    policy = trainable_model(_spec(tiny_llama, toy_dir), _QuietRunDir(), resolved)
    assert preference_reference(_spec(tiny_llama, toy_dir), log, resolved, policy, "sigmoid") is None
    assert log.lines[-1].startswith("reference model: the base model")
    with torch.no_grad():
        next(p for n, p in policy.named_parameters() if "lora_B" in n).fill_(0.5)  # as PiSSA starts
    assert preference_reference(_spec(tiny_llama, toy_dir), log, resolved, policy, "sigmoid") is None
    assert log.lines[-1].startswith("reference model: the starting adapter")
    assert preference_reference(_spec(tiny_llama, toy_dir, stage="orpo"), log, resolved, policy, "orpo") is None
    assert log.lines[-1] == "reference model: none (orpo is reference-free)"
    saved = load_file(Path(tiny_llama) / "model.safetensors")
    for method in ("full", "freeze"):
        ref = preference_reference(_spec(tiny_llama, toy_dir, finetuning_type=method), log, resolved, policy, "sigmoid")
        assert not any(p.requires_grad for p in ref.parameters())
        state = ref.state_dict()
        assert all(torch.equal(state[k], v) for k, v in saved.items() if k in state)
    ref = preference_reference(_spec(tiny_llama, toy_dir, ref_model=str(tiny_llama)), log, resolved, policy, "hinge")
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    policy.resize_token_embeddings(policy.get_input_embeddings().num_embeddings + 8)
    with pytest.raises(RunError, match="ref_model: .* fewer than"):
        preference_reference(_spec(tiny_llama, toy_dir, ref_model=str(tiny_llama)), log, resolved, policy, "hinge")


def test_qlora_dpo_keeps_trained_weights_in_fp32(tiny_llama, toy_dir, toy_rows, tmp_path):
    """TRL casts a quantized model's trainable weights to bf16; the stage keeps them fp32 like every stage."""
    trainer = _trainer(_spec(tiny_llama, toy_dir, quantization_bit=4), toy_rows[:4], tmp_path)
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.parametrize("overrides, field, words", [
    ({"stage": "orpo", "ref_model": "x"}, "ref_model", "without a reference model"),
    ({"pref_loss": "simpo", "ref_model": "x"}, "ref_model", "without a reference model"),
    ({"pref_loss": "hinge", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing", "pref_loss sigmoid"),
    ({"dpo_label_smoothing": 0.5}, "dpo_label_smoothing", "below 0.5"),
    ({"simpo_gamma": 1.0}, "simpo_gamma", "simpo only"),
    ({"stage": "orpo", "pref_ftx": 0.5}, "pref_ftx", "SFT term built in"),
    ({"stage": "simpo", "pref_loss": "hinge"}, "pref_loss", "stage simpo trains with pref_loss simpo"),
    ({"pref_beta": 0}, "pref_beta", "above 0"),
    ({"lora_dropout": 0.1}, "lora_dropout", "dropout off"),
    ({"packing": True}, "packing", "packing does not apply"),
    ({"train_on_prompt": True}, "train_on_prompt", "no prompt loss"),
    ({"mask_history": True}, "mask_history", "last turn only"),
    ({"do_predict": True}, "do_predict", "no predictions"),
])
def test_combinations_that_cannot_work_are_refused(overrides, field, words):
    with pytest.raises(SpecError) as exc:
        validate_spec({"stage": "dpo", **overrides}, check_files=False)
    assert any(f == field and words in message for f, message in exc.value.errors), exc.value.errors


def test_what_each_loss_takes_validates():
    for overrides in ({"pref_loss": "sigmoid", "dpo_label_smoothing": 0.1, "pref_ftx": 0.5, "ref_model": "m"},
                      {"pref_loss": "ipo", "pref_ftx": 0.5, "finetuning_type": "full"},
                      {"stage": "simpo", "simpo_gamma": 1.0, "pref_ftx": 1.0},
                      {"stage": "dpo", "pref_loss": "orpo", "pref_beta": 0.2}):
        validate_spec({"stage": "dpo", **overrides}, check_files=False)


# ============================================================================ through the CLI (slow tier)
def _train(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(TUNEBOARD + ["train", *overrides], cwd="/tmp", capture_output=True, text=True,
                          timeout=timeout)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "trainer_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def preference_runs(tiny_llama, toy_dir, tmp_path_factory):
    """Trains each loss once on the toy pairs (5 steps of 4 pairs, LoRA, lr 1e-2); runs[name] -> run dir."""
    root = tmp_path_factory.mktemp("dpo_runs")
    runs: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in runs:
            out = root / name
            stage = ["stage=orpo"] if name == "orpo" else ["stage=dpo", f"pref_loss={name}"]
            proc = _train(f"model_name_or_path={tiny_llama}", f"output_dir={out}", *stage, "dataset=toy_pairs",
                          f"dataset_dir={toy_dir}", "template=llama3", "cutoff_len=128", "lora_rank=4",
                          "per_device_train_batch_size=4", "gradient_accumulation_steps=1", "max_steps=5",
                          "logging_steps=1", "learning_rate=0.01", "save_steps=100", "plot_loss=false")
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            runs[name] = out
        return runs[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "hinge", "ipo", "orpo", "simpo"])
def test_each_loss_learns_the_toy_preference(loss, preference_runs):
    out = preference_runs(loss)
    assert json.loads((out / "status.json").read_text())["state"] == "completed"
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:  # the stage's declared metrics reach trainer_log.jsonl at every step
        assert all(isinstance(row.get(k), float) for k in ("rewards/chosen", "rewards/rejected",
                   "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")), row
    assert rows[-1]["rewards/accuracies"] > 0.8
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    if loss in ("sigmoid", "hinge", "ipo"):  # the policy starts equal to its reference
        assert rows[0]["rewards/margins"] == 0 and rows[0]["rewards/chosen"] == 0
    log = (out / "running_log.txt").read_text()
    assert f"preference loss: {loss}" in log
    assert (out / "adapter_model.safetensors").is_file() and not (out / "ref").exists()


@pytest.mark.slow
def test_dpo_adapter_chats(preference_runs, tiny_llama, capsys):
    """The saved adapter loads and answers in `tuneboard chat --query` (its main, in this process)."""
    from backend.serving import chat
    from backend.core.spec import load_spec

    out = preference_runs("sigmoid")
    spec = load_spec(None, [f"model_name_or_path={tiny_llama}", f"adapter_name_or_path={out}", "template=llama3",
                            "do_sample=false", "max_new_tokens=6"])
    assert chat.main(spec, query="Tell me something about the sea.") == 0
    printed = capsys.readouterr().out
    # A DPO-trained random tiny model may end its turn at once (an empty line): the answer printed is the
    # engine's, token for token, whatever it says.
    engine = list(chat.load_engines(spec, include_base=False).values())[-1]
    reply = engine.chat([{"role": "user", "content": "Tell me something about the sea."}])
    assert reply.finish_reason in ("stop", "length") and printed.strip() == reply.text.strip()


@pytest.mark.slow
def test_continuing_an_adapter_keeps_it_as_the_reference(preference_runs, tiny_llama, toy_dir, tmp_path):
    """adapter_name_or_path of an earlier run (the SFT -> DPO chain): that adapter trains on, and the reference
    is the model with it, so the first step's rewards are exactly 0 (with the base model as reference, as
    LLaMA-Factory has it, they would be the earlier run's reward margin)."""
    from safetensors.torch import load_file

    start = preference_runs("sigmoid")
    out = tmp_path / "continued"
    proc = _train(f"model_name_or_path={tiny_llama}", f"adapter_name_or_path={start}", f"output_dir={out}",
                  "stage=dpo", "dataset=toy_pairs", f"dataset_dir={toy_dir}", "template=llama3", "cutoff_len=128",
                  "per_device_train_batch_size=4", "gradient_accumulation_steps=1", "max_steps=2", "logging_steps=1",
                  "learning_rate=0.01", "save_steps=100", "plot_loss=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = _rows(out)
    assert first["rewards/chosen"] == 0 and first["rewards/rejected"] == 0 and first["rewards/margins"] == 0
    assert second["rewards/margins"] != 0
    assert _rows(start)[-1]["rewards/margins"] > 0.1  # what the base-model reference would have shown at step 1
    assert f"reference model: the adapter from {start}" in (out / "running_log.txt").read_text()
    before, after = load_file(start / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert before.keys() == after.keys()  # the same adapter, trained on
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.fixture(scope="module")
def wide_model(tiny_llama, tmp_path_factory) -> Path:
    """A random Llama of ~460 MB, nearly all of it one tied embedding (cheap to run, big in memory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2048, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=256, intermediate_size=256, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide_llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_lora_dpo_keeps_no_second_model_copy(wide_model, toy_dir, tmp_path):
    """LoRA DPO without ref_model holds one model (TRL's reference is a frozen adapter copy on the shared base):
    the same run given the same model as ref_model holds a second one, and its peak memory shows it."""
    weights = sum(f.stat().st_size for f in Path(wide_model).glob("*.safetensors"))
    peaks = {}
    for name, extra in (("shared", []), ("copy", [f"ref_model={wide_model}"])):
        out = tmp_path / name
        proc = _train(f"model_name_or_path={wide_model}", f"output_dir={out}", "stage=dpo", "dataset=toy_pairs",
                      f"dataset_dir={toy_dir}", "template=llama3", "cutoff_len=64", "lora_rank=4",
                      "per_device_train_batch_size=1", "gradient_accumulation_steps=1", "max_steps=2",
                      "logging_steps=1", "save_steps=100", "plot_loss=false", *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        peaks[name] = max(r["memory_mb"] for r in _rows(out)) * 2**20
    log = (tmp_path / "shared" / "running_log.txt").read_text()
    assert "no second model in memory" in log
    assert weights > 400 * 2**20
    assert peaks["copy"] - peaks["shared"] > 0.6 * weights, (peaks, weights)
