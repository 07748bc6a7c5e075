"""The `tuneboard` command line, run as a real subprocess from a directory outside the repo."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tb(*args: str, cwd: str = "/tmp", timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=None)


def test_validate_prints_ok_and_resolved_spec():
    proc = tb("validate", str(REPO / "examples" / "sft_lora_identity.yaml"), "lora_rank=16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok\n")
    assert "lora_rank: 16" in proc.stdout and "dataset: identity" in proc.stdout


def test_validate_reports_every_error_and_exits_1(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("lora_alpah: 16\nlora_rank: 0\nstage: sfft\n")
    proc = tb("validate", str(spec))
    assert proc.returncode == 1
    assert "did you mean 'lora_alpha'" in proc.stderr
    assert "lora_rank" in proc.stderr and ">= 1" in proc.stderr
    assert "stage" in proc.stderr and "sft" in proc.stderr


def test_train_refuses_a_bad_spec_before_loading_anything(tmp_path):
    proc = tb("train", f"output_dir={tmp_path / 'x'}", "quantization_bit=4", "finetuning_type=full")
    assert proc.returncode == 1
    assert "quantization_bit" in proc.stderr and "lora" in proc.stderr
    assert not (tmp_path / "x").exists()  # nothing launched, nothing written


def test_unknown_command_suggests():
    proc = tb("trian")
    assert proc.returncode == 2 and "did you mean 'train'" in proc.stderr


def test_preview_json_has_text_segments_and_labels():
    proc = tb("preview", "--dataset", "identity", "--index", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["text"] == "".join(s["text"] for s in row["segments"])
    trained = "".join(s["text"] for s in row["segments"] if s["trained"])
    assert trained.endswith("<|im_end|>") and "TuneBoard Assistant" in trained
    assert len(row["input_ids"]) == len(row["labels"]) == len(row["tokens"]) == row["num_tokens"]
    # labels are the ids exactly where trained, -100 elsewhere; the stop token (== pad) is trained
    trained_tokens = "".join(t for t, l in zip(row["tokens"], row["labels"]) if l != -100)
    assert trained_tokens.endswith("<|im_end|>")
    assert row["labels"].count(-100) > 0 and row["num_trained"] > 0


def test_preview_messages_file_with_named_template(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(messages))
    proc = tb("preview", "--messages", str(path), "--template", "llama3", "--json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["text"].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert "".join(s["text"] for s in row["segments"] if s["trained"]) == "Hello!<|eot_id|>"


def test_preview_human_output_colours_trained_spans():
    proc = tb("preview", "--dataset", "identity")
    assert proc.returncode == 0, proc.stderr
    assert "\033[32m" in proc.stdout and "trained" in proc.stdout


def test_preview_bad_index_names_the_range():
    proc = tb("preview", "--dataset", "identity", "--index", "999")
    assert proc.returncode == 1 and "out of range" in proc.stderr and "40 rows" in proc.stderr


def test_preview_unknown_dataset_names_it():
    proc = tb("preview", "--dataset", "identiti", "--json")
    assert proc.returncode == 1
    error = json.loads(proc.stdout)["error"]
    assert "identiti" in error and "identity" in error


def test_a_reader_that_closes_stdout_ends_the_command_quietly():
    """`tuneboard validate spec | head -1` ended in a BrokenPipeError traceback: stdout is a pipe whose reader is
    gone before the command writes (closed before it starts, so no race), for a command printing much and one
    printing little; each ends with exit code 1 and nothing on stderr."""
    import os

    for args in (["validate", "examples/sft_lora_identity.yaml"], ["fields"]):
        read, write = os.pipe()
        os.close(read)
        try:
            done = subprocess.run([sys.executable, "-m", "backend.cli", *args], cwd=REPO, stdout=write,
                                  stderr=subprocess.PIPE, text=True, timeout=300)
        finally:
            os.close(write)
        assert (done.returncode, done.stderr) == (1, ""), args
