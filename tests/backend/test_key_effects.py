"""Small in-process proofs that RunSpec keys read outside the Trainer change what happens (the rest of the proofs
are named in tests/backend/test_every_key.py: CONSUMED)."""
import json

import pytest
import torch

from backend.core.spec import validate_spec


def spec(**kwargs):
    return validate_spec(kwargs, check_files=False)


def test_trust_remote_code_reaches_the_loaders(monkeypatch, tiny_llama):
    from transformers import AutoModelForCausalLM

    from backend.training.models import load_model, resolve_model

    seen = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    resolved = resolve_model(str(tiny_llama))
    load_model(spec(model_name_or_path=str(tiny_llama)), resolved, for_training=False)
    load_model(spec(model_name_or_path=str(tiny_llama), trust_remote_code=True), resolved, for_training=False)
    assert seen == [None, True]


def test_neat_packing_packs_without_cross_attention():
    from backend.dataprep.preprocess import PackedCollator
    from backend.stages.base import batching

    class Log:
        def log(self, _):
            pass

    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "attention_mask": [1, 1, 1]},
            {"input_ids": [4, 5], "labels": [4, 5], "attention_mask": [1, 1]}]
    plain = spec(cutoff_len=16)
    neat = spec(cutoff_len=16, neat_packing=True)
    assert not plain.resolved_packing and neat.resolved_packing
    packed, collator = batching(neat, Log(), rows, tokenizer=0)
    assert isinstance(collator, PackedCollator) and len(packed) == 1
    assert packed[0]["position_ids"] == [0, 1, 2, 0, 1]  # each row restarts: no attention across rows
    assert len(batching(plain, Log(), rows, tokenizer=0)[0]) == 2


def test_overwrite_output_dir_replaces_a_finished_run(tmp_path):
    from backend.stages.base import RunError
    from backend.training.train import prepare_output_dir

    out = tmp_path / "run"
    out.mkdir()
    (out / "trainer_state.json").write_text("{}")
    with pytest.raises(RunError, match="already holds a run"):
        prepare_output_dir(spec(output_dir=str(out)))
    prepare_output_dir(spec(output_dir=str(out), overwrite_output_dir=True))
    assert not (out / "trainer_state.json").exists() and (out / "run_spec.yaml").is_file()


def test_generation_keys_are_the_served_defaults():
    from backend.serving.engine import make_sampling, sampling_defaults

    keys = dict(max_new_tokens=7, do_sample=False, temperature=0.3, top_p=0.5, top_k=3, repetition_penalty=1.2)
    sampling = make_sampling(sampling_defaults(spec(**keys)), {})
    assert {k: getattr(sampling, k) for k in keys} == keys
    default = make_sampling(sampling_defaults(spec()), {})
    assert all(getattr(default, k) != v for k, v in keys.items())


def test_num_beams_and_sampling_keys_reach_generate(tiny_llama, tmp_path):
    """Predictions (do_predict, tuneboard eval) generate with the spec's keys."""
    from backend.evaluation.evaluate import predict
    from backend.training.models import load_model, load_tokenizer, resolve_model
    from backend.dataprep.templates import get_template

    resolved = resolve_model(str(tiny_llama))
    tokenizer = load_tokenizer(resolved)
    model = load_model(spec(model_name_or_path=str(tiny_llama)), resolved, for_training=False)
    seen = []
    real = model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    model.generate = spy
    example = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    s = spec(model_name_or_path=str(tiny_llama), num_beams=2, max_new_tokens=3, repetition_penalty=1.3)
    predict(model, tokenizer, get_template("llama3", tokenizer), [example], tmp_path / "p.jsonl", s)
    assert (seen[0]["num_beams"], seen[0]["max_new_tokens"], seen[0]["repetition_penalty"]) == (2, 3, 1.3)


def test_infer_dtype_and_export_device(monkeypatch, tmp_path):
    from backend.exporting import export

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert export._save_dtype(spec(), tmp_path) == torch.bfloat16  # auto: the model's own dtype
    assert export._save_dtype(spec(infer_dtype="float16"), tmp_path) == torch.float16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert export._device(spec()) == "cpu"
    assert export._device(spec(export_device="auto")) == "cuda"


def test_do_eval_alone_skips_the_predictions(tiny_llama, tmp_path):
    from backend.evaluation.evaluate import PREDICTIONS_FILE, RESULTS_FILE, run

    rows = [{"instruction": "Say hello.", "output": "Hello there!"}]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"one": {"file_name": "rows.json"}}))
    out = tmp_path / "eval"
    s = validate_spec({"model_name_or_path": str(tiny_llama), "template": "llama3", "dataset_dir": str(tmp_path),
                       "dataset": "one", "output_dir": str(out), "do_eval": True, "max_new_tokens": 2})
    assert run(s) == 0
    assert "eval_loss" in json.loads((out / RESULTS_FILE).read_text())
    assert not (out / PREDICTIONS_FILE).exists()


def test_preference_keys_reach_the_trl_configs(monkeypatch, tiny_llama, tmp_path):
    """pref_beta, simpo_gamma (stage dpo) and pref_beta, kto_chosen_weight, kto_rejected_weight (stage kto) become
    the TRL configs' beta, simpo_gamma, desirable_weight, undesirable_weight."""
    from backend.stages import dpo, kto
    from backend.stages.base import StageResult

    for loss in ("sigmoid", "orpo", "simpo"):
        _, _, config = dpo.trainer_for(spec(stage="dpo", pref_loss=loss, pref_beta=0.37), loss)
        assert config["beta"] == 0.37
    assert dpo.trainer_for(spec(stage="dpo", pref_loss="simpo", simpo_gamma=0.9), "simpo")[2]["simpo_gamma"] == 0.9

    seen = {}

    def fake_fit(*args, **kwargs):
        seen.update(kwargs["config"])
        return StageResult()

    class RunDir:
        path = tmp_path

        def log(self, _):
            pass

        warn = log

    monkeypatch.setattr(kto, "fit", fake_fit)
    s = validate_spec({"model_name_or_path": str(tiny_llama), "template": "llama3", "stage": "kto",
                       "dataset": "kto_en_demo", "max_samples": 8, "cutoff_len": 64, "pref_beta": 0.3,
                       "kto_chosen_weight": 1.5, "kto_rejected_weight": 0.5, "output_dir": str(tmp_path)})
    kto.run(s, RunDir(), stop=None)
    assert (seen["beta"], seen["desirable_weight"], seen["undesirable_weight"]) == (0.3, 1.5, 0.5)
