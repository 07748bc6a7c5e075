"""The benchmark's data sets: 256 structured-extraction rows of very different lengths (1 to 4 items per
text), written deterministically to bench/data/extraction_bench.json with its dataset_info.json (alpaca
columns, so TuneBoard, TRL and LLaMA-Factory all read the same rows); and for the preference recipes the same 256
listings as pairs (extraction_pref: chosen = the right JSON, rejected = a plausible wrong one: an item dropped, or a
price and stock flipped) and as KTO rows (extraction_kto: every other row's answer wrong, tagged false)."""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"

NAMES = ["Pixel Drawing Tablet", "Aero Desk Lamp", "Nimbus Rain Jacket", "Vertex Hiking Boots", "Lumen Night Light",
         "Orbit Wireless Mouse", "Cascade Water Bottle", "Summit Backpack", "Echo Bluetooth Speaker", "Harbor Coffee Mug",
         "Granite Chef Knife", "Willow Throw Blanket", "Quartz Wall Clock", "Comet Running Shoes", "Atlas Travel Pillow"]
COLORS = ["black", "white", "grey", "red", "blue", "green", "yellow", "navy", "silver", "orange"]


def item(rng: random.Random) -> tuple[str, dict]:
    name = rng.choice(NAMES)
    price = round(rng.uniform(5, 500), 2)
    stock = rng.random() < 0.7
    colors = rng.sample(COLORS, rng.randint(1, 4))
    sku = f"{rng.choice('ABCDEFGH')}{rng.randint(1000, 9999)}"
    text = (f"Product: {name} | Price: ${price} | Availability: {'In stock' if stock else 'Out of stock'} | "
            f"Colors: {', '.join(colors)} | SKU: {sku}")
    return text, {"product_name": name, "price_usd": price, "in_stock": stock, "colors": colors, "sku": sku}


def rows(n: int = 256, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = min(4, int(rng.expovariate(1 / 1.5)) + 1)  # mostly short, a long tail
        items = [item(rng) for _ in range(k)]
        out.append({
            "instruction": "Extract every product in the listing below as a JSON list of objects with the keys: "
                           "product_name, price_usd, in_stock, colors, sku.",
            "input": "\n".join(t for t, _ in items),
            "output": json.dumps([d for _, d in items]),
        })
    return out


def wrong(output: str, rng: random.Random) -> str:
    """A plausible wrong answer to a listing: one item dropped (when there are several), else one item's price
    and stock changed."""
    items = json.loads(output)
    if len(items) > 1 and rng.random() < 0.5:
        items.pop(rng.randrange(len(items)))
    else:
        i = rng.randrange(len(items))
        items[i] = dict(items[i], price_usd=round(items[i]["price_usd"] * 1.1 + 1, 2), in_stock=not items[i]["in_stock"])
    return json.dumps(items)


def preference_rows(base: list[dict], seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"instruction": r["instruction"], "input": r["input"], "chosen": r["output"],
             "rejected": wrong(r["output"], rng)} for r in base]


def kto_rows(base: list[dict], seed: int = 2) -> list[dict]:
    rng = random.Random(seed)
    return [dict(r, output=r["output"] if i % 2 == 0 else wrong(r["output"], rng), label=i % 2 == 0)
            for i, r in enumerate(base)]


QUESTIONS = [("What does the product below cost?", lambda d: f"It costs ${d['price_usd']}."),
             ("Is the product below in stock?", lambda d: "Yes, it is in stock." if d["in_stock"] else "No, it is out of stock."),
             ("Which colors does the product below come in?", lambda d: ", ".join(d["colors"]).capitalize() + "."),
             ("Give the SKU of the product below.", lambda d: d["sku"]),
             ("Extract the product below as a JSON object.", lambda d: json.dumps(d))]


def alpaca_rows(n: int, seed: int = 3):
    """n short alpaca rows (instruction, input, output) about one product listing each, for the preprocessing
    benchmark (bench/preprocess.py): a question, the listing, the answer (a few words to a JSON object)."""
    rng = random.Random(seed)
    for _ in range(n):
        text, fields = item(rng)
        question, answer = rng.choice(QUESTIONS)
        yield {"instruction": question, "input": text, "output": answer(fields)}


def write_alpaca(folder: Path, n: int, name: str = "alpaca_bench") -> Path:
    """alpaca_rows(n) as JSON lines in folder/<name>.jsonl, registered in folder/dataset_info.json."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for row in alpaca_rows(n):
            f.write(json.dumps(row) + "\n")
    info = {name: {"file_name": path.name, "columns": {"prompt": "instruction", "query": "input", "response": "output"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    return path


def main() -> Path:
    DATA.mkdir(exist_ok=True)
    base = rows()
    path = DATA / "extraction_bench.json"
    path.write_text(json.dumps(base, indent=1), encoding="utf-8")
    (DATA / "extraction_pref.json").write_text(json.dumps(preference_rows(base), indent=1), encoding="utf-8")
    (DATA / "extraction_kto.json").write_text(json.dumps(kto_rows(base), indent=1), encoding="utf-8")
    alpaca = {"prompt": "instruction", "query": "input", "response": "output"}
    info = {"extraction_bench": {"file_name": path.name, "columns": alpaca},
            "extraction_pref": {"file_name": "extraction_pref.json", "ranking": True,
                                "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                            "rejected": "rejected"}},
            "extraction_kto": {"file_name": "extraction_kto.json", "columns": dict(alpaca, kto_tag="label")}}
    (DATA / "dataset_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(main())
