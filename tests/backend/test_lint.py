"""`tuneboard lint`: every problem planted in a small dataset is found, with its rows; a clean dataset gives
nothing; a fix writes a new registered version and leaves the original alone."""
from __future__ import annotations

import json
from pathlib import Path

from backend.core.spec import validate_spec
from backend.dataprep.lint import apply_fixes, lint, main

TOPICS = ["rivers and the sea", "baking bread at home", "the orbit of the moon", "tuning a guitar string",
          "planting tomatoes in spring", "saving money each month", "repairing a bicycle tire", "learning to swim",
          "painting a wooden fence", "reading a train timetable"]


def _row(k: int, answer: str | None = None) -> dict:
    topic = TOPICS[k]
    long = (f"Explain {topic} in plain words for a reader who is new to it; number {k} of the series, with "
            f"an example, a common mistake about {topic}, and one fact people rarely know about it.")
    return {"instruction": long, "input": "", "output": answer if answer is not None else
            json.dumps({"topic": topic, "summary": f"A short note on {topic}.", "id": k})}


def _write(folder: Path, name: str, rows: list[dict], info: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(rows, ensure_ascii=False, indent=1))
    info[name] = {"file_name": f"{name}.json"}


def _data(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    info: dict = {}
    clean = [_row(k) for k in range(8)]
    _write(folder, "clean", clean, info)
    planted = [_row(k) for k in range(8)]
    planted.append(dict(planted[0]))                                              # 8: exact duplicate of 0
    near = dict(planted[1], instruction=planted[1]["instruction"].replace("plain", "simple"))
    planted.append(near)                                                          # 9: near duplicate of 1
    planted.append(_row(2, answer=""))                                            # 10: empty answer
    planted.append(_row(8, answer=json.dumps({"text": " ".join(["word"] * 200)})))  # 11: answer cut by cutoff_len
    planted.append(_row(9, answer='{"topic": "fence", "id": 12'))                 # 12: JSON that does not parse
    planted.append({"instruction": "用简单的话解释月亮绕地球运行的轨道，并举一个例子。", "input": "",
                    "output": json.dumps({"答案": "月亮大约每二十七天绕地球一圈。"}, ensure_ascii=False)})  # 13: Han
    _write(folder, "planted", planted, info)
    _write(folder, "planted_eval", [dict(planted[5])], info)                       # row 5 leaks into eval
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return folder


def _spec(folder: Path, model: Path, **keys):
    return validate_spec(dict(model_name_or_path=str(model), dataset_dir=str(folder), cutoff_len=128, **keys))


def test_lint_finds_each_planted_problem_and_nothing_on_a_clean_set(tiny_llama, tmp_path):
    folder = _data(tmp_path)
    assert lint(_spec(folder, tiny_llama, dataset="clean", template="default", val_size=2)).findings == []

    report = lint(_spec(folder, tiny_llama, dataset="planted", eval_dataset="planted_eval", template="llama3"))
    found = {f.check: f for f in report.findings}
    assert {c: f.rows for c, f in found.items() if f.rows} == {
        "duplicates": [8], "near_duplicates": [9], "empty_answer": [10], "cut_answers": [11], "bad_json": [12],
        "mixed_languages": [13], "eval_in_train": [5]}, [f.line() for f in report.findings]
    assert "a base model" in found["template"].message and found["template"].severity == "warning"
    assert "of 13 rows" in found["cut_answers"].message and "cutoff_len=128" in found["cut_answers"].message
    assert report.to_dict()["count"] == len(found) == 8

    # val_size: a row of the held-out split that is also in the training rows is a leak too
    # (seed 2 holds out rows 0, 1, 5, 12: the copies 8 and 9 stay in train)
    report = lint(_spec(folder, tiny_llama, dataset="planted", template="llama3", val_size=4, seed=2))
    leak = [f.rows for f in report.findings if f.check == "eval_in_train"]
    assert leak == [[8, 9]], [f.line() for f in report.findings]


def test_fix_writes_a_new_registered_version(tiny_llama, tmp_path):
    folder = _data(tmp_path)
    original = (folder / "planted.json").read_text()
    spec = _spec(folder, tiny_llama, dataset="planted", eval_dataset="planted_eval", template="llama3")
    lines = apply_fixes(spec, lint(spec), ["drop_duplicates", "drop_leaks", "drop_empty"])
    assert (folder / "planted.json").read_text() == original
    info = json.loads((folder / "dataset_info.json").read_text())
    assert info["planted_v2"] == {"file_name": "planted_v2.json"} and "planted_v2" in lines[0]
    kept = json.loads((folder / "planted_v2.json").read_text())
    assert len(kept) == 14 - 4 and kept[5] == json.loads(original)[6]  # rows 5, 8, 9, 10 dropped
    again = lint(_spec(folder, tiny_llama, dataset="planted_v2", eval_dataset="planted_eval", template="llama3"))
    assert not {"duplicates", "near_duplicates", "eval_in_train", "empty_answer"} & {f.check for f in again.findings}


def test_lint_command_json_and_bad_input(tiny_llama, tmp_path, capsys):
    folder = _data(tmp_path)
    args = [f"model_name_or_path={tiny_llama}", f"dataset_dir={folder}", "template=default", "cutoff_len=128"]
    assert main(args + ["dataset=clean", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"datasets": {"clean": 8}, "count": 0,
                                                                    "findings": [], "fixed": []}
    assert main(args + ["dataset=planted"]) == 1  # errors found: exit 1, one line each and the count
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "6 findings in planted (14 rows): 2 errors, 3 warnings, 1 info", out
    (folder / "planted.json").unlink()
    assert main(args + ["dataset=planted"]) == 1
    err = capsys.readouterr().err
    assert f"dataset 'planted': file not found: {folder / 'planted.json'}" in err and "Traceback" not in err, err


def test_pretraining_documents_and_the_eos_token(tiny_llama, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    docs = [{"text": f"Document {k} is about {TOPICS[k]}, written plainly for a reader new to it."} for k in range(4)]
    docs[2]["text"] += "<|eot_id|>"  # tiny_llama's EOS written into the text: TuneBoard adds one more
    (folder / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    (folder / "dataset_info.json").write_text(json.dumps({"docs": {"file_name": "docs.jsonl",
                                                                   "columns": {"prompt": "text"}}}))
    found = lint(_spec(folder, tiny_llama, dataset="docs", stage="pt")).findings
    assert [(f.check, f.severity, f.rows) for f in found] == [("pt_eos", "info", [2])], [f.line() for f in found]


def test_max_rows_lints_the_first_rows_only(tiny_llama, tmp_path, capsys):
    """The Train tab's pre-flight lints the first rows of a big set (webui/data_check.py): row 8 repeats row 0, row 9
    is a near copy of row 1; with --max-rows 9 only the first is among the rows read."""
    folder = _data(tmp_path)
    args = [f"model_name_or_path={tiny_llama}", f"dataset_dir={folder}", "template=default", "cutoff_len=128",
            "dataset=planted"]
    main(args + ["--json", "--max-rows", "9"])
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["datasets"] == {"planted": 9} and out["max_rows"] == 9, out
    assert {f["check"]: f["rows"] for f in out["findings"]} == {"duplicates": [8]}, out
    assert main(args + ["--max-rows", "0"]) == 1 and main(args + ["--max-rows", "5", "--fix", "drop_empty"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --max-rows: 0 is not a positive number of rows",
                   "error: --max-rows: a fix rewrites the whole dataset: drop --max-rows to fix"], err


def test_finding_rows_are_the_rows_the_preview_opens(tiny_llama, tmp_path, capsys):
    """A finding names rows by the file's own row numbers, the numbers `tuneboard preview --index` (the Data tab's Row
    field) opens, also after a row the loader skips (which shifted the preview's rows by one: row 5 was out of range),
    in a JSON list, a JSONL file and a CSV file (saved with a byte order mark, as Excel does); the skipped row opens as
    the reason training skips it, with its number."""
    from backend.dataprep import preview

    rows = [{"instruction": _row(k)["instruction"], "output": f"A plain answer about {TOPICS[k]}."} for k in range(4)]
    rows.insert(1, {"instruction": _row(4)["instruction"], "output": ""})  # 1: skipped (empty answer)
    rows.append(dict(rows[3]))                                                # 5: repeats row 3
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "s.json").write_text(json.dumps(rows))
    (folder / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = ["instruction,output"] + [f'"{r["instruction"]}",{r["output"]}' for r in rows]
    (folder / "s.csv").write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({n: {"file_name": f"s.{n}"} for n in ("json", "jsonl", "csv")}))
    for name in ("json", "jsonl", "csv"):
        report = lint(_spec(folder, tiny_llama, dataset=name, template="default"))
        found = {f.check: f.rows for f in report.findings if f.rows}
        skipped = "unusable_row" if name == "csv" else "empty_answer"  # a CSV's empty cell is read as missing
        assert found == {skipped: [1], "duplicates": [5]}, (name, [f.line() for f in report.findings])
        args = ["--dataset", name, "--dataset-dir", str(folder), "--model", str(tiny_llama), "--template", "default",
                "--json", "--index"]
        assert preview.main(args + ["5"]) == 0
        shown = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert shown["row"] == 5 and rows[5]["instruction"] in shown["text"], (name, shown)
        assert preview.main(args + ["1"]) == 1
        shown = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert shown["row"] == 1 and shown["error"].startswith(f"dataset '{name}': training skips row 1 of s.{name}: "), \
            (name, shown)


def test_a_folders_rows_are_numbered_on_across_its_files(tiny_llama, tmp_path):
    """A dataset of a folder: the rows of its second file follow those of the first (as data.dataset_row and a stream
    number them); each file counted from 0 gave two rows the number 0."""
    from backend.dataprep.data import dataset_row

    rows = [{"instruction": _row(k)["instruction"], "output": f"A plain answer about {TOPICS[k]}."} for k in range(3)]
    folder = tmp_path / "data"
    (folder / "parts").mkdir(parents=True)
    (folder / "parts" / "a.json").write_text(json.dumps(rows[:2]))
    (folder / "parts" / "b.json").write_text(json.dumps([rows[2], dict(rows[0])]))  # the set's row 3 repeats row 0
    (folder / "dataset_info.json").write_text(json.dumps({"parts": {"file_name": "parts"}}))
    report = lint(_spec(folder, tiny_llama, dataset="parts", template="default"))
    assert [(f.check, f.rows) for f in report.findings] == [("duplicates", [3])], [f.line() for f in report.findings]
    assert dataset_row("parts", 3, folder)["messages"] == dataset_row("parts", 0, folder)["messages"]
