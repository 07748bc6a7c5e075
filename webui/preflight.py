"""Pre-flight memory estimate: will this run fit the machine? A rough, documented formula (no model is
loaded in the UI process): parameters from the model name (e.g. "135M", "7B") or the registry, bytes per
weight from the quantization, trainable-state bytes from the method, activations from batch x cutoff.
Preference stages add what they hold besides: a frozen reference model copy where one is used, and the
chosen + rejected sequences of a pairwise stage (twice the batch through the model). Stage kd adds its frozen
teacher (at teacher_quantization_bit) and the full-vocabulary logits of student and teacher (teacher_bytes). A
reward model named in reward_funcs (grpo, rloo) adds its frozen weights (reward_model_bytes).

Constants measured (issue 10), on the guide's recipe (examples/sft_qlora_extraction.yaml: the default 135M model,
QLoRA 4-bit, cutoff 4096 packed, batch 4, GA 4, plain checkpointing) on this 2-core CPU: `tuneboard probe`'s
training process held 1,005 MiB RSS when training began (Python, torch, transformers, bitsandbytes, the tokenized
rows; 159 MiB of it the frozen weights): RUNTIME_BYTES. The whole recipe (3 optimizer steps of 3 micro-batches
of up to 4 x 4096 packed tokens, 123,912 tokens, jemalloc keeping freed pages) ran to the end in 11 min 28 s on a
quiet machine, 2026-12-01, with a peak RSS of 5,120 MiB (/usr/bin/time); this formula says 5,661 MiB (+11%).
The old formula said 2,706 MiB (no runtime, checkpointing keeping 1/8 of the activations). Runs without
checkpointing are unchanged but for the runtime. The formula stays a guess: the Train tab's "Measure memory"
(tuneboard probe, backend/training/probe.py) measures the exact spec."""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

import psutil
import yaml

from backend import stages
from backend.core import checkpointing, launch
from backend.core.atomic import write_text_atomic
from backend.core.methods import METHODS, is_adapter
from backend.core.precision import bf16_default_applies, native_bf16_cpu
from backend.core.paths import DEFAULT_MODEL_ID
from backend.core.rewards import is_model_name, split_names
from backend.core.spec import RunSpec
from backend.stages import uses_reference
from webui.i18n import tr
from backend.core.rundir import PROBE_RESULT_FILE, PHASE_TRAINING, RUNNING_LOG, SPEC_FILE
from webui import jobs, tools, live
from backend.core.curves import step_seconds
import time
from backend.core import paths
import html as _html

KNOWN_PARAMS = {DEFAULT_MODEL_ID.lower(): 135e6}
RUNTIME_BYTES = 850 * 2 ** 20  # one training process before its first step, less the weights (measured, see above)
CHECKPOINTED_SHARE = 1 / 4.4  # activations kept with gradient checkpointing (was 1/8; measured, see above)
# The spec fields the estimate reads: the Train tab refreshes it when one of them changes.
FIELDS = ("model_name_or_path", "finetuning_type", "quantization_bit", "stage", "pref_loss", "ref_model",
          "per_device_train_batch_size", "cutoff_len", "gradient_checkpointing", "bf16", "fp16",
          "nproc_per_node", "nnodes", "deepspeed", "eval_metric", "eval_samples", "max_steps",
          "save_steps", "save_strategy", "teacher_model_name_or_path", "teacher_quantization_bit", "use_dora", "pure_bf16")


def _checkpointing(flat: dict) -> bool:
    """Gradient checkpointing as the run will have it: unset = on (LLaMA-Factory's default, the spec's too)."""
    return flat.get("gradient_checkpointing") is not False and not flat.get("disable_gradient_checkpointing")


def param_count(model: str) -> float | None:
    name = (model or "").lower()
    for key, n in KNOWN_PARAMS.items():
        if key.split("/")[-1] in name:
            return n
    m = re.search(r"(\d+(?:\.\d+)?)\s*([bm])(?![a-z])", name.split("/")[-1])
    if not m:
        return None
    return float(m.group(1)) * (1e9 if m.group(2) == "b" else 1e6)


def reference_copy(flat: dict) -> bool:
    """Whether the run loads a second, frozen model as its reference: DPO/KTO-style stages do, unless the
    loss needs none (ORPO, SimPO) or LoRA trains without ref_model (the reference is then the same base
    weights with the adapter switched off: no copy)."""
    try:
        if not uses_reference(flat.get("stage") or "sft", flat.get("pref_loss")):
            return False
    except KeyError:
        return False
    return bool(flat.get("ref_model")) or not is_adapter(flat.get("finetuning_type"))


TEACHER_LOGIT_COPIES = 6  # kd: student and teacher logits, both log-softmaxes, the divergence, its gradient
DEFAULT_VOCAB = 50_000  # tokens per logit row when the model folder's config.json does not say


def teacher_bytes(flat: dict, n: float, half: bool) -> tuple[float, float]:
    """(teacher weights, logits) of a stage that distils from a teacher (stage kd): the frozen teacher at its
    teacher_quantization_bit, and the full-vocabulary logits of student and teacher over the batch (no chunked
    loss: the divergence needs every token's probability). (0, 0) for the other stages."""
    try:
        if "teacher_model_name_or_path" not in stages.get_stage(flat.get("stage") or "sft").fields:
            return 0.0, 0.0
    except KeyError:
        return 0.0, 0.0
    teacher = flat.get("teacher_model_name_or_path") or ""
    weight_b = {4: 0.55, 8: 1.05}.get(flat.get("teacher_quantization_bit"), 2.0 if half else 4.0)
    weights = (param_count(teacher) or n) * weight_b
    tokens = (flat.get("per_device_train_batch_size") or 1) * (flat.get("cutoff_len") or 1024)
    return weights, tokens * _vocab(flat.get("model_name_or_path") or "") * 4 * TEACHER_LOGIT_COPIES


def _vocab(model: str) -> int:
    """vocab_size from a local model folder's config.json, else DEFAULT_VOCAB (no model is loaded here)."""
    try:
        return int(json.loads((Path(model).expanduser() / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_VOCAB


def reward_model_bytes(flat: dict) -> float:
    """The frozen reward models in reward_funcs (each loaded once beside the policy, no gradients): the parameters
    in the folder's safetensors headers (an rm run's adapter: plus its base's, run_spec.yaml's
    model_name_or_path; a base that is no local folder counts by its name) at 2 bytes with bf16/fp16, else 4."""
    total = 0.0
    for name in split_names(flat.get("reward_funcs")):
        folder = Path(name).expanduser()
        if not is_model_name(name) or not folder.is_dir():
            continue
        params = _safetensors_params(folder)
        if (folder / "adapter_config.json").is_file():
            try:
                base = str(yaml.safe_load((folder / SPEC_FILE).read_text(encoding="utf-8"))["model_name_or_path"])
            except (OSError, yaml.YAMLError, KeyError, TypeError):
                base = ""
            params += _safetensors_params(Path(base).expanduser()) or param_count(base) or 0
        total += params * (2 if flat.get("bf16") or flat.get("fp16") else 4)
    return total


def _safetensors_params(folder: Path) -> int:
    """The parameter count in a folder's *.safetensors files, from their headers alone (0 where there are none)."""
    count = 0
    for path in folder.glob("*.safetensors") if folder.is_dir() else ():
        try:
            with path.open("rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except (OSError, ValueError):
            continue
        for key, tensor in header.items():
            if key != "__metadata__":
                n = 1
                for dim in tensor.get("shape", ()):
                    n *= dim
                count += n
    return count


def pairwise(flat: dict) -> bool:
    """Whether each row is a chosen + rejected pair (both go through the model: the batch doubles)."""
    return stages.pairwise(flat.get("stage"))


def layout(flat: dict) -> tuple[int, int, int | None]:
    """(processes on this machine, world size, ZeRO stage or None) of the form's distribution settings."""
    value = flat.get("nproc_per_node") or "auto"
    try:
        local = max(1, launch.visible_accelerators()) if value == "auto" else max(1, int(value))
    except (TypeError, ValueError):
        local = 1
    nodes = flat.get("nnodes") if isinstance(flat.get("nnodes"), int) and flat.get("nnodes") > 0 else 1
    return local, local * nodes, launch.config_zero_stage(flat.get("deepspeed"))


def shard(weights: float, state: float, world: int, stage: int | None) -> tuple[float, float]:
    """Weights and trainable state held by ONE process under ZeRO: the 16 bytes of state per trainable
    parameter are 4 (fp32 master weight) + 4 (gradient) + 8 (Adam moments); ZeRO-1 splits the moments over the
    processes, ZeRO-2 the gradients too, ZeRO-3 the weights as well. DDP (no ZeRO) copies everything."""
    if not stage or world < 2:
        return weights, state
    if stage == 1:
        return weights, state * (8 + 8 / world) / 16
    if stage == 2:
        return weights, state * (4 + 12 / world) / 16
    return weights / world, state / world


def _half(flat: dict) -> bool:
    """The run holds its frozen weights and activations in 16 bits: bf16 / fp16 asked, or bf16 left unset where the
    training process turns it on (backend.core.precision: LoRA SFT / PT on a CPU with native bf16 matmul)."""
    return bool(flat.get("bf16") or flat.get("fp16")) or (
        bf16_default_applies(flat) and not launch.visible_accelerators() and native_bf16_cpu())


def estimate(flat: dict) -> dict:
    """Bytes needed, by part. Full fine-tuning keeps fp32 weights + grads + 2 Adam moments (16 B/param);
    LoRA/freeze keep frozen weights at their dtype and ~1-5% trainable state; activations ~ batch x
    cutoff x hidden x layers, approximated from the parameter count."""
    n = param_count(flat.get("model_name_or_path", ""))
    if n is None:
        return {"known": False}
    qbit = flat.get("quantization_bit")
    half = _half(flat)
    weight_b = {4: 0.55, 8: 1.05}.get(qbit, 2.0 if half else 4.0)
    trainable = METHODS.get(flat.get("finetuning_type") or "lora", METHODS["full"]).trainable_share
    weights = n * weight_b
    state = n * trainable * 16
    hidden = max(512.0, (n / 1e6) ** 0.5 * 60)
    pairs = pairwise(flat)
    tokens = (flat.get("per_device_train_batch_size") or 1) * (flat.get("cutoff_len") or 1024) * (2 if pairs else 1)
    layers = max(12.0, n / 12 / hidden ** 2)
    local, world, stage = layout(flat)
    acts = tokens * hidden * layers * 34 * (2 if half else 4) * (CHECKPOINTED_SHARE if _checkpointing(flat) else 1)
    if _checkpointing(flat) and not checkpointing.made_reentrant(flat.get("stage") or "sft", flat.get("finetuning_type"),
                                                                 stage):
        # selective checkpointing keeps more where it fits (the training process's rule)
        extra = checkpointing.extra_bytes(tokens, hidden, layers, 2 if half else 4)
        if checkpointing.decide(extra, psutil.virtual_memory().available)[0]:
            acts += extra
    reference = 0.0
    if reference_copy(flat):
        reference = (param_count(flat.get("ref_model") or "") or n) * weight_b  # frozen: weights only
    teacher, logits = teacher_bytes(flat, n, half)
    rewards = reward_model_bytes(flat)
    acts += logits
    weights, state = shard(weights, state, world, stage)
    per_process = RUNTIME_BYTES + (weights + state + acts + reference + teacher + rewards) * 1.2
    # On a CPU every local process takes its share of the same RAM; a GPU process holds it on its own device.
    total = per_process * (local if not launch.visible_accelerators() else 1)
    return {"known": True, "params": n, "weights": weights, "state": state, "activations": acts,
            "reference": reference, "teacher": teacher, "reward_models": rewards, "pairs": pairs, "total": total, "per_process": per_process,
            "processes": local, "world": world, "zero_stage": stage,
            "available": psutil.virtual_memory().available, "machine": psutil.virtual_memory().total}


def summary_md(flat: dict, lang: str = "en") -> str:
    e = estimate(flat)
    if not e["known"]:
        return tr(lang, "pf.unknown")
    gib = 1024 ** 3
    fits = e["total"] < e["available"]
    cls = "tb-mem-ok" if fits else "tb-mem-warn"
    verdict = tr(lang, "pf.fits" if fits else "pf.not_fit")
    extra = tr(lang, "pf.reference", gib=f'{e["reference"] / gib:.1f}') if e["reference"] else ""
    extra += tr(lang, "pf.teacher", gib=f'{e["teacher"] / gib:.1f}') if e["teacher"] else ""
    extra += tr(lang, "pf.reward_models", gib=f'{e["reward_models"] / gib:.1f}') if e["reward_models"] else ""
    pairs = tr(lang, "pf.pairs") if e["pairs"] else ""
    split = ""
    if e["world"] > 1:
        what = {None: "pf.ddp", 0: "pf.zero0", 1: "pf.zero1", 2: "pf.zero2", 3: "pf.zero3"}.get(e["zero_stage"])
        split = tr(lang, "pf.split", gib=f'{e["per_process"] / gib:.1f}', here=e["processes"], world=e["world"],
                   what=tr(lang, what) if what else "")
    text = tr(lang, "pf.estimate", total=f'{e["total"] / gib:.1f}', params=f'{e["params"] / 1e6:.0f}',
              weights=f'{e["weights"] / gib:.1f}', state=f'{e["state"] / gib:.1f}',
              acts=f'{e["activations"] / gib:.1f}', more=pairs + extra + split,
              free=f'{e["available"] / gib:.1f}', machine=f'{e["machine"] / gib:.1f}', verdict=verdict)
    return f'<span class="{cls}">{text}</span>' + scoring_md(flat, lang)


def scoring_cost(flat: dict) -> dict | None:
    """What eval_metric adds (backend/evaluation/task_metric.py): at each save, eval_samples held-out rows, each answered with
    up to max_new_tokens greedy tokens (fewer where the references are short: backend/evaluation/task_metric.py), or one
    forward pass over them for eval_loss; saves = max_steps // save_steps when both are known (None: per save only)."""
    metric = flat.get("eval_metric")
    if not metric or flat.get("save_strategy") == "no":
        return None
    samples = int(flat.get("eval_samples") or 32)
    tokens = int(flat.get("max_new_tokens") or RunSpec.model_fields["max_new_tokens"].default) if metric != "eval_loss" else 0
    steps, every = int(flat.get("max_steps") or 0), int(flat.get("save_steps") or 0)
    saves = steps // every if steps > 0 and every >= 1 and flat.get("save_strategy", "steps") == "steps" else None
    return {"metric": metric, "samples": samples, "tokens": tokens, "saves": saves,
            "total_tokens": samples * tokens * (saves or 1)}


def scoring_md(flat: dict, lang: str = "en") -> str:
    """The pre-flight line for eval_metric's cost, or ''."""
    cost = scoring_cost(flat)
    if cost is None:
        return ""
    saves = tr(lang, "pf.scoring_saves", saves=cost["saves"]) if cost["saves"] else tr(lang, "pf.scoring_each")
    if cost["metric"] == "eval_loss":
        return "<br>" + tr(lang, "pf.scoring_loss", samples=cost["samples"], saves=saves)
    return "<br>" + tr(lang, "pf.scoring", metric=cost["metric"], samples=cost["samples"], tokens=cost["tokens"],
                       saves=saves, total=f'{cost["total_tokens"]:,}')


# ------------------------------------------------------------------ the measured pre-flight (tuneboard probe)
# The formula above is a guess; `tuneboard probe` (backend/training/probe.py) trains the exact spec for 2 steps with its
# longest rows first in a subprocess and measures. Here it runs as a background job like Export / Evaluate
# (saves/.tools/probe-<time>/, webui/tools.py); the tab polls the JSON it writes. No torch in this process.

UNSURE_SHARE = 0.7  # above this share of the free memory, the formula is not trusted: Start offers the probe
PROBE_TIMEOUT_S = 1800


def unsure(flat: dict) -> dict | None:
    """The estimate when it is too close to the free memory to trust (above UNSURE_SHARE of it), else None
    (small runs, or a model of unknown size: Start is never held up for those)."""
    e = estimate(flat)
    if e["known"] and e["total"] > UNSURE_SHARE * e["available"]:
        return e
    return None


def unsure_md(e: dict, lang: str = "en") -> str:
    gib = 1024 ** 3
    return tr(lang, "pf.unsure", total=f'{e["total"] / gib:.1f}', free=f'{e["available"] / gib:.1f}')


def start_probe(spec_yaml: str, root=None, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Launches `tuneboard probe --out <job>/probe.json <job>/tool_spec.yaml` in its own session; returns the job
    folder."""

    job = tools.new_job_dir("probe", root)
    job.mkdir(parents=True, exist_ok=True)
    spec_path = job / tools.TOOL_SPEC
    write_text_atomic(spec_path, spec_yaml)
    argv = jobs.tuneboard_argv() + ["probe", "--timeout", str(int(timeout_s)), "--out", str(job / PROBE_RESULT_FILE),
                                    str(spec_path)]
    jobs.launch(job, argv)
    return str(job)


def stop_probe(job) -> bool:
    """Abort: the probe's process group is stopped (it kills its child and removes its folder)."""

    if not job or not tools.alive(job):
        return False
    tools.mark_aborted(job)
    return tools.stop(job)


def probe_result(job) -> dict:
    return jobs.read_json(Path(job) / PROBE_RESULT_FILE) if job else {}


_PROBE_DIR_LINE = re.compile(r"^probe: \d+ steps of the spec, longest rows first, in (.+)$")  # backend/training/probe.py run_probe


def probe_child_dir(job) -> Path | None:
    """The run folder of a probe job's `tuneboard train` child, from the line the probe prints first."""

    try:
        with open(Path(job) / jobs.PROCESS_LOG, encoding="utf-8", errors="replace") as f:
            head = [next(f, "") for _ in range(20)]
    except OSError:
        return None
    found = next((m for m in map(_PROBE_DIR_LINE.match, (line.strip() for line in head)) if m), None)
    return Path(found.group(1)) if found else None


def probe_progress_md(job, lang: str = "en") -> str:
    """While a probe runs: what its child is doing (the phase the progress card shows for a run) and, once a
    step is done, about how long the rest of its steps take (the steps so far, timed by its own log); "" before
    the child has a folder."""

    child = probe_child_dir(job)
    if child is None or not child.is_dir():
        return ""
    status = jobs.read_json(child / jobs.STATUS_FILE)
    try:
        lines = (child / RUNNING_LOG).read_text(encoding="utf-8", errors="replace").splitlines()[-200:]
    except OSError:
        lines = []
    total = status.get("total_steps")
    text = " " + tr(lang, "pf.probe_phase", phase=live.phase(lines, total, "", lang, status=status))
    per_step, done = step_seconds(child)
    if per_step is not None and total and status.get("phase") == PHASE_TRAINING and done < total:
        text += tr(lang, "pf.probe_left", left=_duration(per_step * (total - done)))
    return text


def waiting_md(busy_run: str, since: float, lang: str = "en") -> str:
    """A measurement held back while `busy_run` trains: which run, why it waits, and how to start it anyway."""


    try:
        name = str(Path(busy_run).relative_to(paths.saves_dir()))
    except ValueError:
        name = str(busy_run)
    text = tr(lang, "pf.busy", name=html.escape(name), cores=psutil.cpu_count() or 1,
              elapsed=int(time.time() - since))
    return f'<span class="tb-mem-warn">{text}</span>'


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    minutes = seconds // 60
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def probe_md(job, lang: str = "en") -> tuple[str, bool]:
    """(what the probe job says, still running?): progress while it runs; then the measured peak, the
    verdict, s/step and the projected time, and what to change when it will not fit."""


    if not job:
        return "", False
    result = probe_result(job)
    running = tools.alive(job)
    if running and not result:
        launched = jobs.read_json(Path(job) / jobs.LAUNCH_FILE).get("launched_at") or time.time()
        text = tr(lang, "pf.measuring", elapsed=int(time.time() - launched)) + probe_progress_md(job, lang)
        return f'<span class="tb-mem-ok">{text}</span>', True
    if not result:
        what = "pf.probe_aborted" if tools.was_aborted(job) else "pf.probe_failed"
        return tr(lang, what, error=_html.escape(jobs._last_error_line(Path(job)) or "no result")), False
    state = result.get("state")
    if state in ("aborted", "timeout", "failed"):
        if state == "aborted":
            return tr(lang, "pf.probe_aborted"), False
        return tr(lang, "pf.probe_failed", error=_html.escape(str(result.get("error") or state))), False
    gib = 1024.0
    fits = bool(result.get("fits"))
    vram = ""
    if result.get("peak_vram_mib") is not None:
        vram = tr(lang, "pf.vram", vram=f'{result["peak_vram_mib"] / gib:.1f}',
                  total=f'{(result.get("vram_total_mib") or 0) / gib:.1f}')
    parts = [tr(lang, "pf.measured", peak=f'{result["peak_rss_mib"] / gib:.1f}', vram=vram,
                free=f'{result["available_mib"] / gib:.1f}', machine=f'{result["machine_total_mib"] / gib:.1f}',
                verdict=tr(lang, "pf.fits" if fits else "pf.not_fit"))]
    if state == "killed":
        parts.append(_html.escape(result.get("error") or ""))
    if result.get("s_per_step"):
        parts.append(tr(lang, "pf.speed", s=f'{result["s_per_step"]:.3g}',
                        time=_duration(result["projected_total_s"]) if result.get("projected_total_s") else "?",
                        steps=result.get("total_steps") or "?"))
    text = " ".join(parts)
    if not fits and result.get("suggestions"):
        items = []
        for s in result["suggestions"]:
            change = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in s["change"].items())
            mark = " ✓" if s.get("fits") else ""
            would = tr(lang, "pf.would_be", gib=f"{s['peak_mib'] / gib:.1f}")
            items.append(f"<li><code>{_html.escape(change)}</code> → {would}{mark}</li>")
        text += f'<br>{tr(lang, "pf.change")}<ul>{"".join(items)}</ul>'
    cls = "tb-mem-ok" if fits else "tb-mem-warn"
    return f'<span class="{cls}">{text}</span>', False
