"""Datasets that live on a hub (dataset_info.json's hf_hub_url, ms_hub_url, om_hub_url, cloud_file_name, or
`dataset: org/name` in a spec): whether this machine can load one, as one line naming the dataset and what to do.

Light (no `datasets`): `validate` and the Train form say it before a run starts; backend/dataprep/hub.py loads the
rows with datasets' own loader (datasets.load_dataset(repo, name=subset, split=split, data_dir=folder)) and says
the same line when asked to. hf_hub_url may also be a local folder laid out like a hub repository (data files,
README.md `configs:`, splits): the same loader reads it, offline."""
from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import yaml

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# hub -> (the module its loader needs, the pip package, the hub's name)
OTHER_HUBS = {"ms_hub_url": ("modelscope", "modelscope", "ModelScope"),
              "om_hub_url": ("openmind", "openmind", "Modelers (openMind)")}
CLOUD_FILESYSTEMS = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


def is_hub_id(name: str) -> bool:
    """`org/name`: a hub repository id (a spec's `dataset: org/name` that dataset_info.json does not register)."""
    return bool(HUB_ID.fullmatch(name)) and ".." not in name


def hub_key(entry: dict) -> str | None:
    """The key an entry without a local file_name is loaded from (hf_hub_url first, as LLaMA-Factory), or None."""
    if not isinstance(entry, dict) or entry.get("file_name"):
        return None
    return next((k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "cloud_file_name", "script_url")
                 if entry.get(k)), None)


def local_repo(value: str, dataset_dir: Path) -> Path | None:
    """hf_hub_url given as a folder (absolute, ~, ./ or a folder under dataset_dir): the folder, else None."""
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [dataset_dir / path, Path.cwd() / path]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is not None:
        return found.resolve()
    if path.is_absolute() or value.startswith((".", "~")):
        return candidates[0]  # meant as a folder: "not found" names it
    return None


def hub_offline() -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or no answer
    from its host within 3 s), or None."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return _unreachable(endpoint.hostname or "huggingface.co", endpoint.port or 443)


@functools.lru_cache(maxsize=4)
def _unreachable(host: str, port: int) -> str | None:
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError:
        return f"{host} is unreachable"
    return None


def _in_hub_cache(repo: str) -> bool:
    """The dataset repository is in the local Hugging Face cache (downloaded before: loadable offline)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    cache = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or Path(home) / "hub")
    return (cache / f"datasets--{repo.replace('/', '--')}").is_dir()


def _subset_problem(where: str, folder: Path, subset: str | None) -> str | None:
    """A subset that is not one of the configs a hub-style folder's README.md declares (datasets reads the same)."""
    try:
        text = (folder / "README.md").read_text(encoding="utf-8")
        card = yaml.safe_load(text.split("---", 2)[1]) if text.startswith("---") else None
    except (OSError, UnicodeDecodeError, IndexError, yaml.YAMLError):
        return None  # no card: datasets infers the layout, and says so when it cannot
    configs = card.get("configs") if isinstance(card, dict) else None
    names = [c.get("config_name") for c in configs if isinstance(c, dict)] if isinstance(configs, list) else []
    if not subset or not names or subset in names:
        return None
    close = difflib.get_close_matches(subset, names, n=1, cutoff=0.5)
    return (f"{where}: subset {subset!r} is not a config of {folder} (its README.md configs: {', '.join(names)})"
            + (f"; did you mean {close[0]!r}?" if close else ""))


def _get_it(name: str, repo: str) -> str:
    return (f"where the hub is reachable, run with HF_HUB_OFFLINE=0 (datasets caches it), or download it "
            f"(huggingface-cli download --repo-type dataset {repo} --local-dir DIR) and register it: hf_hub_url: DIR "
            f"(the same subset / split / folder), or a local file with file_name in dataset_info.json")


def hub_problem(name: str, entry: dict, dataset_dir: Path) -> str | None:
    """The one line saying why dataset `name` (an entry loaded from a hub) cannot be loaded here, or None."""
    key = hub_key(entry)
    if key is None:
        return None
    value = str(entry[key]).strip()
    where = f"dataset '{name}'"
    if key == "hf_hub_url":
        folder = local_repo(value, Path(dataset_dir))
        if folder is not None:
            return _subset_problem(where, folder, entry.get("subset")) if folder.is_dir() else \
                f"{where}: hf_hub_url folder not found: {folder}"
        if not is_hub_id(value):
            return (f"{where}: hf_hub_url {value!r} is neither a hub dataset id (org/name) nor a folder "
                    f"(looked under {dataset_dir})")
        offline = hub_offline()
        if offline and not _in_hub_cache(value):
            return f"{where}: {value} is on the Hugging Face Hub and this machine is offline ({offline}): " + \
                _get_it(name, value)
        return None
    if key in OTHER_HUBS:
        module, package, hub = OTHER_HUBS[key]
        missing = importlib.util.find_spec(module) is None
        why = (f"loading from {hub} needs the {package} package, which is not installed" if missing
               else f"TuneBoard does not load {hub} datasets itself")
        return (f"{where}: {key} {value}: {why}: download the dataset and register a local file (file_name in "
                f"dataset_info.json), or use its hf_hub_url")
    if key == "cloud_file_name":
        scheme = urlparse(value).scheme.lower()
        package = CLOUD_FILESYSTEMS.get(scheme)
        if package is None:
            return (f"{where}: cloud_file_name {value!r} is not an s3:// or gs:// path: give one, or register a local "
                    "file with file_name")
        if importlib.util.find_spec(package) is None:
            return (f"{where}: cloud_file_name {value} needs the {package} package (fsspec's {scheme}:// file system), "
                    f"which is not installed: pip install {package}, or download the file and register it with "
                    "file_name")
        return None
    return (f"{where}: script_url {value}: dataset loading scripts are not run (datasets 4 removed them): download "
            "the data files and register them with file_name")
