"""lm-evaluation-harness benchmarks (`tuneboard eval tasks=...`, backend/evaluation/benchmarks.py) and logprobs in
`tuneboard api`: the shipped multiple-choice task scored in-process (lm-eval's HFLM on our loaded model, base
and adapter) gives the same accuracy as lm-eval's `local-completions` model scoring it through the API's
/v1/completions logprobs; the API's logprobs are the model's log-softmax; bad tasks are one line each."""
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from api_server import start_server, stop_server

from backend.core.benchmark_tasks import SHIPPED_TASK, lm_eval_missing
from backend.core.paths import REPO_ROOT
from backend.core.rundir import LM_EVAL_FILE

pytestmark = pytest.mark.skipif(lm_eval_missing() is not None, reason="the lm-eval extra is not installed")

ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tuned(tiny_qwen2, tmp_path_factory):
    """A LoRA adapter with random non-zero weights on tiny_qwen2 (so it scores unlike the base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("bench_adapter") / "mc-adapter"
    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def api(tiny_qwen2, tuned):
    """`tuneboard api` on tiny_qwen2 + the adapter, in a subprocess; (base url, base name, adapter name)."""
    proc, url = start_server(f"model_name_or_path={tiny_qwen2}", "--adapter", str(tuned), env=ENV, timeout=180)
    yield url, str(tiny_qwen2), tuned.name
    stop_server(proc)


def tuneboard(*args, cwd=REPO_ROOT, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **ENV, **(env or {})})


def test_shipped_task_in_process_equals_lm_eval_through_the_api(tiny_qwen2, tuned, api, tmp_path):
    from lm_eval import simple_evaluate

    from backend.evaluation.benchmarks import build_tasks

    # in-process, run from another working directory: the task's data_files are found next to its YAML
    out = tmp_path / "bench"
    done = tuneboard("eval", f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={tuned}",
                     f"tasks={SHIPPED_TASK}", f"output_dir={out}", "per_device_eval_batch_size=1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / LM_EVAL_FILE).read_text())
    rows = {(r["task"], r["metric"]): r for r in results["rows"]}
    acc = rows[("tuneboard_mc", "acc")]
    assert acc["n"] == 30 and set(results["models"]) == {"base", "tuned"}
    for name in ("base", "tuned"):
        assert 0 <= acc[name] <= 1 and acc[f"{name}_stderr"] > 0
    assert acc["delta"] == pytest.approx(acc["tuned"] - acc["base"])
    assert set(rows) == {("tuneboard_mc", "acc"), ("tuneboard_mc", "acc_norm")}
    norm = rows[("tuneboard_mc", "acc_norm")]
    assert (acc["base"], norm["base"]) != (acc["tuned"], norm["tuned"])  # the adapter was applied

    # the same task through the API: lm-eval's local-completions sends token ids with echo and reads logprobs
    url, base_name, adapter_name = api
    specs, manager = build_tasks([str(SHIPPED_TASK)])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    # HFLM adds the BOS the tokenizer adds by default; local-completions adds one only when told
    add_bos = tok.bos_token_id is not None and tok("a").input_ids[:1] == [tok.bos_token_id]
    for name, model in (("base", base_name), ("tuned", adapter_name)):
        got = simple_evaluate(model="local-completions", model_args={
            "base_url": f"{url}/v1/completions", "model": model, "tokenizer": str(tiny_qwen2),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "add_bos_token": add_bos,
            "max_retries": 1, "num_concurrent": 1}, tasks=specs, task_manager=manager, log_samples=False,
            bootstrap_iters=1000)["results"]["tuneboard_mc"]
        assert got["acc,none"] == pytest.approx(acc[name]), name
        assert got["acc_norm,none"] == pytest.approx(rows[("tuneboard_mc", "acc_norm")][name]), name


def test_num_fewshot_and_limit_reach_lm_eval(tiny_qwen2, tmp_path):
    """Without an adapter only the base is scored; limit=5 scores 5 questions, num_fewshot=2 puts 2 solved
    examples (the task's fewshot split) before each."""
    out = tmp_path / "few"
    done = tuneboard("eval", f"model_name_or_path={tiny_qwen2}", f"tasks={SHIPPED_TASK}", "num_fewshot=2",
                     "limit=5", f"output_dir={out}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / LM_EVAL_FILE).read_text())
    assert results["models"] == ["base"] and results["limit"] == 5 and results["num_fewshot"] == 2
    for row in results["rows"]:
        assert row["n"] == 5 and row["num_fewshot"] == 2 and "tuned" not in row and "delta" not in row


def _log_softmax(model_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_are_the_models_log_softmax(tiny_qwen2, api):
    """The real openai client: completions with echo + logprobs (and max_tokens 0: the prompt alone), and chat
    with top_logprobs; every logprob equals the log-softmax computed here with transformers."""
    from transformers import AutoTokenizer

    url, base_name, _ = api
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)

    prompt = "The capital of France is Paris"
    ids = tok(prompt).input_ids
    logp = _log_softmax(tiny_qwen2, ids)
    scored = client.completions.create(model=base_name, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert lp.tokens == [tok.decode([i]) for i in ids] and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(logp[i - 1, ids[i]]), abs=1e-4)
        best = logp[i - 1].topk(3)
        expected = {tok.decode([int(j)]): float(v) for j, v in zip(best.indices, best.values)}
        for text, value in expected.items():
            assert lp.top_logprobs[i][text] == pytest.approx(value, abs=1e-4)
        assert len(lp.top_logprobs[i]) in (3, 4)  # the chosen token is added when it is not among the best

    # token ids as the prompt, one generated token (what lm-eval sends): the prompt part is the same
    again = client.completions.create(model=base_name, prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                      temperature=0)
    lp2 = again.choices[0].logprobs
    assert len(lp2.tokens) == len(ids) + 1 and again.choices[0].text.startswith(prompt)
    assert lp2.tokens[:len(ids)] == lp.tokens and lp2.token_logprobs[0] is None
    assert lp2.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert lp2.token_logprobs[-1] == pytest.approx(float(logp[-1].max()), abs=1e-4)  # greedy: the best token

    # chat: the answer's tokens, each with its top_logprobs (greedy: the chosen token is the best one)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=base_name, messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    prompt_ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False).input_ids
    answer = [int(_log_softmax(tiny_qwen2, prompt_ids)[-1].argmax())]
    while len(answer) < len(content):
        answer.append(int(_log_softmax(tiny_qwen2, prompt_ids + answer)[-1].argmax()))
    assert 1 <= len(content) <= 4
    full = _log_softmax(tiny_qwen2, prompt_ids + answer)
    for k, entry in enumerate(content):
        row = full[len(prompt_ids) - 1 + k]
        assert entry.token == tok.decode([answer[k]]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(row[answer[k]]), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token

    # refusals name the field
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=base_name, prompt=prompt, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=base_name, messages=messages, max_tokens=2, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=base_name, prompt=[[len(tok) + 5]], max_tokens=1)
    assert err.value.body["param"] == "prompt" and "vocabulary" in err.value.body["message"]


def test_bad_tasks_are_one_line_each(tiny_qwen2, tmp_path, monkeypatch):
    from backend.evaluation.benchmarks import BenchmarkError, build_tasks

    with pytest.raises(BenchmarkError, match=r"tasks: hellaswagg: not an lm-eval task name \(did you mean .*hellaswag"):
        build_tasks(["hellaswagg"])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # this test's only: later tests see the session's environment
    with pytest.raises(BenchmarkError, match="tasks: arc_easy: its dataset is on the Hugging Face hub, which cannot "
                                             "be reached here"):
        build_tasks(["arc_easy"])
    bad = tmp_path / "broken.yaml"
    bad.write_text("dataset_path: json\n")
    with pytest.raises(BenchmarkError, match="no `task:` name"):
        build_tasks([str(bad)])

    # through the command: one line, no traceback, nothing written but the run's log and status
    done = tuneboard("eval", f"model_name_or_path={tiny_qwen2}", "tasks=arc_easy", f"output_dir={tmp_path / 'hub'}")
    said = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in said
    assert [line for line in said.splitlines() if "arc_easy: its dataset is on the Hugging Face hub" in line]
    assert not (tmp_path / "hub" / LM_EVAL_FILE).exists()
    assert json.loads((tmp_path / "hub" / "status.json").read_text())["state"] == "failed"


def test_missing_lm_eval_is_one_line_saying_how_to_get_it(tiny_qwen2, tmp_path):
    code = ("import sys; sys.modules['lm_eval'] = None\n"  # lm-eval hidden: import and find_spec fail as if absent
            "from backend.cli import main\n"
            f"sys.exit(main(['eval', 'model_name_or_path={tiny_qwen2}', 'tasks={SHIPPED_TASK}', "
            f"'output_dir={tmp_path / 'out'}']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ENV})
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in said
    assert "tasks: not supported: tasks needs lm-evaluation-harness (the lm-eval package), which is not installed: " \
           "pip install -e '.[lm-eval]' (or make setup)" in said
    assert not (tmp_path / "out").exists()


def test_train_refuses_tasks():
    done = tuneboard("train", "tasks=data/lm_eval_tasks/tuneboard_mc.yaml", timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: tasks: lm-eval benchmarks run in `tuneboard eval`")


def test_tasks_run_alone_other_parts_are_refused():
    from backend.core.spec import SpecError, validate_spec

    for part in ("do_eval", "do_predict", "do_judge"):
        with pytest.raises(SpecError) as err:
            validate_spec({"tasks": str(SHIPPED_TASK), part: True}, check_files=False)
        assert [f for f, m in err.value.errors if f == "tasks" and part in m and "alone" in m]
    assert validate_spec({"tasks": str(SHIPPED_TASK), "limit": 0.5}, check_files=False).limit == 0.5


def test_a_merged_export_is_scored_as_the_tuned_model(tiny_qwen2, tuned, tmp_path):
    """adapter_name_or_path = a merged model folder (what `tuneboard export` writes): the tuned column is that
    model, and scores as the base + adapter does."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = tmp_path / "merged"
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    PeftModel.from_pretrained(base, str(tuned)).merge_and_unload().save_pretrained(merged)
    AutoTokenizer.from_pretrained(tiny_qwen2).save_pretrained(merged)
    results = {}
    for name, adapter in (("adapter", tuned), ("merged", merged)):
        done = tuneboard("eval", f"model_name_or_path={tiny_qwen2}", f"adapter_name_or_path={adapter}",
                         f"tasks={SHIPPED_TASK}", "limit=10", f"output_dir={tmp_path / name}")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        results[name] = json.loads((tmp_path / name / LM_EVAL_FILE).read_text())["rows"]
    assert len(results["merged"]) == 2
    for a, m in zip(results["adapter"], results["merged"]):
        assert (a["metric"], a["n"]) == (m["metric"], m["n"]) == (a["metric"], 10)
        assert m["base"] == pytest.approx(a["base"]) and m["tuned"] == pytest.approx(a["tuned"])


def test_a_task_file_beside_other_yaml_reads_only_itself(tmp_path):
    """lm-eval's include path holds the given task files alone: a TuneBoard run beside the task YAML
    (run_spec.yaml with `task: null`, distill_spec.yaml with a `task:` of its own) is not read as a task (it stopped
    the eval: "'<' not supported between 'NoneType' and 'str'"); data_files and `include:` still resolve from the
    file's own folder; the linked folder goes with the manager."""
    import gc
    import shutil

    from backend.evaluation.benchmarks import build_tasks

    for name in ("tuneboard_mc.jsonl", "tuneboard_mc_fewshot.jsonl"):
        shutil.copy(SHIPPED_TASK.parent / name, tmp_path / name)
    base = SHIPPED_TASK.read_text().replace("task: tuneboard_mc\n", "")
    (tmp_path / "base.yaml").write_text(base)  # no task: of its own, included below
    (tmp_path / "mine.yaml").write_text("include: base.yaml\ntask: my_mc\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_spec.yaml").write_text("model_name_or_path: x\ntask: null\n")
    (tmp_path / "distill_spec.yaml").write_text("task: write questions\n")
    specs, manager = build_tasks([str(tmp_path / "mine.yaml")])
    assert specs[0]["task"] == "my_mc" and "write questions" not in manager.all_tasks
    loaded = manager.load(specs)["tasks"]["my_mc"]
    assert len(loaded.test_docs()) == 30
    folder = Path(manager.include_path)
    assert [p.name for p in folder.iterdir()] == ["0-mine.yaml"]
    del manager, loaded
    gc.collect()
    assert not folder.exists()
