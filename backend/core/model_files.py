"""A model's or an adapter's files on this machine, checked before a run starts: `validate` (and so the form's
Start) refuses a model or adapter the run could not load, with one line naming it, instead of a run that stops
after launch.

A model (model_name_or_path, ref_model, teacher_model_name_or_path) is a local folder with config.json, a .gguf file
or a folder holding one, or a hub id (`org/name`) already in the local Hugging Face cache: nothing is downloaded
here. `cached_snapshot` is the one answer to where a hub id's files are, used by validate and by
backend.training.models.resolve_model (which loads them). An adapter is a folder with adapter_config.json, and
its matrices fit the base model it is loaded on (adapter_base_mismatch: the safetensors headers of both, read
without the weights). Light: huggingface_hub is imported only when a hub id is asked about."""
from __future__ import annotations

import json
import re
from pathlib import Path

from backend.core import gguf_header
from backend.core.paths import DEFAULT_MODEL_ID, cache_dir, default_model_file
from backend.core.rundir import checkpoints

ADAPTER_CONFIG = "adapter_config.json"  # peft's adapter folder marker
PEFT_PREFIX = "base_model.model."  # peft's saved keys: the wrapped model's own tensor names behind it
_LORA_KEY = re.compile(r"^(.+)\.(lora_A|lora_B)(?:\.weight)?$|^(.+)\.(lora_embedding_A|lora_embedding_B)$")


class NotCachedError(ValueError):
    """The hub id cannot be loaded from this machine's cache; str() is the one line to show."""


def looks_like_path(name: str) -> bool:
    """A model name meant as a local path (a hub id is 'org/name')."""
    return name.startswith((".", "/", "~", "\\")) or name.count("/") > 1 or name.lower().endswith(".gguf") \
        or (len(name) > 1 and name[1] == ":")  # C:\...


def _get_it(name: str) -> str:
    return (f"where the hub is reachable, download it (huggingface-cli download {name}) into the Hugging Face cache "
            "this machine uses (HF_HOME / HF_HUB_CACHE), or into a folder and give that folder instead")


def cached_snapshot(name: str) -> tuple[Path, str | None]:
    """(snapshot folder, its one .gguf file name or None) of hub id `name` in the local cache; NotCachedError
    saying why not (no snapshot, or a snapshot without config.json and without exactly one .gguf file)."""
    from huggingface_hub import snapshot_download  # ~60 ms: only for a hub id
    from huggingface_hub.errors import HFValidationError  # with it: only for a hub id

    try:
        snapshot = Path(snapshot_download(name, local_files_only=True))
    except HFValidationError as exc:
        raise NotCachedError(f"model '{name}' is neither an existing path nor a valid hub id ({exc})") from None
    except Exception:
        raise NotCachedError(f"model '{name}' is not in this machine's Hugging Face cache and nothing can be "
                             f"downloaded here: {_get_it(name)}") from None
    if (snapshot / "config.json").is_file():
        return snapshot, None
    ggufs = sorted(p.name for p in snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return snapshot, ggufs[0]
    raise NotCachedError(f"model '{name}' is in the Hugging Face cache ({snapshot}) without its config.json "
                         f"(a partial download): {_get_it(name)}")


def gguf_cache_folder(gguf_path: Path) -> Path:
    """Where a .gguf model is converted to a transformers folder (backend.training.models.materialize_gguf): one
    folder per file and version (its size and modification time)."""
    stat = gguf_path.stat()
    return cache_dir() / "models" / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def weights_file_problem(path: Path) -> str | None:
    """What is wrong with a .safetensors or .gguf file, from its header and size alone (cut short by a full
    disk or an interrupted download, or not that format at all); None when it looks whole."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if path.suffix.lower() == ".gguf":
                if head[:4] != b"GGUF":
                    return f"{path} is not a GGUF file (it does not start with 'GGUF')"
                return gguf_header.problem(path)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            if length is None or length > size - 8:
                return f"{path} is truncated or not a safetensors file (file of {size} bytes)"
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{path} is not a safetensors file (its header is not a tensor table)"
    if 8 + length + end > size:
        return f"{path} is truncated: {size} bytes, its header describes {8 + length + end}"
    return None


def weights_problem(folder: Path) -> str | None:
    """The first problem of a folder's weight files (.safetensors, .gguf), or None."""
    found = (weights_file_problem(p) for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.gguf")))
    return next((problem for problem in found if problem), None)


def locate(name: str) -> tuple[Path, str | None]:
    """Where model `name`'s files are: (folder, its .gguf file name or None): the bundled default, a .gguf file, a
    folder with config.json or one .gguf file, or a hub id's cached snapshot. ValueError (one line) when there is
    none. backend.core.model_modules reads the module names there."""
    name = str(name).strip()
    if name.lower() == DEFAULT_MODEL_ID.lower():
        gguf = default_model_file()
        return gguf.parent, gguf.name
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf model file: give a model folder or a .gguf file")
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        if (path / ADAPTER_CONFIG).is_file():
            raise ValueError(f"{path} is a LoRA adapter, not a model: set it as adapter_name_or_path and give its "
                             "base model here")
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if not ggufs:
            raise ValueError(f"{path} is not a model folder (no config.json and no .gguf file)")
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds several .gguf files ({', '.join(ggufs)}): give one file")
        return path, ggufs[0]
    if looks_like_path(name):
        raise ValueError(f"{path} does not exist")
    return cached_snapshot(name)


def model_problem(name: str) -> str | None:
    """Why model `name` cannot be loaded here (as backend.training.models.resolve_model would), or None: `locate`'s
    line, or a local weight file that is not whole."""
    name = str(name).strip()
    if not name or name.lower() == DEFAULT_MODEL_ID.lower():
        return None
    try:
        folder, gguf = locate(name)
    except ValueError as exc:
        return str(exc)
    path = Path(name).expanduser()
    if path.is_file():
        return weights_file_problem(path)
    return weights_problem(folder) if path.is_dir() else None  # a hub id's snapshot: as the cache holds it


def is_merged_model(path: Path) -> bool:
    """A full model folder (an export's merged weights), not an adapter."""
    return (path / "config.json").is_file() and not (path / ADAPTER_CONFIG).is_file()


def adapter_problem(name: str, base: str | None = None, resized: bool = False) -> str | None:
    """Why `name` is not an adapter folder a run can load (peft's adapter_config.json and whole weights, and with
    `base` its matrices fit that base model: adapter_base_mismatch), or None. A training run's folder without its
    own adapter (a run stopped before its end) names its checkpoints."""
    path = Path(name.strip()).expanduser()
    if not path.exists():
        return (f"{path} does not exist: give an adapter folder (a training run's output_dir, or one of its "
                "checkpoint-N folders)")
    if not path.is_dir():
        return f"{path} is a file: give an adapter folder (a training run's output_dir, or one of its checkpoint-N)"
    if not (path / ADAPTER_CONFIG).is_file():
        saved = [p for p in checkpoints(path) if (p / ADAPTER_CONFIG).is_file()]
        if saved:
            return (f"{path} holds no final adapter (no {ADAPTER_CONFIG}: its run stopped before the end?) but "
                    f"checkpoints: give one of them ({saved[-1]})")
        if is_merged_model(path):
            return (f"{path} is a full model (config.json, no {ADAPTER_CONFIG}): give it as model_name_or_path, "
                    "without an adapter")
        return f"{path} is not an adapter folder (no {ADAPTER_CONFIG})"
    return adapter_config_problem(path / ADAPTER_CONFIG) or weights_problem(path) \
        or (adapter_base_mismatch(path, base, resized) if base else None)


def adapter_config_problem(file: Path) -> str | None:
    """Why an adapter_config.json is not one peft can read (not JSON, not an object), or None."""
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read {file}: {exc}"
    except json.JSONDecodeError as exc:
        return f"{file} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
    if not isinstance(config, dict):
        return f"{file} must hold a JSON object (peft's adapter settings)"
    return None


def tensor_shapes(folder: Path) -> dict[str, list[int]]:
    """Every tensor's name and shape in a folder's safetensors files, from their JSON headers alone (a few KB to a
    few MB, never the weights). OSError / ValueError where a header cannot be read."""
    found: dict[str, list[int]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        found.update({k: list(v.get("shape") or []) for k, v in header.items()
                      if k != "__metadata__" and isinstance(v, dict)})
    return found


def _base_tensors(base: str) -> tuple[dict[str, list[int]], int | None]:
    """(tensor shapes, vocab_size) of base model `base` where its safetensors are on this machine (a .gguf model's
    converted folder once it exists); ({}, None) where they cannot be read or hold packed quantized matrices (a
    pre-quantized checkpoint: its shapes are not the layers'): nothing to compare with."""
    try:
        folder, gguf = locate(base)
        if gguf:
            folder = gguf_cache_folder(folder / gguf)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if config.get("quantization_config"):  # pre-quantized weights (bnb, GPTQ, AWQ) are stored packed
            return {}, None
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        return tensor_shapes(folder), text.get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return {}, None


def _sides_fit(sizes: tuple[int, int], weight: list[int], vocab: int | None, resized: bool) -> bool:
    """A LoRA pair's (in, out) sides against the base matrix: a Linear's [out, in] weight, a Conv1D's [in, out] or an
    embedding's [vocab, dim]; with `resized` (the spec grows the vocabulary before the adapter loads) an embedding or
    head's vocabulary side may differ, its other side may not."""
    rows, cols = weight
    return sizes in ((cols, rows), (rows, cols)) or (resized and rows == vocab and cols in sizes)


def adapter_base_mismatch(adapter: Path, base: str, resized: bool = False) -> str | None:
    """Why the adapter in folder `adapter` does not fit base model `base`, or None: a LoRA pair whose sides are not
    the base layer's sizes, a rank other than adapter_config.json's r, or a module saved whole (modules_to_save, an
    embedding's base_layer) of another shape. peft stopped the run after the model loaded, with one 'size mismatch'
    line per matrix. `resized`: the run grows the vocabulary first (resize_vocab, new_special_tokens), so only the
    embedding width is compared there. Names the first module that does not fit; nothing where either side's files
    cannot be read here."""
    try:
        config = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        shapes = tensor_shapes(adapter)
    except (OSError, ValueError):
        return None  # adapter_problem says what is wrong with the files
    base_shapes, vocab = _base_tensors(base)
    if not base_shapes or not isinstance(config, dict):
        return None
    rank = config.get("r") if not config.get("rank_pattern") else None
    trained_on = config.get("base_model_name_or_path")
    hint = (f": give the base model it was trained on ({trained_on}, its {ADAPTER_CONFIG} says)" if trained_on
            else ": give the base model it was trained on")
    pairs: dict[str, dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        name = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        match = _LORA_KEY.match(name)
        if match:
            module, part = (match[1], match[2]) if match[1] else (match[3], match[4])
            pairs.setdefault(module, {})[part[-1]] = shape
            continue
        wanted = base_shapes.get(name)
        if wanted is None or shape == wanted:
            continue
        if resized and len(shape) == len(wanted) == 2 and shape[1] == wanted[1] and wanted[0] == vocab:
            continue  # an embedding or head the run grows before the adapter loads
        return f"adapter {adapter} does not fit {base}: its {name} is {shape}, the base model's is {wanted}{hint}"
    for module, parts in pairs.items():
        a, b, weight = parts.get("A"), parts.get("B"), base_shapes.get(module + ".weight")
        if not a or not b or len(a) != 2 or len(b) != 2:
            continue
        if isinstance(rank, int) and rank != a[0]:
            return (f"adapter {adapter}: its {module} has rank {a[0]} (lora_A {a}) and its {ADAPTER_CONFIG} says "
                    f"r {rank}: the files are not one adapter's")
        if weight and len(weight) == 2 and not _sides_fit((a[1], b[0]), weight, vocab, resized):
            return (f"adapter {adapter} does not fit {base}: its {module} takes {a[1]} and gives {b[0]} (lora_A {a}, "
                    f"lora_B {b}), the base model's {module}.weight is {weight}{hint}")
    return None
