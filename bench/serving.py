"""Serving benchmark (not a test): the default model behind three OpenAI-compatible servers, driven by the real
`openai` client with the same 8 prompts, greedy, a fixed max_tokens:

- TuneBoard, transformers backend  (`tuneboard api`, continuous batching: backend/serving/batching.py)
- the same with batching off       (TUNEBOARD_BATCHING=0: requests take turns on the model, as before batching)
- the same with KV reuse off       (TUNEBOARD_KV_REUSE=0: each chat turn prefills its whole prompt)
- TuneBoard, llama.cpp backend     (`tuneboard api infer_backend=llamacpp` on the model's q4_k_m export, written
                                    once by `tuneboard export export_gguf_type=q4_k_m` into bench/results/serving/)
- LLaMA-Factory's API              (`llamafactory-cli api`, bench/.venv-lf, its huggingface backend, its defaults)

    python bench/serving.py [--max-tokens 64] [--servers tb-hf,tb-turns,tb-noreuse,tb-llamacpp,lf] [--turns 4]
                            [--only-turns]

For each server, 1 client (the 8 prompts one after another) and 8 clients (all 8 at once): tokens/s = completion
tokens of all 8 answers / wall time from the first request to the last answer; time to first token = request to
first streamed content, mean over the 8; peak RSS = the server's process tree (sampled every 0.1 s, summed over
its processes). Completion tokens are counted by the model's tokenizer on each answer's text, the same count for
every server. Then (--turns N, 0: skipped) a multi-turn client: CHATS conversations one after another, each N
turns (a long system prompt, the question, then FOLLOW_UPS, each turn sending the whole history with the
answers so far): time to first token of turn 1 and of turns 2+ (mean), where the KV cache of the turn before can
be reused (backend/serving/batching.py: KVStore), and the server's reuse counters from /health where it has them.
--only-turns skips the 1- and 8-client runs. One warm-up request precedes each measurement. Results: bench/results/serving-DATE.json and a
table on stdout (the ratios are against LLaMA-Factory's API and against the transformers backend).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULTS = BENCH / "results"
LF_CLI = BENCH / ".venv-lf" / "bin" / "llamafactory-cli"
PY = sys.executable
TEMPLATE = "chatml"  # the default model's format (SmolLM2 is ChatML), the name both tools give it
PROMPTS = [
    "Name three primary colors.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Give me a short tip for learning to code.",
    "What does a CPU do?",
    "Describe a cat in a few words.",
    "Why is the sky blue?",
    "List two uses of a paperclip.",
]

SYSTEM = ("You are a patient tutor for curious beginners. Answer in plain words, one idea at a time, without jargon; "
          "when a term is needed, say what it means. Prefer short sentences and concrete everyday examples over "
          "abstractions. If the question is unclear, answer the most likely reading and say which one you chose. "
          "Never invent facts: say when you are not sure. Keep every answer short unless asked for more, and end "
          "with one question that checks the learner understood.")
FOLLOW_UPS = ["Tell me more about that.", "Why is that so?", "Give me an everyday example.",
              "Sum it up in one sentence.", "What should I read next?"]
CHATS = 2  # conversations in the multi-turn measurement (PROMPTS[:CHATS] open them)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess: started, waited for (GET /v1/models answers), its process tree's RSS sampled."""

    def __init__(self, cmd: list[str], port: int, env: dict, log: Path):
        self.port, self.log = port, log
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **env})
        self.peak, self._sampling = 0, False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout: float = 600) -> float:
        import httpx

        start = time.time()
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): see {self.log}")
            try:
                if httpx.get(self.url + "/models", timeout=2, headers={"Authorization": "Bearer x"}).status_code == 200:
                    return time.time() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout:.0f} s: see {self.log}")

    def rss(self) -> int:
        """Bytes held by the server and its children (bench/run.py's tree_rss_kib, as the training benchmark)."""
        from run import tree_rss_kib  # bench/run.py, on sys.path: this script's own folder

        return tree_rss_kib(self.proc.pid) * 1024

    def sample(self):
        self._sampling = True

        def loop():
            while self._sampling:
                self.peak = max(self.peak, self.rss())
                time.sleep(0.1)

        threading.Thread(target=loop, daemon=True).start()

    def stop(self):
        self._sampling = False
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def ask(client, model: str, prompt: str | list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat request (a prompt, or the messages): its text, time to first content, total time."""
    start = time.perf_counter()
    first, text = None, []
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    stream = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            if first is None:
                first = time.perf_counter() - start
            text.append(piece)
    return {"text": "".join(text), "ttft": first if first is not None else time.perf_counter() - start,
            "seconds": time.perf_counter() - start}


def measure(client, model: str, clients: int, max_tokens: int, count) -> dict:
    answers: list = [None] * len(PROMPTS)

    def worker(indices):
        for i in indices:
            answers[i] = ask(client, model, PROMPTS[i], max_tokens)

    groups = [list(range(len(PROMPTS)))] if clients == 1 else [[i] for i in range(len(PROMPTS))]
    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(count(a["text"]) for a in answers)
    return {"clients": clients, "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2),
            "ttft_s": round(statistics.mean(a["ttft"] for a in answers), 3), "texts": [a["text"] for a in answers]}


def measure_turns(client, model: str, turns: int, max_tokens: int, health: str) -> dict:
    """CHATS conversations of `turns` turns, one after another: mean time to first token of turn 1 and of the
    later turns, the answers, and the server's KV reuse counters moved over it (GET `health`, where it has them)."""
    import httpx

    def counters() -> dict:
        try:
            batching = httpx.get(health, timeout=5).json().get("batching", {}).get(model, {})
        except (httpx.HTTPError, ValueError):
            return {}
        return {k: v for k, v in batching.items() if k.startswith("kv_")}

    before = counters()
    first, later, texts = [], [], []
    for prompt in PROMPTS[:CHATS]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        for turn in range(turns):
            answer = ask(client, model, messages, max_tokens)
            (first if turn == 0 else later).append(answer["ttft"])
            texts.append(answer["text"])
            messages += [{"role": "assistant", "content": answer["text"]},
                         {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    after = counters()
    return {"chats": CHATS, "turns": turns, "ttft_turn1_s": round(statistics.mean(first), 3),
            "ttft_later_s": round(statistics.mean(later), 3) if later else None,
            "kv": {k: after[k] - before.get(k, 0) for k in after}, "texts": texts}


def q4_export(model_dir: Path) -> Path:
    """The default model's q4_k_m GGUF, exported once by `tuneboard export` (and verified in llama.cpp by it)."""
    out = RESULTS / "serving" / "q4_k_m"
    found = sorted(out.glob("*q4_k_m.gguf")) if out.is_dir() else []
    if found:
        return found[0]
    cmd = [PY, "-m", "backend.cli", "export", f"model_name_or_path={model_dir}", "finetuning_type=full",
           f"template={TEMPLATE}", f"export_dir={out}", "export_format=gguf", "export_gguf_type=q4_k_m",
           "export_overwrite=true"]
    print("exporting the q4_k_m GGUF once:", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)
    found = sorted(out.glob("*q4_k_m.gguf"))
    if not found:
        raise RuntimeError(f"the q4_k_m export wrote no GGUF file in {out}")
    return found[0]


def servers(wanted: list[str], model_dir: Path) -> list[tuple[str, list[str], dict, str]]:
    """(name, command, environment, served model name) of each server to run; the port is filled in later."""
    out = []
    tb = [PY, "-m", "backend.cli", "api", f"template={TEMPLATE}", "do_sample=false"]
    if "tb-hf" in wanted:
        out.append(("TuneBoard transformers", tb + [f"model_name_or_path={model_dir}"], {}, str(model_dir)))
    if "tb-turns" in wanted:  # the same server with batching off: requests take turns (TUNEBOARD_BATCHING=0)
        out.append(("TuneBoard transformers turns", tb + [f"model_name_or_path={model_dir}"],
                    {"TUNEBOARD_BATCHING": "0"}, str(model_dir)))
    if "tb-noreuse" in wanted:  # batching on, a chat's KV cache not reused across its turns (TUNEBOARD_KV_REUSE=0)
        out.append(("TuneBoard transformers no KV reuse", tb + [f"model_name_or_path={model_dir}"],
                    {"TUNEBOARD_KV_REUSE": "0"}, str(model_dir)))
    if "tb-llamacpp" in wanted:
        try:
            import llama_cpp  # noqa: F401  (optional: the llamacpp extra, make setup-gguf)

            gguf = q4_export(model_dir)
            out.append(("TuneBoard llama.cpp q4_k_m", tb + [f"model_name_or_path={gguf}", "infer_backend=llamacpp"],
                        {}, str(gguf)))
        except Exception as exc:  # not installed, or the export failed: the table says so
            print(f"TuneBoard llama.cpp backend skipped: {exc}", flush=True)
    if "lf" in wanted:
        if LF_CLI.exists():
            shims = {"PYTHONPATH": str(BENCH / "lf_shims")}  # torchaudio stand-in: see lf_shims/torchaudio
            # without a YAML file llamafactory-cli reads --key value arguments (key=value only after a YAML)
            out.append(("LLaMA-Factory API", [str(LF_CLI), "api", "--model_name_or_path", str(model_dir),
                                              "--template", TEMPLATE, "--infer_backend", "huggingface"], shims,
                        "default"))
        else:
            print(f"LLaMA-Factory skipped: {LF_CLI} is missing (bash bench/install_lf.sh installs it)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--servers", default="tb-hf,tb-turns,tb-noreuse,tb-llamacpp,lf")
    parser.add_argument("--turns", type=int, default=4, help="turns of each multi-turn chat (0: no multi-turn run)")
    parser.add_argument("--only-turns", action="store_true", help="skip the 1- and 8-client runs")
    parser.add_argument("--threads", type=int, default=0,
                        help="OMP_NUM_THREADS for every server (0: unset). On a loaded machine 1 avoids OpenMP's "
                             "spinning threads waiting for a descheduled peer (5 s a token instead of 0.7 s here)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import openai
    from transformers import AutoTokenizer

    from backend.core.paths import default_model_file
    from backend.training.models import materialize_gguf

    model_dir = materialize_gguf(default_model_file())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    when = dt.datetime.now().strftime("%Y%m%d-%H%M")
    load = os.getloadavg()
    print(f"{when}  {os.cpu_count()} CPUs  load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}  model {model_dir.name}"
          f"  {len(PROMPTS)} prompts, greedy, max_tokens {args.max_tokens}"
          + (f", OMP_NUM_THREADS={args.threads}" if args.threads else ""), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, cmd, env, served in servers(args.servers.split(","), model_dir):
        port = free_port()
        if args.threads:
            env = {**env, "OMP_NUM_THREADS": str(args.threads)}
        if name.startswith("LLaMA"):
            env = {**env, "API_PORT": str(port), "API_HOST": "127.0.0.1"}
        else:
            cmd = cmd + ["--port", str(port)]
        log = RESULTS / f"serving-{when}-{'-'.join(name.lower().replace('.', '').split())}.log"
        server = Server(cmd, port, env, log)
        try:
            ready = server.wait_ready()
            server.sample()
            client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=900)
            ask(client, served, "Hello!", 8)  # warm-up
            row = {"server": name, "ready_s": round(ready, 1), "load_before": round(os.getloadavg()[0], 1)}
            if not args.only_turns:
                row["one"] = one = measure(client, served, 1, args.max_tokens, count)
                row["eight"] = eight = measure(client, served, 8, args.max_tokens, count)
                print(f"{name}: 1 client {one['tokens_per_s']} tok/s (TTFT {one['ttft_s']} s), 8 clients "
                      f"{eight['tokens_per_s']} tok/s (TTFT {eight['ttft_s']} s)", flush=True)
            if args.turns > 0:
                health = server.url.removesuffix("/v1") + "/health"
                row["chat"] = chat = measure_turns(client, served, args.turns, args.max_tokens, health)
                print(f"{name}: {chat['chats']} chats of {chat['turns']} turns, TTFT turn 1 {chat['ttft_turn1_s']} s, "
                      f"turns 2+ {chat['ttft_later_s']} s, KV reuse {chat['kv'] or '-'}", flush=True)
            time.sleep(0.3)
            row.update(peak_rss_mb=round(server.peak / 2**20), load_after=round(os.getloadavg()[0], 1))
            rows.append(row)
            print(f"{name}: peak RSS {row['peak_rss_mb']} MB", flush=True)
        except Exception as exc:
            print(f"{name} failed: {exc}", flush=True)
        finally:
            server.stop()
    table = render(rows)
    print(table)
    out = RESULTS / f"serving-{when}.json"
    out.write_text(json.dumps({"when": when, "cpus": os.cpu_count(), "load_average": load, "model": str(model_dir),
                               "prompts": PROMPTS, "system": SYSTEM, "follow_ups": FOLLOW_UPS,
                               "max_tokens": args.max_tokens, "turns": args.turns, "threads": args.threads or None,
                               "rows": rows}, indent=2))
    print(f"results: {out}")
    return 0 if rows else 1


def render(rows: list[dict]) -> str:
    base = {r["server"]: r for r in rows}
    lf, hf = base.get("LLaMA-Factory API"), base.get("TuneBoard transformers")

    def ratio(r, ref, key):
        if not (ref and key in ref and key in r and ref[key]["tokens_per_s"]):
            return "-"
        return f"{r[key]['tokens_per_s'] / ref[key]['tokens_per_s']:.2f}x"

    lines = []
    if any("one" in r for r in rows):
        lines += ["| server | tok/s, 1 client | tok/s, 8 clients | TTFT 1 / 8 clients (s) | peak RSS (MB) | "
                  "8 clients vs LLaMA-Factory | 8 clients vs TB transformers |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "one" in r:
                lines.append(f"| {r['server']} | {r['one']['tokens_per_s']} | {r['eight']['tokens_per_s']} | "
                             f"{r['one']['ttft_s']} / {r['eight']['ttft_s']} | {r['peak_rss_mb']} | "
                             f"{ratio(r, lf, 'eight')} | {ratio(r, hf, 'eight')} |")
    chats = [r for r in rows if r.get("chat")]
    if chats:
        later = hf["chat"]["ttft_later_s"] if hf and hf.get("chat") else None
        lines += ["", "| server | TTFT turn 1 (s) | TTFT turns 2+ (s) | turns 2+ vs TB transformers | KV reuse |",
                  "|---|---|---|---|---|"]
        for r in chats:
            c = r["chat"]
            vs = f"{c['ttft_later_s'] / later:.2f}x" if later and c["ttft_later_s"] else "-"
            lines.append(f"| {r['server']} | {c['ttft_turn1_s']} | {c['ttft_later_s']} | {vs} | "
                         f"{', '.join(f'{k} {v}' for k, v in c['kv'].items()) or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
