"""The bad-input catalogue (issue 9): what a careless user feeds TuneBoard, one case each, and the one clear
line it must get back, naming the field, file or row, with no traceback.

- VALIDATE: `tuneboard validate` (the CLI's own main, in this process: fast) on a spec or key=value
  overrides; exit code 1, the header line, then `<field>: <message>` lines. A few go through the real
  command in its own process too (test_the_real_command_says_the_same).
- DATA: backend.dataprep.data.load_examples, what training, preview and the Data tab call: a DatasetError naming the
  dataset and file, or a skipped row named in the data report; the other datasets stay usable.
- PREPROCESS: rows longer than cutoff_len are named in the warning; a row left with nothing to train is named.
- COMMAND: `tuneboard api` on a port in use says so and exits, before loading anything.

Files are made per case in tmp_path; `{d}` in an argument is that folder. No model is loaded, nothing trains.
"""
from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys

import pytest

from backend.cli import main as tuneboard
from backend.dataprep.data import DatasetError, load_examples
from backend.core.paths import REPO_ROOT

SECRET = "hf_SeCrEt_do_not_print_42"


def safetensors(data_bytes: int, declared: int) -> bytes:
    """A safetensors file whose header declares `declared` bytes of tensor data and that holds `data_bytes`."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [declared // 4], "data_offsets": [0, declared]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * data_bytes


INFO = {"good": {"file_name": "good.json"}, "pairs": {"file_name": "pairs.json", "ranking": True}}
GOOD = [{"instruction": "hi", "output": "hello"}]
PAIRS = [{"instruction": "hi", "chosen": "hello", "rejected": "go away"}]
MODEL_FILES = {"model/config.json": "{}", "model/model.safetensors": safetensors(16, 16)}


def data_files(info: dict | str | bytes, **files) -> dict:
    """A dataset folder `data/` with dataset_info.json (`info`) and the good and pairs datasets."""
    out = {"data/dataset_info.json": info if isinstance(info, (str, bytes)) else json.dumps(info),
           "data/good.json": json.dumps(GOOD), "data/pairs.json": json.dumps(PAIRS)}
    out.update({f"data/{k.replace('__', '.')}": v for k, v in files.items()})
    return out


# (id, files, args, field, words): `field` is the line's field (a spec path for file-level problems)
VALIDATE = [
    ("yaml-list", {"s.yaml": "- stage\n- sft\n"}, ["{d}/s.yaml"], "{d}/s.yaml",
     ["top level must be a mapping", "got a list"]),
    ("yaml-scalar", {"s.yaml": "just some text\n"}, ["{d}/s.yaml"], "{d}/s.yaml", ["top level must be a mapping"]),
    ("yaml-syntax", {"s.yaml": "stage: sft\nlora_rank: [1\n"}, ["{d}/s.yaml"], "{d}/s.yaml",
     ["YAML syntax error at line 3"]),
    ("yaml-not-utf8", {"s.yaml": b"stage: sft\ndataset: caf\xe9\n"}, ["{d}/s.yaml"], "{d}/s.yaml",
     ["cannot read", "utf-8"]),
    ("spec-missing", {}, ["{d}/nowhere.yaml"], "{d}/nowhere.yaml", ["spec file not found"]),
    ("yaml-duplicate-key", {"s.yaml": "stage: sft\nlora_rank: 4\nstage: dpo\n"}, ["{d}/s.yaml"], "stage",
     ["duplicate key", "lines 1 and 3"]),
    ("unknown-key-override", {}, ["lorarank=4"], "lorarank", ["unknown key", "did you mean 'lora_rank'"]),
    ("unknown-key-yaml", {"s.yaml": "learning_rat: 0.1\n"}, ["{d}/s.yaml"], "learning_rat",
     ["did you mean 'learning_rate'"]),
    ("not-a-number", {}, ["learning_rate=abc"], "learning_rate", ["must be a number", "'abc'"]),
    ("not-an-integer", {}, ["lora_rank=1.5"], "lora_rank", ["integer", "1.5"]),
    ("not-a-boolean", {}, ["packing=maybe"], "packing", ["true or false", "'maybe'"]),
    ("list-for-a-number", {"s.yaml": "num_train_epochs: [1, 2]\n"}, ["{d}/s.yaml"], "num_train_epochs",
     ["must be a number"]),
    ("below-range", {}, ["lora_rank=0"], "lora_rank", [">= 1", "got 0"]),
    ("negative-length", {}, ["cutoff_len=-5"], "cutoff_len", ["got -5"]),
    ("unknown-choice", {}, ["stage=finetune"], "stage", ["must be one of", "sft", "'finetune'"]),
    ("seed-1e23", {}, ["seed=1e23"], "seed", ["between 0 and 4294967295", "1e23"]),
    ("seed-negative", {}, ["seed=-1"], "seed", ["between 0 and 4294967295"]),
    ("passthrough-wrong-type", {}, ["logging_first_step=perhaps"], "logging_first_step", ["perhaps"]),
    ("qlora-on-full", {}, ["quantization_bit=4", "finetuning_type=full"], "quantization_bit",
     ["needs finetuning_type lora"]),
    ("adapter-on-freeze", {"ad/adapter_config.json": "{}"}, ["adapter_name_or_path={d}/ad", "finetuning_type=freeze"],
     "adapter_name_or_path", ["need finetuning_type lora"]),
    ("preference-stage-sft-data", {}, ["stage=dpo", "dataset=identity"], "dataset",
     ["needs a ranking dataset", "'identity'"]),
    ("kto-without-tags", {}, ["stage=kto", "dataset=identity"], "dataset", ["kto_tag", "'identity'"]),
    ("sft-on-ranking-data", {}, ["dataset=dpo_en_demo"], "dataset", ["is a ranking dataset", "stage sft"]),
    ("secret-hub-token", {}, [f"hub_token={SECRET}"], "hub_token", ["a secret is never a spec key", "HF_TOKEN"]),
    ("secret-in-yaml", {"s.yaml": f"wandb_api_key: {SECRET}\n"}, ["{d}/s.yaml"], "wandb_api_key",
     ["a secret is never a spec key"]),
    ("dataset-registered-twice",
     data_files('{"good": {"file_name": "good.json"},\n "dup": {"file_name": "good.json"},\n'
                ' "dup": {"file_name": "pairs.json"}}'),
     ["dataset_dir={d}/data", "dataset=dup"], "dataset",
     ["dataset 'dup' is registered twice", "'good.json'", "'pairs.json'"]),
    ("bad-dataset-entry", data_files({**INFO, "typo": {"file_name": "good.json", "colums": {}}}),
     ["dataset_dir={d}/data", "dataset=typo"], "dataset", ["dataset 'typo'", "unknown key 'colums'", "did you mean"]),
    ("unknown-dataset", data_files(INFO), ["dataset_dir={d}/data", "dataset=goood"], "dataset",
     ["'goood' is not in", "did you mean good"]),
    ("dataset-info-not-json", data_files('{"good": {"file_name": "good.json"},}'),
     ["dataset_dir={d}/data", "dataset=good"], "dataset", ["malformed", "dataset_info.json", "line 1"]),
    ("dataset-info-a-list", data_files("[1, 2]"), ["dataset_dir={d}/data", "dataset=good"], "dataset",
     ["top level must be an object"]),
    ("dataset-info-not-utf8", data_files(b'{"caf\xe9": {"file_name": "good.json"}}'),
     ["dataset_dir={d}/data", "dataset=good"], "dataset", ["cannot read", "dataset_info.json"]),
    ("dataset-file-missing", data_files({**INFO, "gone": {"file_name": "gone.jsonl"}}),
     ["dataset_dir={d}/data", "dataset=gone"], "dataset", ["file not found", "gone.jsonl"]),
    ("truncated-safetensors", {**MODEL_FILES, "model/model.safetensors": safetensors(100, 4096)},
     ["model_name_or_path={d}/model"], "model_name_or_path", ["model.safetensors is truncated", "175 bytes, its header describes 4171"]),
    ("safetensors-not-safetensors", {**MODEL_FILES, "model/model.safetensors": b"<html>404 Not Found</html>"},
     ["model_name_or_path={d}/model"], "model_name_or_path", ["model.safetensors", "not a safetensors file"]),
    ("corrupt-gguf", {"m.gguf": b"\0" * 64}, ["model_name_or_path={d}/m.gguf"], "model_name_or_path",
     ["m.gguf is not a GGUF file"]),
    ("truncated-adapter", {**MODEL_FILES, "ad/adapter_config.json": "{}",
                           "ad/adapter_model.safetensors": safetensors(8, 800)},
     ["model_name_or_path={d}/model", "adapter_name_or_path={d}/ad"], "adapter_name_or_path",
     ["adapter_model.safetensors is truncated"]),
    ("model-path-missing", {}, ["model_name_or_path={d}/no-model"], "model_name_or_path", ["does not exist"]),
    ("output-dir-a-file", {"f": "x"}, ["output_dir={d}/f"], "output_dir", ["is a file, not a folder"]),
    ("template-a-path", {}, ["template=../../etc/x"], "template", ["is not a template name"]),
]


def make_files(root, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize("case", VALIDATE, ids=[c[0] for c in VALIDATE])
def test_validate_refuses_with_one_clear_line(case, tmp_path, capsys):
    _, files, args, field, words = case
    make_files(tmp_path, files)
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    code = tuneboard(["validate", *args])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 1, err + captured.out
    assert err.startswith("error: invalid run spec") and "Traceback" not in err + captured.out, err
    lines = dict(line.strip().split(": ", 1) for line in err.splitlines()[1:])
    field = field.replace("{d}", str(tmp_path))
    assert field in lines, err
    assert all(w.replace("{d}", str(tmp_path)) in lines[field] for w in words), err
    assert SECRET not in err + captured.out  # a refused secret is never echoed


def test_a_cut_short_gguf_is_refused_at_validate(tmp_path, capsys):
    """Issue 25, item 6: the first 2 MB of the real default model (98 MB) passed validate, which read only its
    magic. Now the header is walked and the tensor data measured against the file; the whole file passes."""
    from backend.core.paths import default_model_file

    whole = default_model_file()
    for size, words in ((2_000_000, ["is truncated", "2000000 bytes, its header describes", str(whole.stat().st_size)]),
                        (100, ["is not a whole GGUF file", "ends inside its header"])):
        cut = tmp_path / f"cut-{size}.gguf"
        with whole.open("rb") as src:
            cut.write_bytes(src.read(size))
        assert tuneboard(["validate", f"model_name_or_path={cut}"]) == 1
        err = capsys.readouterr().err
        line = next(line for line in err.splitlines() if line.strip().startswith("model_name_or_path:"))
        assert all(w in line for w in words) and "Traceback" not in err, err
    assert tuneboard(["validate", f"model_name_or_path={whole}"]) == 0, capsys.readouterr().err


def test_a_bad_dataset_entry_does_not_block_the_others(tmp_path, capsys):
    make_files(tmp_path, data_files('{"good": {"file_name": "good.json"},\n "dup": {"file_name": "good.json"},\n'
                                    ' "dup": {"file_name": "pairs.json"}, "typo": {"file_name": "a", "colums": {}}}'))
    assert tuneboard(["validate", f"dataset_dir={tmp_path}/data", "dataset=good"]) == 0
    examples, _ = load_examples("good", tmp_path / "data")
    assert len(examples) == 1


# ------------------------------------------------------------------ data files (load_examples)

def _rows(n: int = 2) -> str:
    return "".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(n))


# (id, entry, files, words of the DatasetError or of the report's skipped-row lines)
DATA = [
    ("empty-jsonl", {"file_name": "t.jsonl"}, {"t.jsonl": ""}, ["t.jsonl has no rows"]),
    ("blank-lines-jsonl", {"file_name": "t.jsonl"}, {"t.jsonl": "\n\n  \n"}, ["t.jsonl has no rows"]),
    ("empty-json-list", {"file_name": "t.json"}, {"t.json": "[ ]\n"}, ["t.json has no rows"]),
    ("broken-jsonl-line-in-the-middle", {"file_name": "t.jsonl"},
     {"t.jsonl": _rows(2) + '{"instruction": "x" "output": "y"}\n' + _rows(2)}, ["t.jsonl: not valid JSON at line 3"]),
    ("data-not-utf8", {"file_name": "t.json"}, {"t.json": b'[{"instruction": "caf\xe9", "output": "b"}]'},
     ["t.json: not UTF-8 text"]),
    ("binary-upload", {"file_name": "t.jsonl"}, {"t.jsonl": bytes(range(256)) * 8}, ["t.jsonl: not UTF-8 text"]),
    ("numbers-for-text", {"file_name": "t.json"},
     {"t.json": json.dumps([{"instruction": "a", "output": 42}, {"instruction": "b", "output": 1e23}])},
     ["t.json", "row 0: column 'output' must be text, got the number 42", "row 1: column 'output'"]),
    ("number-in-a-conversation", {"file_name": "t.json", "formatting": "sharegpt"},
     {"t.json": json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 7}]}])},
     ["row 0: turn 1: 'value' must be text, got the number 7"]),
    ("list-for-text", {"file_name": "t.json"}, {"t.json": json.dumps([{"instruction": ["a"], "output": "b"}])},
     ["row 0: column 'instruction' must be text, got list"]),
    ("csv-missing-column", {"file_name": "t.csv"}, {"t.csv": "question,answer\nq,a\n"},
     ["t.csv has no column 'instruction'", "its columns are: answer, question"]),
    ("unsupported-file-type", {"file_name": "t.xlsx"}, {"t.xlsx": b"PK\3\4"}, ["unsupported file type '.xlsx'"]),
    ("data-is-a-folder-without-data", {"file_name": "sub"}, {"sub/readme.md": "x"}, ["has no data files"]),
]


@pytest.mark.parametrize("case", DATA, ids=[c[0] for c in DATA])
def test_bad_data_files_name_the_file_and_row(case, tmp_path):
    _, entry, files, words = case
    make_files(tmp_path, {"dataset_info.json": json.dumps({"t": entry, "good": {"file_name": "good.json"}}),
                          "good.json": json.dumps(GOOD), **files})
    with pytest.raises(DatasetError) as err:
        load_examples("t", tmp_path)
    message = str(err.value)
    assert message.startswith("dataset 't'") and "Traceback" not in message, message
    assert all(w in message for w in words), message
    assert load_examples("good", tmp_path)[0]  # the other dataset of the folder still loads


def test_one_bad_row_is_skipped_and_named_the_rest_train(tmp_path):
    rows = [{"instruction": "a", "output": "fine"}, {"instruction": "b", "output": 3.5},
            {"instruction": "c", "output": "also fine"}]
    make_files(tmp_path, {"dataset_info.json": json.dumps({"t": {"file_name": "t.json"}}), "t.json": json.dumps(rows)})
    examples, report = load_examples("t", tmp_path)
    assert [e["_row"] for e in examples] == [0, 2]
    assert report.summary_lines()[1] == ("  skipped row 1: column 'output' must be text, got the number 3.5 "
                                         "(write it as a JSON string, in quotes)")


# ------------------------------------------------------------------ rows longer than cutoff_len

def test_rows_longer_than_cutoff_len_are_named(default_model_dir):
    from transformers import AutoTokenizer

    from backend.dataprep.preprocess import build_sft_dataset
    from backend.dataprep.templates import get_template

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    template = get_template("smollm2", tokenizer)
    long_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 300}],
                   "_source": "mine", "_row": 1}
    long_prompt = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "a"}],
                   "_source": "mine", "_row": 2}
    short = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
             "_source": "mine", "_row": 0}
    said = []
    rows, stats = build_sft_dataset([short, long_answer, long_prompt], template, tokenizer, 64, log=said.append)
    assert len(rows) == 3 and all(len(r["input_ids"]) <= 64 for r in rows)
    assert said == ["2 rows truncated to cutoff_len=64: mine row 1, mine row 2"], said


# ------------------------------------------------------------------ commands

def test_api_on_a_port_in_use_says_so_before_loading_anything():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "backend.cli", "api", "--port", str(port)], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use", proc.stderr


def test_the_real_command_says_the_same(tmp_path):
    """Three of the cases through `python -m backend.cli validate` in its own process (what a user runs)."""
    for case_id in ("yaml-list", "secret-hub-token", "truncated-safetensors"):
        _, files, args, field, words = next(c for c in VALIDATE if c[0] == case_id)
        folder = tmp_path / case_id
        make_files(folder, files)
        argv = [a.replace("{d}", str(folder)) for a in args]
        proc = subprocess.run([sys.executable, "-m", "backend.cli", "validate", *argv], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        line = next(li for li in proc.stderr.splitlines() if li.strip().startswith(field.replace("{d}", str(folder))))
        assert all(w in line for w in words) and SECRET not in proc.stderr + proc.stdout, proc.stderr


def test_the_catalogue_holds_at_least_40_cases():
    assert len(VALIDATE) + len(DATA) + 3 >= 40  # + one bad row, rows over cutoff_len, port in use
