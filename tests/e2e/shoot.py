"""Screenshots of every tab at two window sizes, for looking at the layout (not a test):
`.venv/bin/python tests/e2e/shoot.py [OUT_DIR]` serves the app on a throwaway saves folder holding two
finished runs and a finished eval (made-up files, no training), opens it in Debian's Chromium and writes
<tab>-<width>x<height>.png (full page) into OUT_DIR (default test-artifacts/shots), then the Train tab in
Chinese with its accordions open (train-zh-*.png: the translated field help texts). `--zh-only`: only those."""
import json
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

SAVES = Path(tempfile.mkdtemp(prefix="tb-shots-"))
os.environ.update(TUNEBOARD_SAVES=str(SAVES), GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1",
                  HF_HUB_DISABLE_TELEMETRY="1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from playwright.sync_api import sync_playwright  # noqa: E402

from conftest import CHROMIUM  # noqa: E402

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
ZH_ONLY = "--zh-only" in sys.argv
OUT = Path(ARGS[0] if ARGS else Path(__file__).resolve().parents[2] / "test-artifacts" / "shots")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def fake_run(name: str, steps: int, start: str, last_loss: float) -> Path:
    d = SAVES / "SmolLM2-135M-Instruct" / "lora" / name
    (d / f"checkpoint-{steps}").mkdir(parents=True)
    (d / "run_spec.yaml").write_text(f"model_name_or_path: {MODEL}\nstage: sft\nfinetuning_type: lora\n"
                                     f"dataset: identity\nmax_steps: {steps}\n")
    (d / "adapter_config.json").write_text("{}")
    with open(d / "trainer_log.jsonl", "w") as f:
        for s in range(1, steps + 1):
            loss = 3.0 - (3.0 - last_loss) * s / steps
            f.write(json.dumps({"step": s, "total_steps": steps, "loss": loss, "lr": 2e-4 * (1 - s / steps),
                                "epoch": s / 10, "elapsed_s": 3 * s}) + "\n")
    (d / "status.json").write_text(json.dumps({
        "state": "completed", "step": steps, "total_steps": steps, "started_at": start,
        "finished_at": start.replace(":00", ":01"), "final_metrics": {"train_loss": 2.55, "final_loss": last_loss}}))
    return d


def fake_eval():
    job = SAVES / ".tools" / f"eval-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    parts = []
    for name, adapter in (("tuned", "/saves/run"), ("base", None)):
        d = job / name
        d.mkdir(parents=True)
        (d / "launch.json").write_text(json.dumps({"pid": 999999, "argv": [], "launched_at": time.time()}))
        (d / "status.json").write_text(json.dumps({"state": "completed", "step": 3, "total_steps": 3}))
        (d / "eval_results.json").write_text(json.dumps({"rows": 3, "eval_loss": 1.2, "predict_rouge-l": 40.0}))
        rows = [{"index": i, "source": "identity", "row": i, "label": "I am TuneBoard Assistant, made by TuneBoard.",
                 "prompt": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n"
                           f"<|im_start|>user\nQuestion {i}: who are you?<|im_end|>\n<|im_start|>assistant\n",
                 "predict": "I am an assistant." * (i + 1), "rouge-l": 30.0 + i, "bleu-4": 10.0, "exact_match": i == 2}
                for i in range(3)]
        (d / "generated_predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        parts.append({"name": name, "dir": str(d), "adapter": adapter, "launched": True})
    (job / "plan.json").write_text(json.dumps({"parts": parts, "spec": {"eval_dataset": "identity", "max_samples": 3}}))


def shoot_zh(browser, url, w, h):
    """The Train tab in Chinese: the first screen, then with the Training and LoRA accordions open."""
    page = browser.new_page(viewport={"width": w, "height": h})
    page.goto(url)
    page.locator("#tb-header").wait_for()
    page.wait_for_timeout(1500)
    page.locator("#top-lang input").click()
    page.get_by_role("option", name="简体中文").click()
    page.get_by_role("tab", name="训练").wait_for()
    page.wait_for_timeout(1000)
    page.screenshot(path=str(OUT / f"train-zh-{w}x{h}.png"))
    for group in ("train-group-train", "train-group-lora"):
        page.locator(f"#{group}").click(position={"x": 30, "y": 14})
        page.wait_for_timeout(500)
    page.wait_for_timeout(800)
    page.screenshot(path=str(OUT / f"train-zh-open-{w}x{h}.png"), full_page=True)
    page.close()


def main():
    from webui.app import create_app, launch_kwargs

    runs = [fake_run("2026-11-30-14-02-03", 20, "2026-11-30T14:02:03", 1.63),
            fake_run("2026-11-30-14-30-10", 30, "2026-11-30T14:30:10", 1.21)]
    one = fake_run("2026-11-30-15-00-00", 1, "2026-11-30T15:00:00", 2.5)  # a single logged step
    fake_eval()
    demo = create_app()
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True,
                            **launch_kwargs())
    OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu",
            "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost , EXCLUDE 127.0.0.1"])
        for w, h in ((1400, 1000), (1280, 800)):
            shoot_zh(browser, url, w, h)
            if ZH_ONLY:
                continue
            page = browser.new_page(viewport={"width": w, "height": h})
            page.goto(url)
            page.locator("#tb-header").wait_for()
            page.wait_for_timeout(1500)
            box = page.locator("#top-adapter_name_or_path input")
            box.click()
            page.wait_for_timeout(500)
            page.screenshot(path=str(OUT / f"picker-{w}x{h}.png"))
            page.get_by_role("option").nth(1).click()
            page.locator("#tb-header").click()
            page.wait_for_timeout(1000)
            page.screenshot(path=str(OUT / f"train-{w}x{h}.png"), full_page=True)
            for tab, prep in (("Runs", None), ("Data", "#data-preview .tb-trained"), ("Evaluate", None),
                              ("Export", None), ("Chat", None)):
                page.get_by_role("tab", name=tab).click()
                if prep:
                    page.locator(prep).first.wait_for(timeout=120_000)
                if tab == "Runs":
                    for r in runs:
                        sel = page.locator("#runs-select input")
                        sel.click()
                        sel.fill(r.name)
                        sel.press("Enter")
                    page.locator("#tb-header").click()
                    page.locator('#runs-table [data-testid="cell-0-1"]').click()
                if tab == "Data":  # the length histogram, bins in numeric order
                    page.locator("#data-stats").click()
                    page.locator("#data-hist svg").first.wait_for(timeout=180_000)
                if tab == "Evaluate":
                    page.locator('#eval-rows [data-testid="cell-0-1"]').wait_for(timeout=30_000)
                    page.locator('#eval-rows [data-testid="cell-0-1"]').click()
                page.wait_for_timeout(1500)
                page.screenshot(path=str(OUT / f"{tab.lower()}-{w}x{h}.png"), full_page=True)
            # the live view of a run with one logged step: its point is drawn
            page.get_by_role("tab", name="Runs").click()
            target = page.locator("#runs-target input")
            target.click()
            target.fill(one.name)
            target.press("Enter")
            page.locator("#runs-open").click()
            page.wait_for_timeout(3000)
            page.screenshot(path=str(OUT / f"train-one-step-{w}x{h}.png"), full_page=True)
            page.close()
        browser.close()
    demo.close()
    print(OUT)


if __name__ == "__main__":
    main()
