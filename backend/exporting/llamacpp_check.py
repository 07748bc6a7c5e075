"""A GGUF export quantized and checked by llama.cpp itself (llama-cpp-python, the optional `llamacpp` extra:
backend/core/llamacpp.py says whether it is installed).

- quantize(): llama.cpp's quantizer (llama_model_quantize) turns the f16 file our writer made into a k-quant,
  weighted by an importance matrix when the export computed one (export_imatrix, backend/exporting/imatrix.py).
- verify(): the exported file is loaded by llama.cpp and measured against the f16 file: perplexity of the answers
  of held-out chat rows, each given its prompt (a file that does not load or gives no finite perplexity fails the
  export; a rise above the type's share of the f16 perplexity, backend.core.llamacpp.PPL_WARN, is a warning),
  greedy answers to the
  probe prompts against the adapter's (reported), the chat template, the end-of-turn tokens and the
  tokenization of the rendered prompts as llama.cpp reads them back (required), tokens/s of greedy decoding.

Both run in a child process (`python -m backend.exporting.llamacpp_check quantize|measure ...`): llama.cpp
logs to the process's stderr, and a file that crashes it must not take the export with it.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from backend.core.llamacpp import GREEDY_NEAR_TIE, PPL_WARN, QUANT_TYPES
from backend.core.paths import REPO_ROOT
from backend.core.supervise import die_with_parent

# held-out rows for the perplexity (rendered with the training template, answer included), besides the
# probe pairs' chosen answers the export passes in
HELD_OUT = [
    [{"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Sunlight is scattered by the molecules of the air, and blue light, with its "
                                      "shorter wavelength, is scattered much more than red light."}],
    [{"role": "user", "content": "Give me a tip for learning a new language."},
     {"role": "assistant", "content": "Practise a little every day: short, regular sessions help you remember "
                                      "words far better than one long session a week."}],
    [{"role": "user", "content": "What does a compiler do?"},
     {"role": "assistant", "content": "A compiler translates a program written in a programming language into "
                                      "machine code that a computer can run."}],
    [{"role": "user", "content": "Name three fruits."},
     {"role": "assistant", "content": "Apples, bananas and oranges."}],
]


class LlamaCppError(RuntimeError):
    """llama.cpp refused or failed: one line saying why."""


def _child(args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = os.getpid()  # the child dies with the export, even with a SIGKILLed one (PR_SET_PDEATHSIG)
    proc = subprocess.run([sys.executable, "-m", "backend.exporting.llamacpp_check", *args], cwd=str(REPO_ROOT),
                          env=env, capture_output=True, text=True,
                          preexec_fn=lambda: die_with_parent(signal.SIGKILL, parent))
    if proc.returncode < 0:
        raise LlamaCppError(f"llama.cpp crashed ({signal.Signals(-proc.returncode).name}) on it")
    if proc.returncode != 0:
        raise LlamaCppError(_reason(proc.stderr, proc.returncode))
    return proc.stdout


def _reason(stderr: str, code: int) -> str:
    """The line of llama.cpp's log that says why (its loader's error lines), else the last line."""
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    for marker in ("error loading model:", "error:", "failed", "error"):
        hits = [ln for ln in lines if marker in ln.lower()]
        if hits:
            return hits[0][:300]
    return (lines[-1][:300] if lines else f"the llama.cpp process ended with code {code}")


def quantize(f16: Path, out: Path, gguf_type: str, imatrix: Path | None = None, dataset: str = "") -> int:
    """llama.cpp's quantizer: f16 GGUF -> gguf_type (q4_k_m, q5_k_m, q6_k, q4_0), weighted by the importance matrix
    in `imatrix` (an .npz of imatrix.save) when given; the file's metadata then says so, as llama-quantize's do
    (quantize.imatrix.entries_count, quantize.imatrix.dataset = `dataset`). Returns how many entries (weights) of it were handed to the
    quantizer (0 without one). Raises LlamaCppError."""
    said = _child(["quantize", str(f16), str(out), gguf_type, *([str(imatrix), dataset] if imatrix else [])])
    if not out.is_file():
        raise LlamaCppError(f"llama.cpp's quantizer wrote no {out.name}")
    return next((int(ln.split()[1]) for ln in said.splitlines() if ln.startswith("imatrix_entries ")), 0)


def measure(path: Path, request: dict) -> dict:
    """Load `path` in llama.cpp (a child process) and measure it on the request's rows and prompts."""
    with tempfile.TemporaryDirectory(prefix="tuneboard-llamacpp-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps(request), encoding="utf-8")
        _child(["measure", str(path), str(req)])
        return json.loads((Path(tmp) / "result.json").read_text(encoding="utf-8"))


def verify(path: Path, reference: Path | None, stored: str, *, rows: list[dict], prompts: list[list[int]],
           rendered: list[str], greedy: list[list[int]], forced: list[np.ndarray], stop_ids: list[int],
           chat_template: str, max_new_tokens: int, warn) -> tuple[list[dict], dict]:
    """The llama.cpp checks of the exported file `path` (a `stored` GGUF) against `reference` (the f16 file; None
    when the export is the f16 file). `rows`: {"ids", "labels"} (-100: not scored; export.perplexity_rows).
    `greedy`: the adapter's greedy answers to `prompts`; `forced`: its log-probabilities along them
    (verify.forced_logprobs). Returns (checks, the report's row: size, perplexity, delta, tokens/s)."""
    request = {"rows": rows, "prompts": prompts, "rendered": rendered, "stop_ids": stop_ids,
               "max_new_tokens": max_new_tokens,
               "forced": [{"ids": p + a, "start": len(p) - 1, "targets": lp.argmax(-1).tolist()}
                          for p, a, lp in zip(prompts, greedy, forced)]}
    size = path.stat().st_size
    row: dict = {"type": stored, "file": path.name, "size_mb": round(size / 2**20, 2)}
    try:
        got = measure(path, request)
    except LlamaCppError as exc:
        return [{"name": "llamacpp_load", "ok": False, "detail": f"llama.cpp cannot load {path.name}: {exc}"}], row
    ref = got
    if reference is not None:
        try:
            ref = measure(reference, request)
        except LlamaCppError as exc:
            return [{"name": "llamacpp_load", "ok": False,
                     "detail": f"llama.cpp cannot load the f16 reference {reference.name}: {exc}"}], row
    checks = [{"name": "llamacpp_load", "ok": True, "tensor_types": got["tensor_types"],
               "detail": f"llama.cpp loads {path.name} ({row['size_mb']} MB; tensor types "
                         + ", ".join(f"{k} x{v}" for k, v in got["tensor_types"].items()) + ")"}]
    share = type_share(stored, got["tensor_types"])
    if share is not None:
        row["type_share"] = checks[0]["type_share"] = share
        if share["got"] < share["matrices"]:
            warn(type_share_line(stored, share))

    ppl, ppl_f16 = got["ppl"], ref["ppl"]
    finite = math.isfinite(ppl) and math.isfinite(ppl_f16)
    delta = ppl / ppl_f16 - 1 if finite else float("nan")
    limit = PPL_WARN.get(stored)
    row.update({"ppl": round(ppl, 4), "ppl_f16": round(ppl_f16, 4), "ppl_delta_pct": round(100 * delta, 3),
                "tokens_per_s": round(got["tokens_per_s"], 1), "tokens_per_s_f16": round(ref["tokens_per_s"], 1),
                "ppl_tokens": got["ppl_tokens"]})
    if finite and limit is not None and delta > limit:
        warn(f"llama.cpp perplexity of the {stored} file is {100 * delta:.2f}% above the f16 file's "
             f"({ppl:.4g} vs {ppl_f16:.4g}; the {stored} threshold is {100 * limit:g}%)")
    checks.append({"name": "llamacpp_perplexity", "ok": finite, "ppl": ppl, "ppl_f16": ppl_f16,
                   "delta_pct": 100 * delta, "warn_above_pct": None if limit is None else 100 * limit,
                   "size_mb": row["size_mb"], "tokens_per_s": got["tokens_per_s"],
                   "detail": (f"perplexity in llama.cpp of the answers of {len(rows)} held-out rows "
                              f"({got['ppl_tokens']} answer tokens, each given its prompt): "
                              f"{ppl:.4g}" + (f" vs {ppl_f16:.4g} for the f16 file ({100 * delta:+.2f}%)"
                                              if reference is not None else " (the f16 file itself)")
                              + f"; {got['tokens_per_s']:.1f} tokens/s greedy")
                   if finite else f"llama.cpp gives no finite perplexity for {path.name} ({ppl}): a broken file"})

    checks.append(greedy_check(stored, greedy, got["greedy"], forced, got["forced"], warn))
    row.update({k: checks[-1][k] for k in ("answers_identical", "forced_agree", "forced_total", "largest_flip_nats",
                                           "shift_rms_nats")})

    problems = []
    if got["chat_template"] != chat_template:
        problems.append("its chat template differs from the training template")
    not_eog = [i for i in stop_ids if not got["eog"].get(str(i))]
    if not_eog:
        problems.append(f"token(s) {not_eog} do not end generation in llama.cpp")
    if got["ids"] != prompts:
        bad = next(i for i, (a, b) in enumerate(zip(got["ids"], prompts)) if a != b)
        problems.append(f"llama.cpp splits probe prompt {bad} into other token ids")
    checks.append({"name": "llamacpp_template", "ok": not problems, "stop_ids": stop_ids,
                   "detail": "llama.cpp reads back the chat template, ends generation on the end-of-turn ids "
                             f"{stop_ids} and tokenizes the rendered prompts as the training tokenizer"
                   if not problems else "; ".join(problems)})
    return checks, row


# export_gguf_type -> the tensor types llama.cpp's quantizer gives a weight matrix of it (the _M mixes and q4_0 keep
# some matrices, the output head first, at Q6_K by design); others are its fallbacks where a row does not fit
PROMISED_TYPES = {"q4_k_m": ("Q4_K", "Q6_K"), "q5_k_m": ("Q5_K", "Q6_K"), "q6_k": ("Q6_K",), "q4_0": ("Q4_0", "Q6_K")}


def type_share(stored: str, tensor_types: dict) -> dict | None:
    """How many of the file's weight matrices (tensors not kept in F32) got the type its name promises."""
    promised = PROMISED_TYPES.get(stored)
    if promised is None:
        return None
    matrices = {k: v for k, v in tensor_types.items() if k != "F32"}
    got = sum(v for k, v in matrices.items() if k in promised)
    return {"promised": list(promised), "got": got, "matrices": sum(matrices.values()),
            "others": {k: v for k, v in matrices.items() if k not in promised}}


def type_share_line(stored: str, share: dict) -> str:
    total = max(share["matrices"], 1)
    return (f"the {stored} file holds {' / '.join(share['promised'])} in {share['got']} of its {share['matrices']} "
            f"weight matrices ({100 * share['got'] / total:.0f}%); the others are "
            + ", ".join(f"{k} x{v}" for k, v in share["others"].items())
            + ": llama.cpp's quantizer falls back to another type where a matrix's rows are not a multiple of its "
              f"block (256 values for the k-quants), so the file is not the {stored} its name says")


def forced_flips(forced: list[np.ndarray], got_forced: list[dict]) -> tuple[int, list[dict]]:
    """Along the adapter's own greedy answers (teacher-forced: both models read the same tokens), the positions
    where llama.cpp's top token is not the adapter's: (positions compared, flips). A flip's `adapter_nats` is how
    far the adapter itself put llama.cpp's choice below its own (log-probability gap; small: a near-tie that any
    rounding of the weights may turn over), `llamacpp_nats` the same gap the other way round in llama.cpp."""
    total, flips = 0, []
    for probe, (lp, theirs) in enumerate(zip(forced, got_forced)):
        for k, (ours, top) in enumerate(zip(lp.argmax(-1).tolist(), theirs["top"])):
            total += 1
            if ours != top:
                flips.append({"probe": probe, "position": k, "adapter_token": ours, "llamacpp_token": top,
                              "adapter_nats": round(float(lp[k, ours] - lp[k, top]), 4),
                              "llamacpp_nats": round(theirs["gap"][k], 4)})
    return total, flips


def greedy_check(stored: str, greedy: list[list[int]], got_greedy: list[list[int]], forced: list[np.ndarray],
                 got_forced: list[dict], warn) -> dict:
    """The file's greedy answers against the adapter's. Free-running answers part for good at their first
    different token, so the measure is teacher-forced: along each of the adapter's answers, llama.cpp's top token
    is the adapter's, or the two were a near-tie for the adapter (GREEDY_NEAR_TIE nats for the type); a flip
    where the adapter was surer warns, as a perplexity rise above the type's threshold does."""
    total, flips = forced_flips(forced, got_forced)
    shifts = [t - float(lp[k, int(lp[k].argmax())]) for lp, theirs in zip(forced, got_forced)
              for k, t in enumerate(theirs["target"])]  # llama.cpp's log-prob of the adapter's token minus the adapter's
    rms = math.sqrt(sum(x * x for x in shifts) / len(shifts)) if shifts else 0.0
    tie = GREEDY_NEAR_TIE.get(stored, GREEDY_NEAR_TIE["f16"])
    sure = [f for f in flips if f["adapter_nats"] > tie]
    identical = sum(a == b for a, b in zip(greedy, got_greedy))
    largest = max((f["adapter_nats"] for f in flips), default=0.0)
    if sure:
        worst = max(sure, key=lambda f: f["adapter_nats"])
        warn(f"llama.cpp's greedy choice on the {stored} file differs from the adapter's where the adapter was sure: "
             f"{len(sure)} of {total} positions along its probe answers (worst: probe {worst['probe']}, token "
             f"{worst['position']}, the adapter put llama.cpp's token {worst['adapter_nats']:.2f} nats below its "
             f"own; the {stored} near-tie is {tie:g})")
    ties = ", ".join(f"{f['adapter_nats']:.2f}" for f in flips)
    return {"name": "llamacpp_greedy", "ok": True, "required": False, "greedy": got_greedy,
            "identical": identical == len(greedy), "answers_identical": identical, "answers": len(greedy),
            "forced_agree": total - len(flips), "forced_total": total, "agreement": (total - len(flips)) / max(total, 1),
            "flips": flips, "near_tie_nats": tie, "largest_flip_nats": round(largest, 4), "matches": not sure,
            "shift_rms_nats": round(rms, 4),
            "figures": {"answers_identical": f"{identical}/{len(greedy)}", "top_token_agrees": f"{total - len(flips)}/{total}",
                        "largest_flip_nats": round(largest, 4), "near_tie_nats": tie, "shift_rms_nats": round(rms, 4)},
            "detail": f"greedy answers in llama.cpp: {identical}/{len(greedy)} identical to the adapter's; along the "
                      f"adapter's answers llama.cpp's top token is the adapter's at {total - len(flips)}/{total} "
                      "positions" + ("" if not flips else
                                     f"; of the {len(flips)} other(s), " + (
                                         "all are near-ties for the adapter" if not sure else
                                         f"{len(sure)} where the adapter was sure")
                                     + f" ({ties} nats apart; a {stored} near-tie: <= {tie:g})")
                      + f"; the file's log-probabilities of the adapter's tokens differ from the adapter's by "
                        f"{rms:.3f} nats (root mean square)"}


# ============================================================================ child process
def _imatrix_entries(path: str):
    """llama.cpp's C form of the importance matrix: an array of llama_model_imatrix_data {name, data, size} ended by
    an all-null entry (llama.h). Returns (the array, what must stay alive while the quantizer reads it)."""
    import llama_cpp  # optional dependency (the llamacpp extra): only this child loads the compiled library

    with np.load(path) as data:
        arrays = {name: np.ascontiguousarray(data[name], dtype=np.float32) for name in data.files}
    names = {name: name.encode() for name in arrays}
    entries = (llama_cpp.llama_model_imatrix_data * (len(arrays) + 1))()  # zero-filled: the last is the end mark
    for i, (name, values) in enumerate(arrays.items()):
        entries[i].name = names[name]
        entries[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = values.size
    return entries, (arrays, names)


def _metadata(pairs: dict):
    """llama.cpp's kv overrides (the keys the quantizer adds to the file): an array ended by an empty key."""
    import llama_cpp  # optional dependency (the llamacpp extra): only this child loads the compiled library

    kv = (llama_cpp.llama_model_kv_override * (len(pairs) + 1))()  # zero-filled: the last is the end mark
    for i, (key, value) in enumerate(pairs.items()):
        kv[i].key = key.encode()
        if isinstance(value, int):
            kv[i].tag, kv[i].value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, value
        else:
            kv[i].tag, kv[i].value.val_str = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()[:127]
    return kv


def _quantize_main(src: str, dst: str, gguf_type: str, imatrix: str | None = None, dataset: str = "") -> int:
    import llama_cpp  # optional dependency (the llamacpp extra): only this child loads the compiled library

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{QUANT_TYPES[gguf_type]}")
    params.nthread = os.cpu_count() or 1
    if imatrix:
        entries, _alive = _imatrix_entries(imatrix)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        kv = _metadata({"quantize.imatrix.entries_count": len(entries) - 1, "quantize.imatrix.dataset": dataset})
        params.kv_overrides = ctypes.cast(kv, ctypes.POINTER(llama_cpp.llama_model_kv_override))
        print(f"imatrix_entries {len(entries) - 1}", flush=True)
    code = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if code != 0:
        print(f"error: llama_model_quantize returned {code}", file=sys.stderr)
        return 1
    return 0


def _nll(scores: np.ndarray, ids: list[int], labels: list[int]) -> tuple[float, int]:
    """(summed negative log-likelihood, count) of the tokens ids[1:] whose label is not -100, each given the logits
    of the previous position."""
    scored = np.flatnonzero(np.asarray(labels[1:len(ids)]) != -100)
    logp = _log_softmax(scores[scored])
    return float(-logp[np.arange(len(scored)), np.asarray(ids)[scored + 1]].sum()), len(scored)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row by row, in float64."""
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))


def _tensor_types(path: str) -> dict:
    import gguf  # heavy: the GGUF reader, only in this child

    counts: dict = {}
    for t in gguf.GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def _measure_main(path: str, request_path: str) -> int:
    import llama_cpp  # optional dependency (the llamacpp extra): only this child loads the compiled library

    from backend.serving.llamacpp_model import open_llama  # loads the compiled library: only in this child

    req = json.loads(Path(request_path).read_text(encoding="utf-8"))
    longest = max([len(r["ids"]) for r in req["rows"]] + [len(p) + req["max_new_tokens"] for p in req["prompts"]])
    n_ctx = max(64, longest + 8)
    llm = open_llama(path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True,
                     verbose=True)  # its log goes to stderr, which the parent reads for why a load failed
    nll, count = 0.0, 0
    for row in req["rows"]:
        llm.reset()
        llm.eval(row["ids"])
        row_nll, row_count = _nll(llm.scores, row["ids"], row["labels"])
        nll, count = nll + row_nll, count + row_count
    stop = set(req["stop_ids"])
    answers, decoded, decode_s = [], 0, 0.0
    for ids in req["prompts"]:
        llm.reset()
        llm.eval(ids)
        out: list[int] = []
        while len(out) < req["max_new_tokens"]:
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if token in stop:
                break
            out.append(token)
            started = time.perf_counter()
            llm.eval([token])
            decode_s += time.perf_counter() - started
            decoded += 1
        answers.append(out)
    forced = []
    for item in req["forced"]:  # the adapter's answers read by this file: its top token and how far below it theirs is
        llm.reset()
        llm.eval(item["ids"])
        logp = _log_softmax(llm.scores[item["start"]:len(item["ids"])])
        best = logp.argmax(axis=1)
        rows = np.arange(len(best))
        forced.append({"top": best.tolist(), "gap": (logp[rows, best] - logp[rows, item["targets"]]).tolist(),
                       "target": logp[rows, item["targets"]].tolist()})
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    result = {"forced": forced,
        "ppl": math.exp(nll / count) if count else float("nan"), "ppl_tokens": count,
        "greedy": answers, "tokens_per_s": decoded / decode_s if decode_s else 0.0,
        "chat_template": llm.metadata.get("tokenizer.chat_template"),
        "eog": {str(i): bool(llama_cpp.llama_vocab_is_eog(vocab, i)) for i in req["stop_ids"]},
        "ids": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in req["rendered"]],
        "tensor_types": _tensor_types(path),
    }
    (Path(request_path).parent / "result.json").write_text(json.dumps(result), encoding="utf-8")
    return 0


def main(args: list[str]) -> int:
    if args[:1] == ["quantize"] and len(args) in (4, 6):
        return _quantize_main(*args[1:])
    if args[:1] == ["measure"] and len(args) == 3:
        return _measure_main(*args[1:])
    print("usage: python -m backend.exporting.llamacpp_check quantize F16.gguf OUT.gguf TYPE [IMATRIX.npz DATASET] | measure FILE.gguf "
          "REQUEST.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
