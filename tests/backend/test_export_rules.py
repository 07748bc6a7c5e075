"""tuneboard export's requests that validate refuses before anything loads (backend/core/export_rules.py and
backend/core/llamacpp.py): an export_dir that holds a source (a hub id's cached folder too), one under a file or with
too long a name, GGUF of a model the writer cannot write, infer_backend llamacpp on what llama.cpp cannot serve."""
import json
import shutil

import pytest

from backend.core.spec import SpecError, validate_spec
from backend.exporting.export import ExportError, check_request, main


@pytest.fixture
def hub_cache(tiny_llama, tmp_path, monkeypatch):
    """tiny_llama as hub id me/tiny in a Hugging Face cache of its own (HF_HUB_CACHE), as a download leaves it."""
    cache = tmp_path / "hfcache"
    repo = cache / "models--me--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_llama, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    from huggingface_hub import constants  # read when snapshot_download is called (the env when it is imported)

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _errors(flat: dict) -> str:
    with pytest.raises(SpecError) as info:
        validate_spec(flat)
    return str(info.value)


@pytest.mark.parametrize("where", ["cache", "repo", "snapshot", "inside"])
def test_export_dir_holding_a_hub_models_cached_files_is_refused(hub_cache, where):
    """`export_dir=<the HF cache> export_overwrite=true` deleted the cached model: the guard tested the hub id as a
    path, which does not exist. Now the cached folder is the source, whatever export_dir's relation to it."""
    out = {"cache": hub_cache, "repo": hub_cache / "models--me--tiny",
           "snapshot": hub_cache / "models--me--tiny" / "snapshots" / ("a" * 40),
           "inside": hub_cache / "models--me--tiny" / "snapshots" / ("a" * 40) / "merged"}[where]
    flat = {"model_name_or_path": "me/tiny", "finetuning_type": "full", "template": "llama3",
            "export_dir": str(out), "export_overwrite": True}
    assert "export_dir:" in _errors(flat) and "holds the source" in _errors(flat)
    spec = validate_spec(flat, check_files=False)
    with pytest.raises(ExportError, match="export_dir: .* holds the source"):
        check_request(spec)
    assert (hub_cache / "models--me--tiny" / "snapshots" / ("a" * 40) / "config.json").is_file()


def test_export_dir_inside_the_adapter_is_refused(tiny_llama, random_llama_adapter, tmp_path):
    flat = {"model_name_or_path": str(tiny_llama), "adapter_name_or_path": str(random_llama_adapter),
            "export_dir": str(random_llama_adapter / "merged")}
    assert "holds the source" in _errors(flat)


def test_export_dir_problems_are_said_by_validate(tiny_llama, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    base = {"model_name_or_path": str(tiny_llama), "finetuning_type": "full"}
    assert "export_dir: " in _errors({**base, "export_dir": str(a_file)}) and "is a file" in _errors(
        {**base, "export_dir": str(a_file)})
    assert f"cannot create {a_file / 'x' / 'y'}: {a_file} is a file" in _errors({**base, "export_dir": str(a_file / "x" / "y")})
    assert "is not empty" in _errors({**base, "export_dir": str(busy)})
    validate_spec({**base, "export_dir": str(busy), "export_overwrite": True})  # replacing it is asked for
    validate_spec({**base, "export_dir": str(tmp_path / "new" / "deeper")})  # a parent that can be made


def test_a_name_too_long_is_one_line_not_a_traceback(tiny_llama, tmp_path, capsys):
    """Path.exists raised ENAMETOOLONG (an OSError main() did not catch)."""
    code = main([f"model_name_or_path={tiny_llama}", "finetuning_type=full", f"export_dir={tmp_path / ('x' * 300)}"])
    err = capsys.readouterr().err
    assert code == 1 and "export_dir: the name xxx" in err and "too long (300 characters)" in err


def _config_only(src, out, **changes):
    """A model folder whose config.json is src's with `changes` (validate reads config.json alone)."""
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_gguf_of_a_model_the_writer_cannot_write_is_refused_at_validate(tiny_llama, tmp_path):
    """phi3 and Llama 3.1-3.3's llama3 RoPE passed validate and failed after the model was loaded."""
    phi3 = _config_only(tiny_llama, tmp_path / "phi3", model_type="phi3")
    llama31 = _config_only(tiny_llama, tmp_path / "llama31", rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512, "rope_theta": 500000.0})
    base = {"finetuning_type": "full", "export_format": "gguf", "export_dir": str(tmp_path / "out")}
    assert "export_format: GGUF export supports model_type llama" in _errors({**base, "model_name_or_path": str(phi3)})
    assert "RoPE scaling 'llama3' is not supported" in _errors({**base, "model_name_or_path": str(llama31)})
    assert "rope_scaling: not supported: a GGUF export" in _errors(
        {**base, "model_name_or_path": str(tiny_llama), "rope_scaling": "linear", "cutoff_len": 2048})
    validate_spec({**base, "model_name_or_path": str(tiny_llama)})


def test_infer_backend_llamacpp_refuses_an_adapter_and_a_transformers_folder_at_validate(tiny_llama,
                                                                                         random_llama_adapter):
    """Both were refused at launch only (backend.serving.engine._load_llamacpp)."""
    errors = _errors({"model_name_or_path": str(tiny_llama), "adapter_name_or_path": str(random_llama_adapter),
                      "infer_backend": "llamacpp"})
    assert "infer_backend: llamacpp serves a GGUF file as it is: merge the adapter" in errors
    assert "infer_backend: llamacpp needs a .gguf file" in _errors({"model_name_or_path": str(tiny_llama),
                                                                    "infer_backend": "llamacpp"})
