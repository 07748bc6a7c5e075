"""The RL benchmark's short data (bench/run.py --recipe grpo|ppo): the first listing line of each of
bench/make_data.py's 256 rows with its one item as the answer (a JSON list of one object), so a prompt is ~90
tokens and a rollout step fits a few minutes on two cores: extraction_short (alpaca rows: the GRPO and PPO prompts)
and extraction_short_pref (the same rows as pairs, rejected = a price and stock flipped: the reward models'
training data). Written to their own folder, bench/data/rl, with its own dataset_info.json (make_data.main()
rewrites bench/data/dataset_info.json whenever a benchmark starts)."""
from __future__ import annotations

import json
import random

import make_data

FOLDER = make_data.DATA / "rl"


def short_rows() -> list[dict]:
    out = []
    for row in make_data.rows():
        first = json.loads(row["output"])[0]
        out.append(dict(row, input=row["input"].splitlines()[0], output=json.dumps([first])))
    return out


def main() -> None:
    """Write both sets and register them in FOLDER/dataset_info.json."""
    base = short_rows()
    rng = random.Random(4)
    pairs = [{"instruction": r["instruction"], "input": r["input"], "chosen": r["output"],
              "rejected": make_data.wrong(r["output"], rng)} for r in base]
    FOLDER.mkdir(parents=True, exist_ok=True)
    (FOLDER / "extraction_short.json").write_text(json.dumps(base, indent=1), encoding="utf-8")
    (FOLDER / "extraction_short_pref.json").write_text(json.dumps(pairs, indent=1), encoding="utf-8")
    columns = {"prompt": "instruction", "query": "input"}
    info = {"extraction_short": {"file_name": "extraction_short.json", "columns": dict(columns, response="output")},
            "extraction_short_pref": {"file_name": "extraction_short_pref.json", "ranking": True,
                                      "columns": dict(columns, chosen="chosen", rejected="rejected")}}
    (FOLDER / "dataset_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
