"""The benchmark's data set: 256 structured-extraction rows of very different lengths (1 to 4 items per
text), written deterministically to bench/data/extraction_bench.json with its dataset_info.json (alpaca
columns, so TuneBoard, TRL and LLaMA-Factory all read the same rows)."""
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


def main() -> Path:
    DATA.mkdir(exist_ok=True)
    path = DATA / "extraction_bench.json"
    path.write_text(json.dumps(rows(), indent=1), encoding="utf-8")
    info = {"extraction_bench": {"file_name": path.name,
                                 "columns": {"prompt": "instruction", "query": "input", "response": "output"}}}
    (DATA / "dataset_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(main())
