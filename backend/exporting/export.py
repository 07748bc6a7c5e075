"""`tuneboard export SPEC.yaml [key=value ...]`: merge LoRA adapters into the base and write a standalone
model (sharded safetensors, or GGUF + an Ollama Modelfile), then prove it answers like the source.

Reads top to bottom: check the request (before loading anything) -> load the base in full precision
(never 4-bit: merging into a quantized base is lossy) -> reference outputs of base and base+adapter on a
few chat prompts -> merge -> write -> reload the export in a fresh process -> compare -> export_report.json.

Why the verification is not optional: LLaMA-Factory users have shipped exports that silently held the
base model, or GGUF files that lost the chat template / EOS. Here every export is reloaded and checked:
logits against base+adapter, greedy continuation, the rendered chat prompt and its token ids, the EOS ids;
the adapter's effect is measured so an export that equals the base is caught. A failed check fails the
command (exit 1) and the report says which check and by how much.

Nothing half-written ever sits in export_dir: the files go to a hidden sibling `.<name>.partial-<pid>`,
are verified there, and only then take export_dir's place (an earlier export there stays untouched
until a new one passed; a new one that failed over an earlier one is left in `<name>.failed`).
SIGINT/SIGTERM remove the partial folder and end with `export ABORTED` (exit 130).

A reward model (stage rm: a LoRA adapter with task_type SEQ_CLS, or a full rm run folder) is exported as
what it is, a merged AutoModelForSequenceClassification folder (one-output score head, pad_token_id in its
config), verified on the scores of a few chosen / rejected pairs instead of logits and generation; GGUF
holds text-generating models only, so a reward model is refused there (`tuneboard validate` already says so).

The export is the model chat serves: the same template (template auto: the one the adapter was trained with,
backend.serving.engine.adapter_template), default_system written into the shipped chat template (and the Modelfile's
SYSTEM), rope_scaling into config.json. What validate can see is refused there (backend/core/export_rules.py: an
export_dir that holds a source or cannot be written, a model the GGUF writer cannot write); check_request says the
same again. The verification and llama.cpp children die with the export (PR_SET_PDEATHSIG), even a SIGKILLed one.

Progress goes to stdout as `[export k/N] ...` lines (the UI tails them); the last line is
`export PASSED ...`, `export FAILED ...` or `export ABORTED ...`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from backend.serving.engine import adapter_template, stop_token_ids
from backend.exporting.gguf_export import GGUFExportError, check_supported, vocab_metadata, write_gguf
from backend.exporting import imatrix, llamacpp_check
from backend.core import export_rules, llamacpp
from backend.core.supervise import die_with_parent
from backend.core.methods import method
from backend.exporting.verify import GREEDY_TOKENS, forced_logprobs, greedy, logits
from backend.exporting.system_prompt import with_default_system
from backend.exporting.modelfile import TemplateError, check_pieces, derive_pieces, modelfile_text, pieces_dict
from backend.training.adapters import _split
from backend.training.models import load_tokenizer, model_folder, resize_vocab, resolve_model, rope_scaled_config
from backend.core.paths import REPO_ROOT, weights_note
from backend.dataprep.preference import build_preference_dataset
from backend.dataprep.preprocess import encode_segments
from backend.core.promote import promoted_checkpoint
from backend.core.refusals import reward_gguf_refusal
from backend.dataprep.resolve import pick_template
from backend.evaluation.reward_score import score_pairs, set_pad_token
from backend.core.atomic import read_json_dict
from backend.core.rundir import EXPORT_REPORT_FILE, is_reward_model_dir, reward_model_folder, write_json_atomic
from backend.core.spec import load_or_report
from backend.dataprep.templates import template_to_jinja

REPORT_FILE = EXPORT_REPORT_FILE
MODELFILE = "Modelfile"
REFERENCE_F16 = "reference-f16.gguf.tmp"  # in the staging folder only: removed before it takes export_dir's place
IMATRIX_TMP = "imatrix.npz.tmp"  # the importance matrix the quantizer reads (export_imatrix), staging folder only
STEPS = 6
PPL_ROWS = 136  # alpaca_en_demo rows in a GGUF export's perplexity check in llama.cpp: all after the importance
#                 matrix's 64 (with the probe and written rows 2,646 answer tokens on the default model)
PROBE_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count to five."}],
]
# chosen / rejected pairs a reward model export is scored on (its prompts are the probe conversations)
PROBE_PAIRS = [
    {"messages": PROBE_CONVERSATIONS[0], "chosen": {"role": "assistant", "content": "The capital of France is Paris."},
     "rejected": {"role": "assistant", "content": "I am not sure, maybe Lyon."}},
    {"messages": PROBE_CONVERSATIONS[1], "chosen": {"role": "assistant", "content": "The sea is calm and blue today."},
     "rejected": {"role": "assistant", "content": "No."}},
    {"messages": PROBE_CONVERSATIONS[2], "chosen": {"role": "assistant", "content": "One, two, three, four, five."},
     "rejected": {"role": "assistant", "content": "Five, four, three."}},
]
# max |logit difference| allowed between the export and base+adapter, by the dtype the weights were stored in:
# (absolute floor, fraction of the largest |logit|)
LOGIT_TOL = {"float32": (1e-3, 1e-5), "f32": (1e-3, 1e-5), "float16": (2e-2, 5e-3), "f16": (2e-2, 5e-3),
             "bfloat16": (1e-1, 3e-2), "bf16": (1e-1, 3e-2), "q8_0": (2.5e-1, 1e-1)}
# llama.cpp's k-quants (backend.core.llamacpp.QUANT_TYPES) have no logit tolerance here: their logits through
# transformers' dequantizing loader are reported, and the quality gate is llama.cpp's own perplexity
GREEDY_MUST_MATCH = ("float32", "f32", "float16", "f16")


class ExportError(ValueError):
    """A request that cannot be exported, said in one line naming the field."""


class ExportAborted(BaseException):
    """SIGINT or SIGTERM arrived: the export stops and removes its partial files. A BaseException, like
    KeyboardInterrupt, so library code catching Exception does not swallow it."""


def perplexity_rows(template, tokenizer) -> list[dict]:
    """The rows llama.cpp's perplexity check scores, {"ids", "labels"} as training encodes them (labels -100 but on
    the answer): the probe pairs' chosen answers, llamacpp_check.HELD_OUT and alpaca_en_demo rows after the
    importance matrix's. Only answer tokens are scored, each given its prompt, as eval_loss scores them: the tokens
    before an answer (a template's default system prompt, the same in every row, read with no context) would
    otherwise weigh a third of the score and swing the deltas by several points (bench/README.md, k-quants)."""
    convs = ([p["messages"] + [p["chosen"]] for p in PROBE_PAIRS] + llamacpp_check.HELD_OUT
             + imatrix.calibration_conversations(n=PPL_ROWS, start=imatrix.CALIBRATION_ROWS))
    encoded = [encode_segments(template.render(c), tokenizer, imatrix.MAX_ROW_TOKENS) for c in convs]
    return [{"ids": e.input_ids, "labels": e.labels} for e in encoded if e.num_trained]


def _abort_on_signals() -> None:
    def handle(signum, frame):  # noqa: ARG001 - signal handler signature
        raise ExportAborted(f"received {signal.Signals(signum).name}")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


def _staging_dir(out: Path) -> Path:
    """A fresh hidden sibling of export_dir for this process. What dead exports left is tidied first: their
    partial folders are removed, and an earlier export set aside by a swap that was killed half-way (SIGKILL
    between _put_in_place's two renames) goes back to export_dir when nothing took its place."""
    for left in [*out.parent.glob(f".{out.name}.partial-*"), *out.parent.glob(f".{out.name}.old-*")]:
        pid = left.name.rsplit("-", 1)[-1]
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        if ".old-" in left.name and not out.exists():
            left.rename(out)
        else:
            shutil.rmtree(left, ignore_errors=True)
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    return stage


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _put_in_place(stage: Path, out: Path, ok: bool) -> Path:
    """Move the verified staging folder to export_dir (replacing what was there) when it passed or when
    export_dir holds nothing to lose; else next to it as <name>.failed. Returns where it went."""
    if not ok and not _is_empty_dir(out):
        target = out.parent / f"{out.name}.failed"
        shutil.rmtree(target, ignore_errors=True)
        stage.rename(target)
        return target
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        # SIGINT / SIGTERM wait until both renames are done (the export then stops as asked, in place);
        # a SIGKILL in between is mended by the next export's _staging_dir
        signals = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            out.rename(old)
            stage.rename(out)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        shutil.rmtree(old, ignore_errors=True)
    else:
        stage.rename(out)
    return out


def _say(step: int, message: str) -> None:
    print(f"[export {step}/{STEPS}] {message}", flush=True)


# ============================================================================ 1. the request
def _adapters(spec) -> list[Path]:
    return [Path(p).expanduser() for p in _split(spec.adapter_name_or_path)]


def _is_empty_dir(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def check_request(spec) -> None:
    """Everything that can be refused before a model is loaded."""
    if not spec.export_dir:
        raise ExportError("export_dir is required: the folder to write the exported model to")
    if spec.export_legacy_format:
        raise ExportError("export_legacy_format: true (.bin files) is not supported: the installed transformers has "
                          "no .bin writer (it writes safetensors only); set export_legacy_format: false")
    if spec.export_quantization_bit is not None:
        raise ExportError("export_quantization_bit: GPTQ export quantization is not implemented yet; for a "
                          "quantized file use export_format: gguf with export_gguf_type: q8_0")
    if spec.export_hub_model_id:
        raise ExportError("export_hub_model_id: pushing to the hub is not available (no network); upload "
                          "export_dir yourself")
    adapters = _adapters(spec)
    if method(spec.finetuning_type).adapter and not adapters:
        raise ExportError(f"adapter_name_or_path is required to merge an adapter (finetuning_type: {spec.finetuning_type}); "
                          "to export a model as it is (full or freeze fine-tuning, or a plain conversion), set "
                          "finetuning_type: full")
    for path in adapters:
        if not (path / "adapter_config.json").is_file():
            raise ExportError(f"adapter_name_or_path: {path} is not an adapter folder (no adapter_config.json)")
    _check_reward_request(spec, adapters)
    problem = export_rules.export_dir_problem(spec)  # validate's line (a source inside, a file, not writable, ...)
    if problem:
        raise ExportError(f"export_dir: {problem}")


def _check_reward_request(spec, adapters: list[Path]) -> None:
    """A reward model exports as a sequence-classification folder; it cannot be GGUF, and its adapters
    cannot be mixed with causal LM ones (light file checks: backend.core.rundir.is_reward_model_dir)."""
    reward_adapters = [a for a in adapters if is_reward_model_dir(a)]
    if reward_adapters and len(reward_adapters) < len(adapters):
        raise ExportError("adapter_name_or_path: mixes reward model adapters (task_type SEQ_CLS: "
                          f"{', '.join(map(str, reward_adapters))}) with causal LM adapters; export them separately")
    if adapters and not reward_adapters and is_reward_model_dir(spec.model_name_or_path):
        raise ExportError(f"adapter_name_or_path: {adapters[-1]} is a causal LM adapter, but model_name_or_path "
                          f"{spec.model_name_or_path} is a reward model (a score head, no LM head to merge it into)")
    holder = reward_model_folder(spec.model_name_or_path, spec.adapter_name_or_path)
    if holder and spec.export_format == "gguf":
        raise ExportError("export_format: " + reward_gguf_refusal(holder))


def check_adapter_base(adapter: Path, resolved, model_name: str, folder: Path) -> None:
    """The adapter's recorded base (adapter_config.json base_model_name_or_path) must be this model.

    A GGUF model is loaded from a cached HF folder named <gguf stem>-<size>-<mtime>: an adapter trained on
    it records that folder, so the same GGUF file (even re-cached) matches."""
    try:
        recorded = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise ExportError(f"adapter_name_or_path: cannot read {adapter / 'adapter_config.json'}: {exc}") from None
    if not recorded:
        return
    names = {model_name, resolved.model_id, str(resolved.path), str(folder)}
    if resolved.gguf_file:
        names.add(str(resolved.gguf_path))
    if recorded in names:
        return
    rec = Path(recorded).expanduser()
    try:
        if rec.exists() and rec.resolve() in (folder.resolve(), Path(resolved.path).resolve()):
            return
    except OSError:
        pass
    if resolved.gguf_file and rec.parent == folder.parent and rec.name.startswith(Path(resolved.gguf_file).stem + "-"):
        return
    if not rec.exists():
        try:
            if model_folder(resolve_model(recorded)).resolve() == folder.resolve():
                return
        except (ValueError, FileNotFoundError, OSError):
            pass
    raise ExportError(
        f"base model mismatch: adapter {adapter} was trained on {recorded!r} (base_model_name_or_path in its "
        f"adapter_config.json) but model_name_or_path is {model_name!r} ({folder}). Merging it into another "
        "model gives a broken export: use the adapter's base model (if it is the same model moved elsewhere, "
        "correct base_model_name_or_path in adapter_config.json)")


# ============================================================================ 2. source outputs
def _save_dtype(spec, folder: Path):
    if spec.infer_dtype != "auto":
        return getattr(torch, spec.infer_dtype)
    cfg = read_json_dict(folder / "config.json")
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, name) if name in ("float32", "float16", "bfloat16") else torch.float32


def _template(spec, resolved, tokenizer, adapters: list[Path], warn):
    """The template chat serves this model with (template auto: the one the adapter was trained with, its run's
    run_spec.yaml), with default_system as the system prompt of a conversation that has none, as chat adds it."""
    base = pick_template(spec.template, resolved, tokenizer, warn=warn)
    return with_default_system(adapter_template(spec.template, adapters, tokenizer, base), tokenizer,
                               spec.default_system)


def _config(spec, folder: Path, warn) -> dict:
    """from_pretrained's config with rope_scaling applied as training and chat load the model (load_model ->
    rope_scaled_config): the exported config.json carries the same RoPE scaling."""
    return {"config": rope_scaled_config(spec, folder, False, warn)} if spec.rope_scaling else {}


def _device(spec) -> str:
    return "cuda" if spec.export_device == "auto" and torch.cuda.is_available() else "cpu"


def chat_template_for(template, tokenizer) -> str:
    """The jinja chat template to ship: the tokenizer's own for `auto`, our named template converted."""
    if template.name == "auto":
        ct = tokenizer.chat_template
        return ct if isinstance(ct, str) else json.dumps(ct)
    return template_to_jinja(template)


# ============================================================================ 3. verification (fresh process)
def _run_verifier(request: dict, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="tuneboard-verify-") as tmp:
        req_path = Path(tmp) / "request.json"
        request = dict(request, out=str(Path(tmp) / "result.pt"))
        req_path.write_text(json.dumps(request), encoding="utf-8")
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", "backend.exporting.verify", str(req_path)],
                              cwd=str(REPO_ROOT), env=env, capture_output=True, text=True,
                              preexec_fn=_die_with_us())
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"the export does not load in a fresh process:\n{tail}")
        return torch.load(request["out"], weights_only=False)


def _die_with_us():
    """A child's preexec_fn: it is killed when this export dies, even by SIGKILL (PR_SET_PDEATHSIG on Linux)."""
    parent = os.getpid()
    return lambda: die_with_parent(signal.SIGKILL, parent)


def _max_abs(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def compare(src: dict, got: dict, *, kind: str, stored: str, expected: dict) -> list[dict]:
    """The checks, each {"name", "ok", "detail", ...figures}."""
    checks = []
    scale = max(float(t.abs().max()) for t in src["logits"])
    diff = _max_abs(src["logits"], got["logits"])
    if stored in LOGIT_TOL:
        floor, frac = LOGIT_TOL[stored]
        tol = max(floor, frac * scale)
        checks.append({"name": "logits", "ok": diff <= tol, "max_abs_diff": diff, "tolerance": tol,
                       "max_abs_logit": scale,
                       "detail": f"max |export - (base+adapter)| logit difference {diff:.3g} (tolerance {tol:.3g})"})
    else:  # a k-quant: no tolerance of our own (llamacpp_perplexity is its check); the adapter check compares
        tol = diff
        checks.append({"name": "logits", "ok": True, "max_abs_diff": diff, "max_abs_logit": scale, "required": False,
                       "detail": f"max |export - (base+adapter)| logit difference {diff:.3g} through transformers' "
                                 f"dequantizing loader (reported for {stored}; llama.cpp's perplexity is the check)"})
    effect = src.get("adapter_effect")
    if effect is not None and stored not in LOGIT_TOL:
        checks.append(_adapter_merged_quantized(effect, diff, _max_abs(src["base_logits"], got["logits"]), stored))
    elif effect is not None:
        vs_base = _max_abs(src["base_logits"], got["logits"])
        meaningful = effect > 4 * tol
        ok = (not meaningful) or diff < vs_base / 2
        checks.append({"name": "adapter_merged", "ok": ok, "adapter_effect": effect, "export_vs_base": vs_base,
                       "export_vs_source": diff,
                       "detail": (f"the adapter moves logits by up to {effect:.3g}; the export is {diff:.3g} from "
                                  f"base+adapter and {vs_base:.3g} from the base" if meaningful else
                                  f"the adapter barely changes the model (max logit change {effect:.3g}): "
                                  "nothing to distinguish from the base")})
    total = sum(len(s) for s in src["greedy"])
    same = sum(sum(1 for a, b in zip(s, g) if a == b) for s, g in zip(src["greedy"], got["greedy"]))
    identical = src["greedy"] == got["greedy"]
    must = stored in GREEDY_MUST_MATCH
    checks.append({"name": "greedy", "ok": identical or not must, "identical": identical,
                   "agreement": same / max(total, 1), "required": must,
                   "detail": f"greedy continuation: {same}/{total} tokens agree"
                             + ("" if must else " (reported, not required for this type)")})
    checks.extend(_tokenizer_checks(src, got, expected))
    stop = set(expected["stop_ids"])
    if kind == "safetensors":
        eos = set(got["eos_ids"])
        checks.append({"name": "eos", "ok": stop <= eos, "generation_config_eos": sorted(eos),
                       "detail": f"generation_config.json eos_token_id {sorted(eos)} includes the end-of-turn ids {sorted(stop)}"
                       if stop <= eos else f"generation_config.json eos_token_id {sorted(eos)} misses {sorted(stop - eos)}"})
        shards = got["shards"]
        checks.append({"name": "shards", "ok": len(shards) >= 1, "files": shards,
                       "detail": f"{len(shards)} safetensors file(s)"})
    else:
        meta = got["gguf"]
        template_ok = meta.get("tokenizer.chat_template") == expected["chat_template"]
        checks.append({"name": "gguf_chat_template", "ok": template_ok,
                       "detail": "tokenizer.chat_template holds the training template" if template_ok
                       else "tokenizer.chat_template differs from the training template"})
        eog = {meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")} - {None}
        eos_ok = bool(eog & stop) if stop else bool(eog)
        checks.append({"name": "gguf_eos", "ok": eos_ok,
                       "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
                       "eot_token_id": meta.get("tokenizer.ggml.eot_token_id"),
                       "detail": f"GGUF eos {meta.get('tokenizer.ggml.eos_token_id')}, eot "
                                 f"{meta.get('tokenizer.ggml.eot_token_id')}; end-of-turn ids {sorted(stop)}"
                                 + ("" if eos_ok else ": none of them is the GGUF's eos/eot")})
    return checks


def _adapter_merged_quantized(effect: float, diff: float, vs_base: float, stored: str) -> dict:
    """adapter_merged for a k-quant, which has no logit tolerance: the export must lie clearly nearer base+adapter
    than the base (an export that holds the base is the other way round); where the quantization moves the logits
    about as far as the adapter does, the check cannot tell, and says so."""
    figures = {"name": "adapter_merged", "adapter_effect": effect, "export_vs_base": vs_base, "export_vs_source": diff}
    said = (f"the adapter moves logits by up to {effect:.3g}; the {stored} export (through transformers' dequantizing "
            f"loader) is {diff:.3g} from base+adapter and {vs_base:.3g} from the base")
    if diff < vs_base / 2:
        return {**figures, "ok": True, "detail": said}
    if vs_base < diff / 2:
        return {**figures, "ok": False, "detail": said + ": it answers like the base, the adapter is not in it"}
    return {**figures, "ok": True, "required": False, "undecided": True,
            "detail": said + f": the {stored} rounding moves the logits about as far as the adapter does, so this "
                             "check cannot tell a merged export from the base"}


def _tokenizer_checks(src: dict, got: dict, expected: dict) -> list[dict]:
    """The exported chat template renders the probes as the training template; the exported tokenizer splits
    them into the same ids."""
    renders_ok = got["renders"] == expected["rendered"]
    bad = [i for i, (a, b) in enumerate(zip(got["renders"], expected["rendered"])) if a != b]
    ids_ok = got["ids"] == src["prompts"]
    return [{"name": "chat_template", "ok": renders_ok,
             "detail": "the exported chat template renders every probe conversation exactly as the training "
                       "template" if renders_ok else
                       f"probe {bad[0]} renders as {got['renders'][bad[0]]!r}, expected {expected['rendered'][bad[0]]!r}"},
            {"name": "tokenizer", "ok": ids_ok,
             "detail": "the exported tokenizer gives the same token ids for the rendered prompts" if ids_ok
             else "the exported tokenizer splits the rendered prompts differently"}]


def compare_reward(src: dict, got: dict, *, stored: str, expected: dict) -> list[dict]:
    """The checks of a reward model export: its scores of the probe pairs against base+adapter's, each
    pair ranked the same way, a one-output score head that knows the pad token, tokenizer and template."""
    want, have = src["scores"], got["scores"]
    scale = max(abs(x) for pair in want for x in pair)
    floor, frac = LOGIT_TOL[stored]
    tol = max(floor, frac * scale)
    diff = max(abs(a - b) for p, q in zip(want, have) for a, b in zip(p, q)) if len(want) == len(have) else float("inf")
    checks = [{"name": "scores", "ok": diff <= tol, "max_abs_diff": diff, "tolerance": tol, "max_abs_score": scale,
               "pairs": len(want), "source_scores": [list(p) for p in want], "export_scores": [list(p) for p in have],
               "detail": f"max |export - (base+adapter)| score difference {diff:.3g} over {len(want)} chosen / "
                         f"rejected pairs (tolerance {tol:.3g})"}]
    same = sum((c1 > r1) == (c2 > r2) for (c1, r1), (c2, r2) in zip(want, have))
    must = stored in GREEDY_MUST_MATCH
    checks.append({"name": "ranking", "ok": same == len(want) or not must, "agreement": same / max(len(want), 1),
                   "required": must,
                   "detail": f"{same}/{len(want)} pairs ranked (chosen vs rejected) as by base+adapter"
                             + ("" if must else " (reported, not required for this type)")})
    head_ok = (got["architecture"].endswith("ForSequenceClassification") and got["num_labels"] == 1
               and got["pad_token_id"] is not None and got["pad_token_id"] == got["tokenizer_pad_id"])
    checks.append({"name": "score_head", "ok": head_ok, "architecture": got["architecture"],
                   "num_labels": got["num_labels"], "pad_token_id": got["pad_token_id"],
                   "detail": f"{got['architecture']} with {got['num_labels']} output(s), config pad_token_id "
                             f"{got['pad_token_id']} (tokenizer's: {got['tokenizer_pad_id']}; the score is read at "
                             "the last non-pad token)"})
    checks.extend(_tokenizer_checks(src, got, expected))
    checks.append({"name": "shards", "ok": len(got["shards"]) >= 1, "files": got["shards"],
                   "detail": f"{len(got['shards'])} safetensors file(s)"})
    return checks


# ============================================================================ the export
def export(spec) -> dict:
    """Run the export; return the report (also written to export_dir). Raises ExportError for a refused
    request; a failed check is report["ok"] == False."""
    started = time.time()
    warnings: list[str] = []

    def warn(message: str) -> None:
        warnings.append(message)
        print(f"warning: {message}", flush=True)

    _say(1, "checking the request")
    check_request(spec)
    resolved = resolve_model(spec.model_name_or_path)
    folder = model_folder(resolved)
    adapters = _adapters(spec)
    for adapter in adapters:
        check_adapter_base(adapter, resolved, spec.model_name_or_path, folder)
    # a run folder whose adapter is one of its checkpoints (tuneboard promote): the log and report say which
    promoted = {str(a): c for a in [folder, *adapters] if (c := promoted_checkpoint(a))}
    for adapter, checkpoint in promoted.items():
        print(f"adapter {adapter}: its promoted {checkpoint} (promotion.json)", flush=True)
    kind = spec.export_format
    if spec.quantization_bit is not None:
        warn(f"quantization_bit {spec.quantization_bit} ignored: adapters are merged into a full-precision reload")

    if is_reward_model_dir(adapters[-1] if adapters else folder):  # stage rm's output: a score head, no LM head
        return _export_reward_model(spec, resolved, folder, adapters, warn, warnings, started)

    _say(2, f"loading {resolved.model_id} in float32 from {folder}")
    tokenizer = load_tokenizer(resolved, new_special_tokens=getattr(spec, "new_special_tokens", None))
    template = _template(spec, resolved, tokenizer, adapters, warn)
    device = _device(spec)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **_config(spec, folder, warn))
    model = model.to(device).eval()
    if getattr(spec, "resize_vocab", False) or getattr(spec, "new_special_tokens", None):
        resize_vocab(model, spec, resolved, warn)  # the shapes the adapter was trained with
    if kind == "gguf":
        check_supported(model.config)
        vocab_metadata(tokenizer, model.config.vocab_size)  # refuse unsupported tokenizers before merging
    chat_template = chat_template_for(template, tokenizer)
    rendered = [template.render_text(m, add_generation_prompt=True) for m in PROBE_CONVERSATIONS]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in rendered]
    stop_ids = stop_token_ids(tokenizer, template)

    _say(3, f"reference outputs: base{' + ' + str(len(adapters)) + ' adapter(s)' if adapters else ''} "
            f"on {len(prompts)} prompts")
    src: dict = {"prompts": prompts}
    if adapters:
        src["base_logits"] = logits(model, prompts)
        for i, adapter in enumerate(adapters):
            model = PeftModel.from_pretrained(model, str(adapter))
            if i < len(adapters) - 1:
                model = model.merge_and_unload()
        model.eval()
    src["logits"] = logits(model, prompts)
    src["greedy"] = greedy(model, prompts, stop_ids, tokenizer.pad_token_id)
    if kind == "gguf" and llamacpp.available():  # what llama.cpp's top tokens along these answers are measured by
        # the answers as llama.cpp's greedy loop gives them: without the end-of-turn id generate() appends
        src["answers"] = [a[:-1] if a and a[-1] in stop_ids else a for a in src["greedy"]]
        src["forced"] = [lp.numpy() for lp in forced_logprobs(model, prompts, src["answers"])]
    if adapters:
        src["adapter_effect"] = _max_abs(src["base_logits"], src["logits"])
        if src["adapter_effect"] < 1e-6:
            warn("the adapter does not change the model's outputs (an untrained adapter?)")
        model = model.merge_and_unload()

    final = Path(spec.export_dir).expanduser().resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    out = _staging_dir(final)  # written and verified here, then put in final's place
    files: list[str] = []
    source_info = {"model": spec.model_name_or_path, "model_folder": str(folder), "adapters": [str(a) for a in adapters],
                   "template": template.name, "stop_words": list(template.stop_words), "stop_ids": stop_ids}
    if spec.default_system:  # in the exported chat template (and the Modelfile's SYSTEM), as chat adds it
        source_info["default_system"] = spec.default_system
    if spec.rope_scaling:  # in the exported config.json, as training and chat load the model
        source_info["rope_scaling"] = spec.rope_scaling
    if promoted:
        source_info["promoted"] = promoted
    if weights_note(spec.model_name_or_path):  # a user comparing with the original weights must know
        source_info["weights"] = weights_note(spec.model_name_or_path)
    if kind == "safetensors":
        save_dtype = _save_dtype(spec, folder)
        stored = str(save_dtype).replace("torch.", "")
        shard = int(spec.export_size * 10**9)
        _say(4, f"writing safetensors ({stored}, shards up to {spec.export_size:g} GB) for {final}")
        model = model.to(save_dtype)
        model.config._name_or_path = str(final)
        gen = model.generation_config
        gen.eos_token_id = stop_ids if len(stop_ids) != 1 else stop_ids[0]
        if tokenizer.pad_token_id is not None:
            gen.pad_token_id = tokenizer.pad_token_id
        if tokenizer.bos_token_id is not None:
            gen.bos_token_id = tokenizer.bos_token_id
        model.save_pretrained(out, max_shard_size=shard)
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(out)
        request_extra: dict = {"dtype": stored}
    else:
        stored = spec.export_gguf_type
        name = f"{spec.model_short_name()}-{stored}.gguf"
        eot = next((i for i in stop_ids if i != tokenizer.eos_token_id), None)
        # the f16 file llama.cpp quantizes (a k-quant) and measures the export against; not shipped
        reference = out / REFERENCE_F16 if stored in llamacpp.QUANT_TYPES or (
            stored != "f16" and llamacpp.available()) else None
        write_kw = dict(chat_template=chat_template, eot_token_id=eot, name=spec.model_short_name(),
                        log=lambda m: print(f"  {m}", flush=True))
        if reference is not None:
            _say(4, f"writing the f16 GGUF for llama.cpp{' to quantize' if stored in llamacpp.QUANT_TYPES else ''}")
            gguf_info = write_gguf(reference, model.state_dict(), model.config, tokenizer, gguf_type="f16", **write_kw)
        if stored in llamacpp.QUANT_TYPES:
            weights = None
            if spec.export_imatrix:
                calibration = imatrix.calibration_rows(template, tokenizer)
                _say(4, f"importance matrix: the merged model reads {len(calibration)} held-out rows "
                        f"({sum(map(len, calibration))} tokens)")
                weights = out / IMATRIX_TMP
                imatrix.save(weights, imatrix.compute(model, calibration))
            _say(4, f"quantizing to {stored} with llama.cpp{' and the importance matrix' if weights else ''} "
                    f"for {final / name}")
            source = f"data/{imatrix.CALIBRATION_FILE.name} ({len(calibration)} rows)" if weights else ""
            try:
                entries = llamacpp_check.quantize(reference, out / name, stored, imatrix=weights, dataset=source)
            except llamacpp_check.LlamaCppError as exc:
                shutil.rmtree(out, ignore_errors=True)
                raise ExportError(f"export_gguf_type {stored}: llama.cpp's quantizer failed: {exc}") from None
            gguf_info = dict(gguf_info, gguf_type=stored, quantized_by="llama.cpp (llama_model_quantize) from f16")
            if weights is not None:
                weights.unlink(missing_ok=True)
                gguf_info["imatrix"] = {"rows": len(calibration), "tokens": sum(map(len, calibration)),
                                        "weights": entries, "source": f"data/{imatrix.CALIBRATION_FILE.name} "
                                        f"(first {len(calibration)} rows, training template; not the checks' rows)",
                                        "metadata": {"quantize.imatrix.entries_count": entries,
                                                     "quantize.imatrix.dataset": source}}
        else:
            _say(4, f"writing GGUF ({stored}) for {final / name}")
            gguf_info = write_gguf(out / name, model.state_dict(), model.config, tokenizer, gguf_type=stored,
                                   **write_kw)
        source_info["gguf"] = gguf_info
        try:
            pieces = derive_pieces(template, tokenizer)
            modelfile_problems = check_pieces(pieces, template)
            (out / MODELFILE).write_text(modelfile_text(name, pieces, list(template.stop_words)), encoding="utf-8")
            source_info["modelfile_pieces"] = pieces_dict(pieces)
        except TemplateError as exc:
            modelfile_problems = [f"cannot express the chat template as an Ollama template: {exc}"]
        request_extra = {"gguf_file": name, "dtype": "float32"}
    ppl_rows = []
    if kind == "gguf" and llamacpp.available():  # held-out rows for llama.cpp's perplexity of their answers
        ppl_rows = perplexity_rows(template, tokenizer)
    del model
    files = sorted(p.name for p in out.iterdir() if p.name != REFERENCE_F16)

    _say(5, "verifying: reloading the export in a fresh process")
    expected = {"rendered": rendered, "stop_ids": stop_ids, "chat_template": chat_template}
    request = {"dir": str(out), "device": device, "prompts": prompts, "stop_ids": stop_ids,
               "conversations": PROBE_CONVERSATIONS, "rendered": rendered, **request_extra}
    try:
        got = _run_verifier(request, print)
        checks = compare(src, got, kind=kind, stored=stored, expected=expected)
    except RuntimeError as exc:
        checks = [{"name": "reload", "ok": False, "detail": str(exc)}]
    if kind == "gguf":
        checks.append({"name": "modelfile", "ok": not modelfile_problems,
                       "detail": "the Modelfile's TEMPLATE renders the probe conversations like the training template, "
                                 f"with PARAMETER stop for {list(template.stop_words)}" if not modelfile_problems
                       else "; ".join(modelfile_problems)})
        llamacpp_row = None
        if llamacpp.available():
            _say(5, f"verifying in llama.cpp: {name}{' against the f16 file' if reference else ''}")
            found, llamacpp_row = llamacpp_check.verify(
                out / name, reference, stored, rows=ppl_rows, prompts=prompts, rendered=rendered,
                greedy=src["answers"], forced=src["forced"], stop_ids=stop_ids, chat_template=chat_template,
                max_new_tokens=GREEDY_TOKENS, warn=warn)
            weighted = gguf_info.get("imatrix")
            for c in found:
                if c["name"] == "llamacpp_load" and c["ok"] and weighted:  # the Export tab's table says how it was made
                    c["imatrix_rows"], c["imatrix_tokens"] = weighted["rows"], weighted["tokens"]
                    c["detail"] += (f"; quantized with an importance matrix of {weighted['weights']} weights from "
                                    f"{weighted['rows']} held-out rows ({weighted['tokens']} tokens)")
            checks.extend(found)
            said = next((c["greedy"] for c in found if c["name"] == "llamacpp_greedy"), None)
            if said is not None:  # the probe answers side by side, as text, for the report's reader
                llamacpp_row["answers"] = [{"probe": i, "prompt": c[-1]["content"],
                                            "source": tokenizer.decode(a, skip_special_tokens=True),
                                            "llamacpp": tokenizer.decode(b, skip_special_tokens=True),
                                            "source_ids": a, "llamacpp_ids": b}
                                           for i, (c, a, b) in enumerate(zip(PROBE_CONVERSATIONS, src["answers"], said))]
        else:
            warn("not checked in llama.cpp (llama-cpp-python is not installed): " + llamacpp.HOW_TO_GET)
        if reference is not None:
            reference.unlink(missing_ok=True)
        if llamacpp_row:
            source_info["llamacpp"] = llamacpp_row

    return _conclude(out, final, checks, {"format": kind, "stored_as": stored, "files": files,
                                          "source": source_info, "warnings": warnings}, started)


def _conclude(out: Path, final: Path, checks: list[dict], report: dict, started: float) -> dict:
    """Write the report into the verified staging folder, put it in export_dir's place (or beside it as
    .failed), print the checks; return the report."""
    ok = all(c["ok"] for c in checks)
    where = final if ok or _is_empty_dir(final) else final.parent / f"{final.name}.failed"
    report = {"ok": ok, "format": report.pop("format"), "stored_as": report.pop("stored_as"),
              "export_dir": str(where), **report, "checks": checks, "seconds": round(time.time() - started, 1)}
    _write_report(out, report)
    where = _put_in_place(out, final, ok)
    _say(6, f"report: {where / REPORT_FILE}")
    for c in checks:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}", flush=True)
    return report


def _export_reward_model(spec, resolved, folder: Path, adapters: list[Path], warn, warnings: list[str],
                         started: float) -> dict:
    """Steps 2-6 for a reward model: base with a one-output score head (+ the rm adapter, whose
    modules_to_save hold the trained head) -> scores of the probe pairs -> merge -> safetensors -> reload
    as AutoModelForSequenceClassification in a fresh process -> compare scores -> report."""
    _say(2, f"loading {resolved.model_id} with a one-output score head in float32 from {folder}")
    tokenizer = load_tokenizer(resolved, new_special_tokens=getattr(spec, "new_special_tokens", None))
    template = _template(spec, resolved, tokenizer, adapters, warn)
    device = _device(spec)
    # a causal LM base gets a new (random) head here: the adapter's modules_to_save replace it below
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, num_labels=1,
                                                               **_config(spec, folder, warn))
    model = model.to(device).eval()
    if getattr(spec, "resize_vocab", False) or getattr(spec, "new_special_tokens", None):
        resize_vocab(model, spec, resolved, warn)
    set_pad_token(model, tokenizer)
    chat_template = chat_template_for(template, tokenizer)
    rendered = [template.render_text(m, add_generation_prompt=True) for m in PROBE_CONVERSATIONS]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in rendered]
    rows, _ = build_preference_dataset(PROBE_PAIRS, template, tokenizer, None)

    _say(3, f"reference scores: base{' + ' + str(len(adapters)) + ' adapter(s)' if adapters else ''} "
            f"on {len(rows)} chosen / rejected pairs")
    for i, adapter in enumerate(adapters):
        model = PeftModel.from_pretrained(model, str(adapter))
        if i < len(adapters) - 1:
            model = model.merge_and_unload()
    model.eval()
    src = {"prompts": prompts, "scores": score_pairs(model, tokenizer, rows, batch_size=len(rows))}
    if adapters:
        model = model.merge_and_unload()

    final = Path(spec.export_dir).expanduser().resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    out = _staging_dir(final)
    save_dtype = _save_dtype(spec, folder)
    stored = str(save_dtype).replace("torch.", "")
    _say(4, f"writing safetensors ({stored}, shards up to {spec.export_size:g} GB) of the reward model "
            f"({type(model).__name__}) for {final}")
    model = model.to(save_dtype)
    model.config._name_or_path = str(final)
    model.save_pretrained(out, max_shard_size=int(spec.export_size * 10**9))
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)
    del model
    files = sorted(p.name for p in out.iterdir())

    _say(5, "verifying: reloading the export as a sequence classifier in a fresh process")
    expected = {"rendered": rendered}
    request = {"reward": True, "dir": str(out), "device": device, "dtype": stored, "rows": rows,
               "conversations": PROBE_CONVERSATIONS, "rendered": rendered}
    try:
        checks = compare_reward(src, _run_verifier(request, print), stored=stored, expected=expected)
    except RuntimeError as exc:
        checks = [{"name": "reload", "ok": False, "detail": str(exc)}]
    source_info = {"model": spec.model_name_or_path, "model_folder": str(folder),
                   "adapters": [str(a) for a in adapters], "template": template.name, "reward_model": True}
    return _conclude(out, final, checks, {"format": "safetensors", "stored_as": stored, "files": files,
                                          "source": source_info, "warnings": warnings}, started)


def _remove_partials(spec) -> None:
    out = Path(spec.export_dir).expanduser().resolve()
    shutil.rmtree(out.parent / f".{out.name}.partial-{os.getpid()}", ignore_errors=True)


def _write_report(out: Path, report: dict) -> None:
    write_json_atomic(out / REPORT_FILE, report)


# ============================================================================ CLI
def main(args: list[str]) -> int:
    """`tuneboard export SPEC.yaml [key=value ...]`; exit 0 only when every check passed."""
    if not args or args[0] in ("-h", "--help"):
        print("usage: tuneboard export SPEC.yaml [key=value ...]\n\n"
              "keys: model_name_or_path, adapter_name_or_path, template, finetuning_type, export_dir, export_size (GB "
              "per shard), export_device, export_legacy_format, export_format (safetensors|gguf), export_gguf_type "
              "(f16|q8_0|f32|bf16; with llama.cpp: q4_k_m|q5_k_m|q6_k|q4_0), export_imatrix (those with an importance "
              "matrix), export_overwrite, infer_dtype\nwrites export_dir/export_report.json; exit 1 when a "
              "check fails")
        return 0 if args else 2

    spec = load_or_report(args)
    if spec is None:
        return 1
    _abort_on_signals()
    try:
        report = export(spec)
    except ExportAborted as exc:
        _remove_partials(spec)
        print(f"export ABORTED ({exc}): nothing was written to export_dir; an earlier export there is untouched",
              flush=True)
        return 130
    except ExportError as exc:
        print(f"export FAILED: {exc}", flush=True)  # the one line (the Export tab reads it too)
        return 1
    except OSError as exc:  # a folder that cannot be made or written (a full disk, permissions): one line naming it
        print(f"export FAILED: {exc.filename}: {exc.strerror}" if exc.filename and exc.strerror
              else f"export FAILED: {exc}", flush=True)
        return 1
    except Exception as exc:  # GGUF/template refusals and load errors: one clear line
        if isinstance(exc, (GGUFExportError, ValueError, FileNotFoundError, NotImplementedError)):
            print(f"export FAILED: {exc}", flush=True)
            return 1
        raise
    if not report["ok"] and report["export_dir"] != str(Path(spec.export_dir).expanduser().resolve()):
        print(f"the earlier export in {spec.export_dir} was kept; this one is in {report['export_dir']}", flush=True)
    if report["ok"]:
        print(f"export PASSED: {report['export_dir']} ({', '.join(report['files'])})", flush=True)
        return 0
    failed = [c for c in report["checks"] if not c["ok"]]
    print("export FAILED verification: " + "; ".join(f"{c['name']}: {c['detail']}" for c in failed), flush=True)
    print(f"error: the export in {report['export_dir']} does not match its source; see {REPORT_FILE}",
          file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
