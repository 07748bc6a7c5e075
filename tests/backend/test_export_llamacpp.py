"""GGUF k-quants written by llama.cpp's quantizer and every GGUF export checked in llama.cpp itself
(backend/exporting/llamacpp_check.py); the k-quants refused, with how to get llama.cpp, when it is missing.

The model is a one-layer Llama as wide as a k-quant block (256 columns), so q4_k_m really holds Q4_K / Q6_K
tensors (the session's tiny models are 64 wide: llama.cpp would fall back to Q5_0 for every tensor); its
tokenizer is the tiny Llama's (the SmolLM2 tokenizer llama.cpp knows, plus Llama 3's special tokens)."""
import importlib.util
import json
import shutil

import pytest

from backend.core import llamacpp
from backend.core.refusals import REFUSED
from backend.core.spec import SpecError, validate_spec
from backend.exporting import llamacpp_check
from backend.exporting.export import export, main

needs_llamacpp = pytest.mark.skipif(not llamacpp.available(),
                                    reason="llama-cpp-python is not installed (make setup-gguf builds it)")


def test_kquant_refused_without_llama_cpp_says_how_to_get_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(SpecError) as exc:
        validate_spec({"export_format": "gguf", "export_gguf_type": "q4_k_m"}, check_files=False)
    field, message = exc.value.errors[0]
    assert field == "export_gguf_type" and message.startswith(REFUSED)
    assert "llama-cpp-python" in message and "make setup-gguf" in message
    validate_spec({"export_format": "gguf", "export_gguf_type": "q8_0"}, check_files=False)  # our own writer's


def _spec(model, export_dir, gguf_type, **kw):
    return validate_spec({"model_name_or_path": str(model), "finetuning_type": "full", "template": "llama3",
                          "export_dir": str(export_dir), "export_format": "gguf", "export_gguf_type": gguf_type, **kw})


def test_the_perplexity_scores_only_labelled_tokens_each_given_the_previous_positions_logits():
    """llamacpp_check._nll: token i (i >= 1) counts when labels[i] != -100, scored by the logits of position i - 1."""
    import numpy as np

    scores = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]]))
    ids, labels = [0, 1, 2, 0], [-100, -100, 2, 0]  # the prompt 0, 1; the answer 2, 0
    nll, count = llamacpp_check._nll(scores, ids, labels)
    assert count == 2 and nll == pytest.approx(-np.log(0.1) - np.log(0.2))  # p(2 | pos 1) and p(0 | pos 2)
    assert llamacpp_check._nll(scores, ids, [-100] * 4) == (0.0, 0)


def test_greedy_answers_match_up_to_near_ties_and_a_sure_flip_warns():
    """llamacpp_check.greedy_check: along the adapter's answers, a position where llama.cpp's top token differs is
    a near-tie when the adapter's own log-probabilities of the two tokens are within the type's GREEDY_NEAR_TIE;
    a wider one warns, naming the probe, the token and the gap."""
    import numpy as np

    tie = llamacpp.GREEDY_NEAR_TIE["q4_k_m"]
    # probe 0: 3 positions over a 4-token vocabulary, the adapter's choices 1, 2, 3; probe 1: 2 positions, 3 and 0
    lp0 = np.log(np.array([[0.1, 0.7, 0.1, 0.1], [0.05, 0.05, 0.5, 0.4], [0.1, 0.1, 0.1, 0.7]]))
    lp1 = np.log(np.array([[0.1, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.1]]))
    near, sure = float(np.log(0.5 / 0.4)), float(np.log(0.7 / 0.1))  # probe 0 position 1: 2 against 3
    assert near < tie < sure
    own = [lp0.max(1).tolist(), lp1.max(1).tolist()]  # llama.cpp's log-probs of the adapter's tokens: the same ...
    own[0][1] -= 0.3  # ... but one, 0.3 nats lower: a shift of 0.3 / sqrt(5) root mean square over the 5 positions

    def run(stored, got_greedy, top0, top1, warn):
        return llamacpp_check.greedy_check(stored, [[1, 2], [3]], got_greedy, [lp0, lp1],
                                           [{"top": top0, "gap": [0.0, 0.2, 0.0], "target": own[0]},
                                            {"top": top1, "gap": [0.0, 0.0], "target": own[1]}], warn)

    said = []
    check = run("q4_k_m", [[1, 3], [3]], [1, 3, 3], [3, 0], said.append)
    assert said == [] and check["matches"] and check["ok"]
    assert (check["forced_agree"], check["forced_total"], check["answers_identical"]) == (4, 5, 1)
    assert check["flips"] == [{"probe": 0, "position": 1, "adapter_token": 2, "llamacpp_token": 3,
                               "adapter_nats": round(near, 4), "llamacpp_nats": 0.2}]
    assert check["shift_rms_nats"] == pytest.approx(0.3 / np.sqrt(5), abs=1e-4)
    assert "1/2 identical" in check["detail"] and "4/5 positions" in check["detail"] and "near-ties" in check["detail"]
    # llama.cpp picks 0 at probe 1's first position, where the adapter gave it a seventh of its own choice: sure
    check = run("q4_k_m", [[1, 3], [0]], [1, 3, 3], [0, 0], said.append)
    assert not check["matches"] and check["forced_agree"] == 3 and check["largest_flip_nats"] == round(sure, 4)
    assert len(said) == 1 and "probe 1, token 0" in said[0] and f"{sure:.2f} nats" in said[0], said
    # the first flips on a type with a tighter near-tie: the near one warns too
    said.clear()
    assert not run("q8_0", [[1, 3], [3]], [1, 3, 3], [3, 0], said.append)["matches"]
    assert len(said) == 1 and "1 of 5 positions" in said[0]


@pytest.fixture(scope="module")
def q4_export(wide_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("q4") / "export"
    return out, export(_spec(wide_llama, out, "q4_k_m"))


@pytest.mark.slow
@needs_llamacpp
def test_q4_k_m_export_is_quantized_and_verified_in_llama_cpp(q4_export, wide_llama):
    from backend.dataprep.templates import get_template
    from backend.exporting.export import perplexity_rows
    from backend.exporting.verify import read_gguf_metadata
    from backend.training.models import load_tokenizer, resolve_model

    out, report = q4_export
    assert report["ok"], report["checks"]
    checks = {c["name"]: c for c in report["checks"]}
    assert {"llamacpp_load", "llamacpp_perplexity", "llamacpp_greedy", "llamacpp_template"} <= set(checks)
    assert checks["llamacpp_template"]["ok"], checks["llamacpp_template"]["detail"]
    # llama.cpp's quantizer wrote real k-quant blocks (not a fallback), and the file says it is Q4_K_M
    assert {"Q4_K", "Q6_K"} <= set(checks["llamacpp_load"]["tensor_types"])
    gguf_file = next(out.glob("*.gguf"))
    assert gguf_file.name.endswith("-q4_k_m.gguf")
    assert read_gguf_metadata(gguf_file)["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    # the report's row: smaller than the f16 file, perplexity measured against it
    row = report["source"]["llamacpp"]
    assert row["type"] == "q4_k_m" and row["ppl"] > 1 and row["ppl_f16"] > 1 and row["tokens_per_s"] > 0
    assert abs(row["ppl_delta_pct"] - 100 * (row["ppl"] / row["ppl_f16"] - 1)) < 0.01
    # scored: the held-out rows' answer tokens as training labels them (each given its prompt), not their prompts
    tokenizer = load_tokenizer(resolve_model(str(wide_llama)))
    rows = perplexity_rows(get_template("llama3", tokenizer), tokenizer)
    answers = sum(sum(1 for label in r["labels"][1:] if label != -100) for r in rows)
    assert row["ppl_tokens"] == answers < sum(len(r["ids"]) - 1 for r in rows) / 2
    assert f"({answers} answer tokens, each given its prompt)" in checks["llamacpp_perplexity"]["detail"]
    assert [a["prompt"] for a in row["answers"]][0] == "What is the capital of France?"
    # greedy answers: teacher-forced along the adapter's answers (each answer's tokens and the one after it)
    greedy = checks["llamacpp_greedy"]
    source = report["source"]["llamacpp"]
    assert greedy["forced_total"] == row["forced_total"] == sum(len(a["source_ids"]) + 1 for a in source["answers"])
    for a in source["answers"]:  # along the common prefix llama.cpp's forced top token is its own greedy token, and
        ours, theirs = a["source_ids"], a["llamacpp_ids"]  # where the free-running answers part it is a flip
        common = next((k for k, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
        flips = {f["position"]: f for f in greedy["flips"] if f["probe"] == a["probe"]}
        assert all(k not in flips or flips[k]["llamacpp_token"] == theirs[k] for k in range(common))
        if common < min(len(ours), len(theirs)):
            assert flips[common]["llamacpp_token"] == theirs[common] and flips[common]["adapter_token"] == ours[common]
    assert sorted(p.name for p in out.iterdir()) == sorted(["Modelfile", gguf_file.name, "export_report.json"])
    assert (out / "Modelfile").read_text().startswith(f"FROM ./{gguf_file.name}\n")


@pytest.mark.slow
@needs_llamacpp
def test_truncated_file_fails_in_one_line_and_the_earlier_export_stays(q4_export, wide_llama, monkeypatch, capsys):
    out, report = q4_export
    gguf_file = next(out.glob("*.gguf"))
    before = gguf_file.read_bytes()
    real_quantize = llamacpp_check.quantize

    def quantize_then_truncate(f16, dst, gguf_type, **kw):  # a file cut short, as by a full disk or a killed copy
        entries = real_quantize(f16, dst, gguf_type, **kw)
        data = dst.read_bytes()
        dst.write_bytes(data[: len(data) // 2])
        return entries

    monkeypatch.setattr(llamacpp_check, "quantize", quantize_then_truncate)
    assert main(_argv(wide_llama, out)) == 1
    printed = capsys.readouterr().out
    failed = json.loads((out.parent / "export.failed" / "export_report.json").read_text())
    load = next(c for c in failed["checks"] if c["name"] == "llamacpp_load")
    assert not load["ok"] and "\n" not in load["detail"] and f"cannot load {gguf_file.name}" in load["detail"]
    assert "export FAILED verification" in printed and "llamacpp_load: llama.cpp cannot load" in printed
    assert gguf_file.read_bytes() == before  # the earlier, verified export is untouched
    shutil.rmtree(out.parent / "export.failed")


def test_export_imatrix_needs_a_type_llama_cpp_quantizes_and_llama_cpp(monkeypatch):
    for flat in ({"export_format": "gguf", "export_gguf_type": "q8_0"}, {"export_format": "safetensors"}):
        with pytest.raises(SpecError) as exc:
            validate_spec({**flat, "export_imatrix": True}, check_files=False)
        (field, message), = exc.value.errors
        assert field == "export_imatrix" and "\n" not in message and "q4_k_m" in message
    real = importlib.util.find_spec
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(SpecError) as exc:
        validate_spec({"export_format": "gguf", "export_gguf_type": "q6_k", "export_imatrix": True}, check_files=False)
    refused = dict(exc.value.errors)
    assert refused["export_imatrix"].startswith(REFUSED) and "make setup-gguf" in refused["export_imatrix"]


@pytest.mark.slow
@needs_llamacpp
def test_export_imatrix_reaches_llama_cpps_quantizer(q4_export, wide_llama, tmp_path):
    import gguf
    import numpy as np

    from backend.exporting.imatrix import compute

    out = tmp_path / "export"
    report = export(_spec(wide_llama, out, "q4_k_m", export_imatrix=True))
    assert report["ok"], report["checks"]
    info = report["source"]["gguf"]["imatrix"]
    # the 7 linear layers of the one block (q k v o, gate up down), not the output head
    assert info["weights"] == 7 and info["rows"] > 0 and info["tokens"] > info["rows"]
    assert not list(out.glob("*.tmp"))
    load = next(c for c in report["checks"] if c["name"] == "llamacpp_load")
    assert (load["imatrix_rows"], load["imatrix_tokens"]) == (info["rows"], info["tokens"])
    assert "importance matrix of 7 weights" in load["detail"]
    # the file says it was quantized with a matrix, as llama-quantize's files do
    meta = gguf.GGUFReader(str(next(out.glob("*.gguf")))).fields
    assert int(meta["quantize.imatrix.entries_count"].parts[-1][0]) == 7
    assert "alpaca_en_demo" in bytes(meta["quantize.imatrix.dataset"].parts[-1]).decode()
    # the same f16 model quantized without the matrix: the same tensor types, other Q4_K blocks
    plain = {t.name: t for t in gguf.GGUFReader(str(next(q4_export[0].glob("*.gguf")))).tensors}
    weighted = {t.name: t for t in gguf.GGUFReader(str(next(out.glob("*.gguf")))).tensors}
    assert {n: t.tensor_type for n, t in plain.items()} == {n: t.tensor_type for n, t in weighted.items()}
    changed = [n for n, t in plain.items() if t.tensor_type.name == "Q4_K" and not np.array_equal(t.data, weighted[n].data)]
    assert changed, "the importance matrix did not change a Q4_K tensor"
    assert "token_embd.weight" not in changed  # a lookup, not a matrix product: no matrix for it
    # the matrix is what llama-imatrix computes: per input column, the mean over all tokens of the squared input
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(wide_llama, dtype=torch.float32).eval()
    ids = [[1, 5, 9, 14, 3], [7, 2]]
    seen = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0][0]))
    matrix = compute(model, ids)
    hook.remove()
    want = (torch.cat(seen) ** 2).mean(dim=0).numpy()
    assert set(matrix) == set(weighted) - {"token_embd.weight", "output.weight"} - {
        n for n in weighted if n.endswith("norm.weight")}
    np.testing.assert_allclose(matrix["blk.0.attn_q.weight"], want, rtol=1e-5)


def _argv(model, out):
    return [f"model_name_or_path={model}", "finetuning_type=full", "template=llama3", f"export_dir={out}",
            "export_format=gguf", "export_gguf_type=q4_k_m", "export_overwrite=true"]



# ------------------------------------------------------------------ infer_backend llamacpp (the export served)
@pytest.fixture(scope="module")
def llamacpp_engine(q4_export):
    from backend.serving.engine import load_engines

    out, _ = q4_export
    spec = validate_spec({"model_name_or_path": str(out), "infer_backend": "llamacpp", "template": "llama3",
                          "do_sample": False, "max_new_tokens": 8})
    engines = load_engines(spec, log=lambda m: None)
    return next(iter(engines.values()))


@pytest.mark.slow
@needs_llamacpp
def test_llamacpp_backend_streams_the_greedy_answer_the_export_check_saw(q4_export, llamacpp_engine):
    from backend.exporting.export import PROBE_CONVERSATIONS

    _, report = q4_export
    greedy = next(c for c in report["checks"] if c["name"] == "llamacpp_greedy")["greedy"]
    engine = llamacpp_engine
    assert type(engine).__name__ == "LlamaCppEngine"
    reply = engine.chat(PROBE_CONVERSATIONS[0], max_new_tokens=12)
    assert reply.token_ids[: len(greedy[0])] == greedy[0]  # the same ids as llama.cpp's check decoded
    stream = engine.stream(PROBE_CONVERSATIONS[0], max_new_tokens=12)
    assert "".join(stream) == reply.text and stream.reply.completion_tokens == reply.completion_tokens
    assert reply.finish_reason in ("stop", "length")
    if reply.text.strip():  # a stop string cuts the answer where it starts, and is never shown
        word = reply.text.strip()[:2]
        cut = engine.chat(PROBE_CONVERSATIONS[0], max_new_tokens=12, stop=[word])
        assert word not in cut.text and reply.text.startswith(cut.text)
    ids = engine.prompt_ids(PROBE_CONVERSATIONS[0])
    scored = engine.score(ids, top=2)
    assert len(scored) == len(ids) and scored[0].logprob is None
    assert all(s.logprob <= 0 and len(s.top) == 2 and s.top[0][1] >= s.logprob - 1e-6 for s in scored[1:])
    # after other work on the one llama.cpp context, the same greedy answer (the prompt is evaluated whole)
    assert engine.chat(PROBE_CONVERSATIONS[0], max_new_tokens=12).token_ids == reply.token_ids


@pytest.mark.slow
@needs_llamacpp
def test_the_openai_client_against_tuneboard_api_on_the_q4_k_m_export(q4_export):
    """`tuneboard api infer_backend=llamacpp` on the export folder, in its own process, driven by the real openai
    client: the greedy answer is the one llama.cpp gave in the export's check, streamed the same, with logprobs."""
    import openai
    from api_server import start_server, stop_server

    from backend.exporting.export import PROBE_CONVERSATIONS

    out, report = q4_export
    checked = report["source"]["llamacpp"]["answers"][0]  # what llama.cpp answered the first probe in the export
    proc, url = start_server(f"model_name_or_path={out}", "infer_backend=llamacpp", "template=llama3",
                             env={"TUNEBOARD_API_KEY": "sk-q4"})
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-q4", max_retries=0, timeout=120)
        [model] = [m.id for m in client.models.list()]
        body = dict(model=model, messages=PROBE_CONVERSATIONS[0], max_tokens=12, temperature=0)
        whole = client.chat.completions.create(**body, logprobs=True, top_logprobs=2)
        choice = whole.choices[0]
        assert choice.message.content == checked["llamacpp"], (choice.message.content, checked)
        assert whole.usage.completion_tokens == len(checked["llamacpp_ids"]) + (choice.finish_reason == "stop")
        scored = choice.logprobs.content
        assert scored and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in scored)
        assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in scored)  # greedy: its token is the top one
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True)
                           if c.choices)
        assert streamed == choice.message.content
    finally:
        stop_server(proc)


def test_llamacpp_backend_refuses_a_transformers_folder(tiny_llama, tmp_path):
    from backend.serving.engine import load_engines

    if not llamacpp.available():
        with pytest.raises(SpecError, match="make setup-gguf"):
            validate_spec({"model_name_or_path": str(tiny_llama), "infer_backend": "llamacpp"}, check_files=False)
        return
    with pytest.raises(SpecError, match="infer_backend: llamacpp needs a .gguf file"):  # validate says it
        validate_spec({"model_name_or_path": str(tiny_llama), "infer_backend": "llamacpp"})
    spec = validate_spec({"infer_backend": "llamacpp"}).model_copy(update={"model_name_or_path": str(tiny_llama)})
    with pytest.raises(ValueError, match="needs a .gguf file"):  # and the launch, with the same words
        load_engines(spec, log=lambda m: None)


def test_a_k_quant_whose_matrices_fell_back_says_so():
    """q6_k on a 64-wide model holds no Q6_K tensor (rows not a multiple of 256): the name promised more."""
    from backend.exporting.llamacpp_check import type_share, type_share_line

    share = type_share("q6_k", {"F32": 5, "Q8_0": 9})
    assert share["got"] == 0 and share["matrices"] == 9
    assert "holds Q6_K in 0 of its 9 weight matrices (0%); the others are Q8_0 x9" in type_share_line("q6_k", share)
    assert type_share("q4_k_m", {"F32": 3, "Q4_K": 6, "Q6_K": 2}) == {
        "promised": ["Q4_K", "Q6_K"], "got": 8, "matrices": 8, "others": {}}
    assert type_share("q8_0", {"Q8_0": 4}) is None


@pytest.mark.slow
@needs_llamacpp
def test_the_chat_tab_runs_the_gguf_export_with_llama_cpp(q4_export, monkeypatch):
    """Chat's "Run with llama.cpp": the export folder served by `tuneboard api` with infer_backend llamacpp, answered
    through the tab's own handlers; without the switch the same folder would load in transformers."""
    from webui.tabs import chat

    out, _ = q4_export
    monkeypatch.setenv("TUNEBOARD_ALLOW_PATHS", str(out))
    st = None
    for st, status, _, _ in chat.load(str(out), "", "auto", False, "", chat.empty_state(), "en", True):
        pass
    try:
        assert status.startswith("✓"), status
        assert "infer_backend=llamacpp" in st["server"].cmd
        answer = None
        for answer, *_ in chat.respond("Hello there", "user", st, "", "", 6, 0.0, 0.9, 50, 1.0, None):
            pass
        assert [m["role"] for m in answer] == ["user", "assistant"] and answer[1]["content"]
    finally:
        chat.unload(st)
