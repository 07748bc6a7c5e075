"""Where the web UI may read and write: its allowed roots (issue #9). Light (no torch), read by webui/.

The decision:

- **Roots.** The data folder (`paths.DATA_DIR`), the saves folder (`paths.saves_dir()`, run dirs, specs,
  exports, tool jobs), the cache (`paths.cache_dir()`), the examples folder (read only: recipes to load),
  and the folders the user adds at launch: `tuneboard webui --allow-path DIR` (repeatable) or
  `$TUNEBOARD_ALLOW_PATHS` (folders separated by `os.pathsep`). Roots are read again on every check (an
  env var, not module state), so a test or a launcher can add one.
- **A path is checked after resolution**: `~` expanded, a relative path taken from the repository (the
  folder the UI's subprocesses run in), then `os.path.realpath` (symlinks followed, `..` removed); the
  result must be a root or lie under one (a root is resolved the same way).
- **Writes** (a saved spec, `output_dir`, `export_dir`, the dataset folder a dataset is registered in,
  `logging_dir`) go under a writable root only: every root but the examples folder. No folder tree is
  created outside the roots, since the path is refused before anything is made. Overwriting an existing
  file is the caller's decision (the Train tab asks for an explicit "overwrite" tick).
- **Reads whose content can reach the page** (a spec to load, a dataset folder / dataset_info.json, a
  dataset file to register or preview, DeepSpeed / FSDP / accelerate config files) come from a root only.
- **Models and adapters** (`model_name_or_path`, `adapter_name_or_path`, `ref_model`, `reward_model`,
  `resume_from_checkpoint`, the Chat tab's comparison adapter) live anywhere on a real machine, so they are
  readable outside the roots, but only when the path is really a model: a folder holding `config.json`,
  `adapter_config.json`, `trainer_state.json` or weights (`*.safetensors`, `*.bin`), or a `.gguf` file. A
  name that is not an existing path is a hub id (read from the local Hugging Face cache by the backend).
  Anything else outside the roots (`/etc/passwd`, a YAML file, a folder of other files) is refused. Model
  files are only opened by backend subprocesses; the UI never shows their content, only their name.

A refusal is a `PathRefused` (a ValueError) that names the field, the path as given, the resolved path and
the roots; `webui/` turns it into a message of the page's language (locale keys `msg.path_refused_*`).

**Code** (issue #25, SECURITY.md): a spec key that makes a process run code the user names (a reward function
`file.py:function` or `module:function` in `reward_funcs`, `trust_remote_code: true`) is refused from the UI
unless its operator started it with `tuneboard webui --allow-code`, and even then only a `.py` file under the
roots runs (a `module:function` can name any installed module, `os:system`, so it stays off). The UI's
decision travels to the processes it starts in `$TUNEBOARD_UI_CODE` (`off` | `allowed-folders`): a backend
process that sees it refuses the same keys again at validate (`code_refusals`), so a launch path that forgot
the check still runs no code. Unset (a command line of the machine's own user) means no restriction.
"""
from __future__ import annotations

import os
from pathlib import Path

from backend.core import paths
from backend.core.rewards import split_names

ENV = "TUNEBOARD_ALLOW_PATHS"
CODE_ENV = "TUNEBOARD_UI_CODE"
CODE_OFF, CODE_IN_ROOTS = "off", "allowed-folders"
CODE_KEYS = ("reward_funcs", "trust_remote_code")  # spec keys that can make a process run the user's code

# spec keys by what the UI lets them do with a path
WRITE_KEYS = ("output_dir", "export_dir", "logging_dir")
READ_KEYS = ("dataset_dir", "deepspeed", "fsdp_config", "accelerator_config", "judge_api_key_file",
             "reward_model_api_key_file")
MODEL_KEYS = ("model_name_or_path", "adapter_name_or_path", "ref_model", "reward_model", "resume_from_checkpoint")
MODEL_MARKERS = ("config.json", "adapter_config.json", "trainer_state.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


class PathRefused(ValueError):
    """`what`: "write" | "read" | "model". `path`: as given; `resolved`: after symlinks and `..`."""

    def __init__(self, what: str, field: str, path: str, resolved: Path, roots: list[Path]):
        self.what, self.field, self.path, self.resolved, self.roots = what, field, str(path), resolved, roots
        super().__init__(self.english())

    def kwargs(self) -> dict:
        """The fields a locale message (msg.path_refused_<what>) is filled with."""
        shown = str(self.resolved) if str(self.resolved) != self.path else self.path
        return {"field": self.field, "path": shown, "roots": roots_text(self.roots)}

    def key(self) -> str:
        return f"msg.path_refused_{self.what}"

    def english(self) -> str:
        k = self.kwargs()
        if self.what == "model":
            return (f"{k['field']}: {k['path']} is outside the allowed folders and is not a model folder or "
                    f".gguf file. Allowed folders: {k['roots']}")
        verb = "write to" if self.what == "write" else "read"
        return (f"{k['field']}: not allowed to {verb} {k['path']}: it is outside the allowed folders "
                f"({k['roots']}). Start the UI with --allow-path DIR to add a folder.")


class CodeRefused(ValueError):
    """A spec value that would run code the UI may not run. `why`: "off" (the UI was started without
    --allow-code), "module" (a module:function reference) or "outside" (a .py file outside the roots)."""

    def __init__(self, why: str, field: str, value: str, roots: list[Path]):
        self.why, self.field, self.value, self.roots = why, field, str(value), roots
        super().__init__(self.english())

    def kwargs(self) -> dict:
        return {"field": self.field, "value": self.value, "roots": roots_text(self.roots)}

    def key(self) -> str:
        return f"msg.code_refused_{self.why}"

    def english(self) -> str:
        k = self.kwargs()
        if self.why == "off":
            return (f"{k['field']}: {k['value']} would run code on the server, and this UI was started without "
                    "--allow-code: only the built-in choices run (the operator can restart it with --allow-code)")
        if self.why == "module":
            return (f"{k['field']}: {k['value']} names a module, which can be any installed module: from the UI, "
                    f"give a .py file under an allowed folder ({k['roots']})")
        return (f"{k['field']}: {k['value']} is outside the allowed folders ({k['roots']}): only a .py file "
                "under them runs")


def code_policy() -> str | None:
    """$TUNEBOARD_UI_CODE: None for a command line of the machine's own user (no restriction)."""
    return os.environ.get(CODE_ENV) or None


def set_code_policy(allow_code: bool) -> None:
    """`tuneboard webui` states its policy for itself and every process it starts."""
    os.environ[CODE_ENV] = CODE_IN_ROOTS if allow_code else CODE_OFF


def code_allowed() -> bool:
    """In the UI: was it started with --allow-code? (unset counts as no: the UI's default is off)"""
    return code_policy() == CODE_IN_ROOTS


def code_refusals(flat: dict, policy: str | None = None) -> list[CodeRefused]:
    """The spec values that would run code `policy` does not allow (default: the UI's, off unless
    --allow-code); a reward name without ':' is a built-in (or a typo validate names), never code."""
    policy = policy or code_policy() or CODE_OFF
    out: list[CodeRefused] = []
    if str(flat.get("trust_remote_code", "")).strip().lower() in ("true", "1", "yes") and policy != CODE_IN_ROOTS:
        out.append(CodeRefused("off", "trust_remote_code", "true", roots()))
    for name in split_names(flat.get("reward_funcs")):
        if ":" not in name:
            continue
        where = name.rpartition(":")[0]
        if policy != CODE_IN_ROOTS:
            out.append(CodeRefused("off", "reward_funcs", name, roots()))
        elif not where.endswith(".py"):
            out.append(CodeRefused("module", "reward_funcs", name, roots()))
        elif not _inside(resolve(where), roots()):
            out.append(CodeRefused("outside", "reward_funcs", name, roots()))
    return out


def roots_text(roots: list[Path]) -> str:
    return ", ".join(str(r) for r in roots)


def resolve(path: str | os.PathLike) -> Path:
    """Absolute, symlinks followed, `..` removed; a relative path is taken from the repository."""
    p = Path(os.path.expanduser(str(path).strip()))
    if not p.is_absolute():
        p = paths.REPO_ROOT / p
    return Path(os.path.realpath(p))


def extra_roots() -> list[Path]:
    return [Path(d) for d in os.environ.get(ENV, "").split(os.pathsep) if d.strip()]


def add_roots(dirs: list[str]) -> None:
    """Adds folders to the allowed roots of this process and of the processes it starts (the env var)."""
    current = [str(d) for d in extra_roots()]
    for d in dirs:
        full = str(resolve(d))
        if full not in current:
            current.append(full)
    os.environ[ENV] = os.pathsep.join(current)


def roots(write: bool = False) -> list[Path]:
    """The allowed roots, resolved, without duplicates; `write`: only those that may be written."""
    base = [paths.DATA_DIR, paths.saves_dir(), paths.cache_dir()]
    if not write:
        base.append(paths.EXAMPLES_DIR)
    out: list[Path] = []
    for r in [*base, *extra_roots()]:
        full = resolve(r)
        if full not in out:
            out.append(full)
    return out


def _inside(path: Path, root_list: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in root_list)


def check_write(path: str | os.PathLike, field: str = "path") -> Path:
    """The resolved path when it lies under a writable root, else PathRefused."""
    full, allowed = resolve(path), roots(write=True)
    if not _inside(full, allowed):
        raise PathRefused("write", field, str(path), full, allowed)
    return full


def check_read(path: str | os.PathLike, field: str = "path") -> Path:
    """The resolved path when it lies under a root (the examples folder included), else PathRefused."""
    full, allowed = resolve(path), roots()
    if not _inside(full, allowed):
        raise PathRefused("read", field, str(path), full, allowed)
    return full


def is_model_path(full: Path) -> bool:
    """A folder that holds a model, adapter or checkpoint, or a .gguf file (`full`: resolved)."""
    if full.is_file():
        return full.suffix.lower() == ".gguf"
    if not full.is_dir():
        return False
    if any((full / m).is_file() for m in MODEL_MARKERS):
        return True
    try:
        return any(p.suffix.lower() in WEIGHT_SUFFIXES for p in full.iterdir() if p.is_file())
    except OSError:
        return False


def check_model(value: str | None, field: str = "model_name_or_path") -> None:
    """A model / adapter reference: a hub id (no such path), a path under a root, or a real model
    outside them. Comma-separated lists (adapters) are checked one by one."""
    for part in str(value or "").split(","):
        part = part.strip()
        if not part or part.lower() in ("true", "false"):  # resume_from_checkpoint: true
            continue
        full = resolve(part)
        if not os.path.lexists(full) and not os.path.lexists(os.path.expanduser(part)):
            continue  # a hub id, or a path that is not there (validate says so; nothing to read)
        if _inside(full, roots()) or is_model_path(full):
            continue
        raise PathRefused("model", field, part, full, roots())


def spec_refusals(flat: dict) -> list[PathRefused | CodeRefused]:
    """Every path of a flat spec the UI may not use (write / read / model keys), in key order, then every
    value that would run code the UI may not run."""
    out: list[PathRefused | CodeRefused] = []
    for key, value in flat.items():
        if value in (None, "") or not isinstance(value, (str, os.PathLike)):
            continue  # a dict config (deepspeed: {...}) or a bool is not a path
        try:
            if key in WRITE_KEYS:
                check_write(value, key)
            elif key in READ_KEYS:
                check_read(value, key)
            elif key in MODEL_KEYS:
                check_model(value, key)
        except PathRefused as exc:
            out.append(exc)
    return out + code_refusals(flat)
