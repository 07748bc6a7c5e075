"""Abort of a 2-process run from the Train form (issue 12): the page says aborted, status.json too, both ranks
stopped after the same step with one checkpoint, and no process of the run is left."""
import json
import time
from pathlib import Path

import psutil
from playwright.sync_api import expect

from ui_actions import set_dropdown, set_number


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names the run folder (the launcher and its workers)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(p.info["cmdline"] or ()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_abort_of_a_two_process_run_from_the_form(app_page, saves_root, tiny_llama):
    from webui import jobs

    page = app_page
    model = page.locator("#top-model_name_or_path input")
    model.fill(str(tiny_llama))
    model.press("Enter")
    steps = page.locator("#train-max_steps input")
    steps.fill("5000")  # it cannot finish before the abort
    steps.press("Tab")
    page.locator("#train-group-train").click(position={"x": 30, "y": 14})
    set_number(page, "train-save_steps", 100000)  # the only checkpoint is the one the abort writes
    page.locator("#train-group-distributed").click(position={"x": 30, "y": 14})  # open the accordion
    set_dropdown(page, "train-nproc_per_node", 2)
    page.locator("#train-start").click()
    expect(page.locator("#train-message")).to_contain_text("Started", timeout=30_000)
    run_dir = Path(jobs.find_active_run(saves_root))
    assert jobs.read_spec_dict(run_dir)["nproc_per_node"] in (2, "2")
    state = page.locator("#train-progress .tb-progress")
    page.wait_for_function("() => +document.querySelector('#train-progress .tb-progress').dataset.step > 0",
                           timeout=180_000)
    # the launcher and both ranks are running
    ranks = sorted(p.environ().get("RANK") for p in run_processes(run_dir) if p.environ().get("RANK"))
    assert ranks == ["0", "1"], ranks
    pid = jobs.run_state(run_dir).pid
    page.locator("#train-abort").click()
    expect(state).to_have_attribute("data-state", "aborted", timeout=120_000)
    expect(page.locator("#train-message")).to_contain_text("stopped at step")
    deadline = time.monotonic() + 120  # a hang guard, not a timing claim
    while (jobs.pid_alive(pid) or run_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_processes(run_dir) == [] and not jobs.pid_alive(pid)
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "aborted" and st["pid"] == pid and st["world_size"] == 2
    step = st["step"]
    assert step > 0 and [p.name for p in run_dir.glob("checkpoint-*")] == [f"checkpoint-{step}"]
    assert sorted(p.name for p in (run_dir / f"checkpoint-{step}").glob("rng_state_*")) == [
        "rng_state_0.pth", "rng_state_1.pth"]  # both ranks saved at that step
    logged = [json.loads(line)["step"] for line in (run_dir / "trainer_log.jsonl").read_text().splitlines()]
    assert logged[-1] == step
    assert f"rank 1: stopping after step {step} (stop requested on another rank)" in (
        run_dir / jobs.PROCESS_LOG).read_text()
