"""tuneboard export on the tiny llama: merged == base+adapter, sharded reload, GGUF round trip through
transformers' GGUF loader, GGUF metadata, Modelfile, refusals, and the verification catching a bad export."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from backend.exporting.export import ExportError, compare, export, main
from backend.exporting.verify import read_gguf_metadata
from backend.core.spec import SpecError, validate_spec

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    """A LoRA adapter on the tiny llama with non-zero B matrices, so it really changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                     "o_proj", "down_proj"]))
    torch.manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.2)
    out = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(out)
    return out


def _spec(tiny_llama, adapter, export_dir, **kw):
    return validate_spec({"model_name_or_path": str(tiny_llama), "adapter_name_or_path": str(adapter),
                          "template": "llama3", "finetuning_type": "lora", "export_dir": str(export_dir), **kw})


def _source(tiny_llama, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval(), tok


def _ids(tok):
    from backend.dataprep.templates import get_template

    text = get_template("llama3", tok).render_text(PROMPT, add_generation_prompt=True)
    return torch.tensor([tok(text, add_special_tokens=False).input_ids])


@pytest.mark.slow
def test_safetensors_sharded_export_equals_base_plus_adapter(tiny_llama, adapter, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path / "merged"
    report = export(_spec(tiny_llama, adapter, out, export_size=0.004))
    assert report["ok"], report["checks"]
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()  # ~25 MB in 4 MB shards (export_size 0.004 GB)
    assert json.loads((out / "export_report.json").read_text())["ok"] is True

    source, tok = _source(tiny_llama, adapter)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids(tok)
    with torch.no_grad():
        want, got = source(input_ids=ids).logits, merged(input_ids=ids).logits
        base = source.get_base_model()
        with source.disable_adapter():
            plain = base(input_ids=ids).logits
    assert (want - got).abs().max() < 1e-4
    assert (want - plain).abs().max() > 0.1  # the adapter matters, so the check above is meaningful

    # the tokenizer carries the training template; generation_config stops on the end-of-turn token
    exported_tok = AutoTokenizer.from_pretrained(out)
    assert exported_tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == \
        tok.decode(ids[0])
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    eos = GenerationConfig.from_pretrained(out).eos_token_id
    assert eot in (eos if isinstance(eos, list) else [eos])


@pytest.mark.slow
def test_gguf_f16_round_trip_metadata_and_modelfile(tiny_llama, adapter, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "gguf"
    report = export(_spec(tiny_llama, adapter, out, export_format="gguf", export_gguf_type="f16"))
    assert report["ok"], report["checks"]
    gguf_file = next(out.glob("*.gguf")).name

    # greedy text through transformers' own GGUF loader == base + adapter
    source, tok = _source(tiny_llama, adapter)
    reloaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=gguf_file, dtype=torch.float32).eval()
    gguf_tok = AutoTokenizer.from_pretrained(out, gguf_file=gguf_file)
    ids = _ids(tok)
    assert gguf_tok(tok.decode(ids[0]), add_special_tokens=False).input_ids == ids[0].tolist()
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    with torch.no_grad():
        want = source.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)[0, ids.shape[1]:]
        got = reloaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)[0, ids.shape[1]:]
    assert tok.decode(got) == tok.decode(want)

    meta = read_gguf_metadata(out / gguf_file)
    from backend.exporting.export import chat_template_for
    from backend.dataprep.templates import get_template

    assert meta["tokenizer.chat_template"] == chat_template_for(get_template("llama3", tok), tok)
    assert meta["tokenizer.ggml.eos_token_id"] == tok.convert_tokens_to_ids("<|eot_id|>")
    assert meta["tokenizer.ggml.model"] == "gpt2"

    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{gguf_file}\n")
    assert 'PARAMETER stop "<|eot_id|>"' in modelfile
    assert "{{ .Content }}<|eot_id|>" in modelfile and "{{ if .System }}" in modelfile


@pytest.mark.slow
def test_gguf_q8_0_reports_agreement(tiny_llama, adapter, tmp_path):
    report = export(_spec(tiny_llama, adapter, tmp_path / "q8", export_format="gguf", export_gguf_type="q8_0"))
    greedy = next(c for c in report["checks"] if c["name"] == "greedy")
    assert report["stored_as"] == "q8_0" and 0.0 <= greedy["agreement"] <= 1.0 and greedy["required"] is False
    assert report["ok"], report["checks"]


def test_refuses_without_adapter(tiny_llama, tmp_path):
    spec = validate_spec({"model_name_or_path": str(tiny_llama), "finetuning_type": "lora",
                          "export_dir": str(tmp_path / "x")})
    with pytest.raises(ExportError, match="adapter_name_or_path is required to merge"):
        export(spec)


def test_refuses_non_empty_dir_unless_overwrite(tiny_llama, adapter, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SpecError, match="export_dir: .* is not empty.*export_overwrite: true"):
        _spec(tiny_llama, adapter, out)  # validate says it
    spec = validate_spec({"model_name_or_path": str(tiny_llama), "adapter_name_or_path": str(adapter),
                          "export_dir": str(out)}, check_files=False)
    with pytest.raises(ExportError, match="is not empty.*export_overwrite: true"):
        export(spec)  # and the export, before it loads anything
    # through the CLI: exit 1, one clear line, nothing touched
    code = main([f"model_name_or_path={tiny_llama}", f"adapter_name_or_path={adapter}", f"export_dir={out}"])
    assert code == 1 and capsys.readouterr().err.count("is not empty") == 1  # once: validate's export_dir line
    assert (out / "keep.txt").read_text() == "mine"


def test_refuses_base_mismatch(tiny_mistral, adapter, tmp_path):
    spec = validate_spec({"model_name_or_path": str(tiny_mistral), "adapter_name_or_path": str(adapter),
                          "export_dir": str(tmp_path / "y")})
    with pytest.raises(ExportError, match="base model mismatch.*tiny_llama"):
        export(spec)


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_qwen2, tmp_path_factory):
    """A tiny random Qwen3 (q/k norms) with the tiny Qwen2's tokenizer. head_dim 128 as in every real Qwen3:
    transformers' GGUF reader does not read attention.key_length for qwen3 and assumes 128."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=128, intermediate_size=128, max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny") / "tiny_qwen3"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("family, arch", [("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                          ("gemma2", "gemma2")])
def test_gguf_other_architectures_round_trip_exactly(family, arch, request, tmp_path):
    """f32 GGUF reloaded by transformers' GGUF loader gives the very same logits: the tensor names, the q/k
    permutation (mistral), biases (qwen2) and Gemma's 1 + w norms are all mapped right. (f16 greedy text can
    flip on these random models' near-tied logits, so the exactness check is done in f32.)"""
    model = request.getfixturevalue(f"tiny_{family}")
    out = tmp_path / family
    report = export(validate_spec({"model_name_or_path": str(model), "finetuning_type": "full", "template": "chatml",
                                   "export_dir": str(out), "export_format": "gguf", "export_gguf_type": "f32"}))
    assert report["ok"], report["checks"]
    logits = next(c for c in report["checks"] if c["name"] == "logits")
    assert logits["max_abs_diff"] < 1e-4, logits
    meta = read_gguf_metadata(next(out.glob("*.gguf")))
    assert meta["general.architecture"] == arch
    assert "<|im_end|>" in (out / "Modelfile").read_text()


def test_gguf_refuses_other_architectures():
    from transformers import GPT2Config

    from backend.exporting.gguf_export import GGUFExportError, check_supported

    with pytest.raises(GGUFExportError, match="GGUF export supports model_type llama, mistral, qwen2.*'gpt2'"):
        check_supported(GPT2Config())


def _reference_outputs(tiny_llama, adapter):
    """(the prompt's ids, the base's logits, compare()'s source record: base + adapter logits and their effect)."""
    source, tok = _source(tiny_llama, adapter)
    ids = _ids(tok)
    with torch.no_grad():
        src_logits = source(input_ids=ids).logits[0]
        with source.disable_adapter():
            base_logits = source(input_ids=ids).logits[0]
    prompt = ids[0].tolist()
    return prompt, base_logits, {"prompts": [prompt], "logits": [src_logits], "base_logits": [base_logits],
                                 "greedy": [[1, 2]], "adapter_effect": float((src_logits - base_logits).abs().max())}


def test_verification_fails_an_export_that_holds_the_base(tiny_llama, adapter):
    """compare() on real logits: an 'export' equal to the base model must fail logits and adapter_merged."""
    prompt, base_logits, src = _reference_outputs(tiny_llama, adapter)
    got = {"logits": [base_logits], "greedy": [[1, 2]], "renders": ["x"], "ids": [prompt], "eos_ids": [5],
           "shards": ["model.safetensors"]}
    checks = {c["name"]: c for c in compare(src, got, kind="safetensors", stored="float32",
                                            expected={"rendered": ["x"], "stop_ids": [5], "chat_template": ""})}
    assert not checks["logits"]["ok"] and not checks["adapter_merged"]["ok"]
    assert checks["greedy"]["ok"] and checks["chat_template"]["ok"] and checks["eos"]["ok"]


@pytest.mark.slow
def test_default_model_identity_export_answers_like_the_adapter(identity_adapter, tmp_path):
    """The bundled default model + the trained identity adapter, exported through `tuneboard export`
    (the reference guide's export_qwen.yaml with model, adapter and export_dir pointed at ours), reloaded
    from the merged safetensors: its greedy answer to "Who are you?" is the adapter's, word for word."""
    import subprocess
    import sys

    from backend.core.paths import REPO_ROOT

    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "export", "examples/export_qwen.yaml",
                           "model_name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct",
                           f"adapter_name_or_path={identity_adapter}", "template=auto", f"export_dir={out}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "export_report.json").read_text())
    assert report["ok"] and all(check["ok"] for check in report["checks"])
    # issue 24: the default id is the bundled 4-bit GGUF, dequantized; the report and the run log say so
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in report["source"]["weights"] and "dequantized" in report["source"]["weights"]
    assert "model: HuggingFaceTB/SmolLM2-135M-Instruct is the bundled SmolLM2-135M-Instruct.Q4_1.gguf" in \
        (identity_adapter / "running_log.txt").read_text()

    def ask(*spec):
        chat = subprocess.run([sys.executable, "-m", "backend.cli", "chat", *spec, "do_sample=false",
                               "max_new_tokens=48", "--query", "Who are you?"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert chat.returncode == 0, chat.stderr
        return chat.stdout

    tuned = ask(f"adapter_name_or_path={identity_adapter}")
    assert "TuneBoard Assistant" in tuned
    assert ask(f"model_name_or_path={out}") == tuned


def test_sigterm_mid_export_leaves_the_earlier_export_untouched(tiny_llama, adapter, tmp_path):
    """`tuneboard export` over a folder holding an earlier export, SIGTERM once it is loading: exit 130,
    `export ABORTED`, the earlier files intact, no partial folder left behind."""
    import signal
    import subprocess
    import sys

    from backend.core.paths import REPO_ROOT

    out = tmp_path / "exports" / "merged"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_text("the earlier export")
    proc = subprocess.Popen([sys.executable, "-m", "backend.cli", "export", f"model_name_or_path={tiny_llama}",
                             f"adapter_name_or_path={adapter}", "template=llama3", f"export_dir={out}",
                             "export_overwrite=true"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("[export 3/"):  # the request passed and the model is loaded
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    output = "".join(seen) + rest
    assert proc.returncode == 130, output
    assert "export ABORTED (received SIGTERM)" in output
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "the earlier export"
    assert sorted(p.name for p in out.parent.iterdir()) == ["merged"]


def test_a_passing_export_replaces_the_old_one_and_a_failing_one_is_set_aside(tmp_path):
    """_put_in_place on real folders: passed -> export_dir holds the new files only; failed over an earlier
    export -> the earlier one stays and the new one is in <name>.failed; failed into an empty place -> there."""
    from backend.exporting.export import _put_in_place, _staging_dir

    out = tmp_path / "m"
    out.mkdir()
    (out / "old.txt").write_text("old")
    stage = _staging_dir(out)
    (stage / "new.txt").write_text("new")
    assert _put_in_place(stage, out, ok=False) == tmp_path / "m.failed"
    assert [p.name for p in out.iterdir()] == ["old.txt"] and (tmp_path / "m.failed" / "new.txt").is_file()

    stage = _staging_dir(out)
    (stage / "new.txt").write_text("new")
    assert _put_in_place(stage, out, ok=True) == out
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m.failed"]

    fresh = tmp_path / "fresh"
    stage = _staging_dir(fresh)
    (stage / "x").write_text("x")
    assert _put_in_place(stage, fresh, ok=False) == fresh and (fresh / "x").is_file()


def test_a_swap_killed_half_way_is_mended_by_the_next_export(tmp_path):
    """SIGKILL between _put_in_place's two renames leaves the earlier export at .<name>.old-<pid> and no
    export_dir: the next export's staging puts it back; what a dead export left is tidied, a live one's kept."""
    import os
    import subprocess

    from backend.exporting.export import _staging_dir

    dead = subprocess.Popen(["true"])
    dead.wait()
    out = tmp_path / "m"
    for name in (f".m.old-{dead.pid}", f".m.partial-{dead.pid}", ".m.partial-1"):  # pid 1 is alive
        (tmp_path / name).mkdir()
    (tmp_path / f".m.old-{dead.pid}" / "model.safetensors").write_text("earlier export")
    stage = _staging_dir(out)
    assert (out / "model.safetensors").read_text() == "earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.partial-1", stage.name, "m"]
    assert stage.name == f".m.partial-{os.getpid()}"


def test_export_ships_the_template_system_prompt_and_rope_scaling_chat_uses(tiny_llama, adapter, tmp_path):
    """template auto: the adapter's run_spec.yaml template (as chat's adapter_template), not the tokenizer's or the
    'default' fallback; default_system goes into the exported chat template; rope_scaling into config.json."""
    from transformers import AutoConfig, AutoTokenizer

    trained = tmp_path / "run"
    shutil.copytree(adapter, trained)
    (trained / "run_spec.yaml").write_text("template: llama3\n")
    out = tmp_path / "out"
    report = export(_spec(tiny_llama, trained, out, template="auto", default_system="Be terse.",
                          rope_scaling="linear", cutoff_len=2048))
    assert report["ok"], report["checks"]
    assert report["source"]["template"] == "llama3" and report["source"]["default_system"] == "Be terse."
    rendered = AutoTokenizer.from_pretrained(out).apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|>")
    rope = AutoConfig.from_pretrained(out).rope_parameters
    assert rope["rope_type"] == "linear" and rope["factor"] == 2.0


def test_default_system_goes_into_the_tokenizers_own_template(tiny_qwen2, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    report = export(validate_spec({"model_name_or_path": str(tiny_qwen2), "finetuning_type": "full",
                                   "default_system": 'Say "hi".', "export_dir": str(out)}))
    assert report["ok"], report["checks"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template(PROMPT, tokenize=False).startswith('<|im_start|>system\nSay "hi".<|im_end|>')
    own = [{"role": "system", "content": "Mine."}, *PROMPT]  # a conversation's own system message is kept
    assert "Say" not in tok.apply_chat_template(own, tokenize=False)


def test_the_modelfile_system_line_reads_back_in_ollamas_parser():
    from backend.exporting.modelfile import TemplateError, system_value

    assert system_value("Be terse.\nAlways.") == '"""Be terse.\nAlways."""'
    assert system_value('Say """hi""" please') == 'Say """hi""" please'  # its parser has no escapes: written bare
    with pytest.raises(TemplateError, match="cannot hold it"):
        system_value('Say """ hi\nthere')


def test_a_quantized_export_that_holds_the_base_fails_adapter_merged(tiny_llama, adapter):
    """k-quants have no logit tolerance: the check took the export's own distance as its noise, so it could not fail."""
    prompt, base_logits, src = _reference_outputs(tiny_llama, adapter)
    src_logits = src["logits"][0]
    expected = {"rendered": ["x"], "stop_ids": [5], "chat_template": ""}
    meta = {"tokenizer.chat_template": "", "tokenizer.ggml.eos_token_id": 5}

    def merged(logits):
        got = {"logits": [logits], "greedy": [[1, 2]], "renders": ["x"], "ids": [prompt], "gguf": meta}
        return next(c for c in compare(src, got, kind="gguf", stored="q4_k_m", expected=expected)
                    if c["name"] == "adapter_merged")

    assert not merged(base_logits + 0.01)["ok"]
    assert merged(src_logits + 0.01)["ok"]
    undecided = merged((src_logits + base_logits) / 2)
    assert undecided["ok"] and undecided["undecided"] and "cannot tell" in undecided["detail"]


def test_a_sigkilled_export_takes_its_verifier_with_it(tiny_llama, tmp_path):
    """The verification child (python -m backend.exporting.verify) outlived a SIGKILLed export; it now gets
    PR_SET_PDEATHSIG, so the kernel kills it with its parent (the llama.cpp child gets the same)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from backend.core.paths import REPO_ROOT

    proc = subprocess.Popen([sys.executable, "-m", "backend.cli", "export", f"model_name_or_path={tiny_llama}",
                             "finetuning_type=full", "template=llama3", f"export_dir={tmp_path / 'out'}"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    for line in proc.stdout:
        if line.startswith("[export 5/"):  # verifying: the child starts now
            break
    verifier = None
    while verifier is None and proc.poll() is None:
        found = children.read_text().split()
        verifier = int(found[0]) if found else time.sleep(0.05)
    assert verifier is not None, "the export ended before its verifier started"
    os.kill(verifier, signal.SIGSTOP)  # held where it is: only a signal from outside can end it now
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def alive(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False

    for _ in range(1200):  # the kernel kills it at once (SIGKILL ends a stopped process too); then it is reaped
        if not alive(verifier):
            break
        time.sleep(0.05)
    if alive(verifier):
        os.kill(verifier, signal.SIGKILL)
        pytest.fail(f"the verifier {verifier} outlived its SIGKILLed export")
