"""`tuneboard eval SPEC do_judge=true` end to end: a tiny model + a LoRA adapter answer three held-out rows in a
subprocess, the stand-in judge (tests/fake_teacher.py, judge_word: prefers the answer that says "good")
compares them in both orders; judge_results.json, the cache, a refused key, a spent budget, the key never
written."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from backend.core.paths import REPO_ROOT
from backend.core.rundir import EVAL_RESULTS_FILE, JUDGE_CACHE_DIRNAME, JUDGE_FILE, PREDICTIONS_FILE, STATUS_FILE
from fake_teacher import KEY, FakeTeacher, no_key_under

ROWS = [{"instruction": "Say something nice.", "output": "A good day to you."},
        {"instruction": "How is the weather?", "output": "Sunny and good."},
        {"instruction": "Name a colour.", "output": "Blue is a good colour."}]


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """(data folder, adapter folder): three rows whose answers say "good"; a LoRA adapter with random weights
    on both factors (so the tuned model answers otherwise than the base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("judge_eval")
    (root / "rows.json").write_text(json.dumps(ROWS))
    (root / "dataset_info.json").write_text(json.dumps({"judged": {"file_name": "rows.json"}}))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"],
                                                  init_lora_weights=False, task_type="CAUSAL_LM"))
    peft_model.save_pretrained(root / "adapter")
    return root, root / "adapter"


@pytest.fixture
def judge():
    server = FakeTeacher(mode="judge_word", key=KEY).start()
    yield server
    server.stop()


def tuneboard_eval(tiny_llama, data, out, *extra, key=KEY):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TUNEBOARD_TEACHER")}
    env["JUDGE_TEST_KEY"] = key
    proc = subprocess.run([sys.executable, "-m", "backend.cli", "eval", f"model_name_or_path={tiny_llama}",
                           "template=llama3", f"dataset_dir={data}", "dataset=judged", "eval_dataset=judged", f"output_dir={out}",
                           "do_judge=true", "max_new_tokens=4", "judge_model=judge-model",
                           "judge_api_key_env=JUDGE_TEST_KEY", *extra],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    return proc, proc.stdout + proc.stderr


def test_eval_judges_tuned_against_base_then_answers_from_the_cache(tiny_llama, setup, judge, tmp_path):
    data, adapter = setup
    out = tmp_path / "eval"
    proc, output = tuneboard_eval(tiny_llama, data, out, f"judge_url={judge.url}", f"adapter_name_or_path={adapter}")
    assert proc.returncode == 0, output
    report = json.loads((out / JUDGE_FILE).read_text())
    assert report["rows"] == report["judged"] == 3 and report["complete"] and report["against"] == "base"
    assert report["wins"] + report["ties"] + report["losses"] == 3
    assert all(r["a"] != r["b"] for r in report["per_row"])  # the adapter changed the answers
    # each pair was asked in both orders: the endpoint saw (tuned, base) and (base, tuned)
    seen = set()
    for r in judge.requests:
        text = r["body"]["messages"][-1]["content"]
        seen.add((re.search(r"<answer_a>\n(.*?)\n</answer_a>", text, re.S).group(1),
                  re.search(r"<answer_b>\n(.*?)\n</answer_b>", text, re.S).group(1)))
    assert seen == {(r["a"], r["b"]) for r in report["per_row"]} | {(r["b"], r["a"]) for r in report["per_row"]}
    assert len(judge.requests) == report["requests"] == 6
    results = json.loads((out / EVAL_RESULTS_FILE).read_text())
    assert results["judge_wins"] == report["wins"] and results["judge_win_rate"] == report["win_rate"]
    assert "judge: " in output and "win rate" in output
    no_key_under(out)
    assert KEY not in output

    # the same spec again (overwrite_output_dir): every request answered from judge_cache/, none asked
    proc, output = tuneboard_eval(tiny_llama, data, out, f"judge_url={judge.url}", f"adapter_name_or_path={adapter}",
                                  "overwrite_output_dir=true")
    assert proc.returncode == 0, output
    again = json.loads((out / JUDGE_FILE).read_text())
    assert len(judge.requests) == 6 and again["requests"] == 0 and again["cached"] == 6
    assert [r["verdict"] for r in again["per_row"]] == [r["verdict"] for r in report["per_row"]]
    assert len(list((out / JUDGE_CACHE_DIRNAME).glob("*.json"))) == 6


def test_refused_key_and_spent_budget(tiny_llama, setup, judge, tmp_path):
    data, _ = setup
    # a key the endpoint refuses: one clear line, exit 1, the answers kept in judge_results.json
    out = tmp_path / "refused"
    proc, output = tuneboard_eval(tiny_llama, data, out, f"judge_url={judge.url}", "judge_against=reference",
                                  key="sk-wrong-0123456789")
    assert proc.returncode == 1, output
    assert "Traceback" not in output
    failed = [line for line in output.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "HTTP 401" in failed[0] and "API key was refused" in failed[0]
    status = json.loads((out / STATUS_FILE).read_text())
    assert status["state"] == "failed" and "HTTP 401" in status["error"]
    report = json.loads((out / JUDGE_FILE).read_text())
    assert report["judged"] == 0 and [r["a"] for r in report["per_row"]] and report["error"]
    no_key_under(out, key="sk-wrong-0123456789")
    assert "sk-wrong-0123456789" not in output

    # judge_max_requests 3: one whole row judged (the reference says "good", the tuned answer does not: a loss),
    # the report and the status say the rest was not. Which row is judged first is a race (the judge asks 4 at a
    # time), so every reference says "good" in lower case (the stand-in's word; "Good and sunny." was a tie)
    judge.requests.clear()
    out = tmp_path / "budget"
    proc, output = tuneboard_eval(tiny_llama, data, out, f"judge_url={judge.url}", "judge_against=reference",
                                  "judge_max_requests=3", "do_predict=true")
    assert proc.returncode == 0, output
    assert len(judge.requests) == 2
    report = json.loads((out / JUDGE_FILE).read_text())
    assert report["requests"] == 2 and report["judged"] == 1 and not report["complete"]
    assert "judge_max_requests 3 spent" in report["stopped"]
    judged = [r for r in report["per_row"] if r["verdict"] != "not judged"]
    assert report["losses"] == 1 and judged[0]["b"] == ROWS[judged[0]["index"]]["output"]
    # with do_predict the judge compared the predict part's answers (not generated twice)
    predicted = [json.loads(line) for line in (out / PREDICTIONS_FILE).read_text().splitlines()]
    assert [r["a"] for r in report["per_row"]] == [p["predict"] for p in predicted]
    assert "the tuned answers are the 3 predictions" in output
    results = json.loads((out / EVAL_RESULTS_FILE).read_text())
    assert "judge_max_requests 3 spent" in results["judge_incomplete"]
    status = json.loads((out / STATUS_FILE).read_text())
    assert status["state"] == "completed" and any("incomplete" in w for w in status["warnings"])


def test_a_judge_without_verdicts_fails_the_eval(tiny_llama, setup, judge, tmp_path):
    """Every reply without a verdict line: no win rate (not 0.500 from ties), one FAILED line, exit 1; the answers
    and the judge's replies are kept in judge_results.json."""
    data, _ = setup
    judge.mode = "judge_unparsed"
    out = tmp_path / "unparsed"
    proc, output = tuneboard_eval(tiny_llama, data, out, f"judge_url={judge.url}", "judge_against=reference")
    assert proc.returncode == 1, output
    failed = [line for line in output.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "no win rate" in failed[0] and "verdict in 0 of its 6 replies" in failed[0], output
    assert "0.500" not in output and "Traceback" not in output
    assert json.loads((out / STATUS_FILE).read_text())["state"] == "failed"
    assert "judge_win_rate" not in json.loads((out / EVAL_RESULTS_FILE).read_text())
    report = json.loads((out / JUDGE_FILE).read_text())
    assert report["win_rate"] is None and report["unparsed"] == 6 and len(report["per_row"]) == 3
