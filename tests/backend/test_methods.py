"""The method contract (backend/core/methods.py): every declared method is a spec choice with its code in
backend/training/adapters.py, and no other module decides by comparing method names."""
import ast
import typing
from pathlib import Path

from backend.core import methods
from backend.training import adapters
from backend.core.spec import RunSpec

ROOT = Path(__file__).resolve().parents[2]


def test_every_declared_method_is_a_spec_choice_with_its_code():
    choices = typing.get_args(RunSpec.model_fields["finetuning_type"].annotation)
    assert set(choices) == set(methods.METHODS)
    for m in methods.METHODS.values():
        table = adapters.NEW_ADAPTER if m.adapter else adapters.TRAIN_IN_PLACE
        assert m.id in table, f"{m.id}: no entry in backend/training/adapters.py"
        if m.form_group:
            assert any(f.json_schema_extra.get("group") == m.form_group for f in RunSpec.model_fields.values()
                       if isinstance(f.json_schema_extra, dict)), m.id
    assert set(adapters.NEW_ADAPTER) | set(adapters.TRAIN_IN_PLACE) == set(methods.METHODS)


def test_method_of_adapter_reads_the_peft_type(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "OFT"}')
    assert methods.method_of_adapter(tmp_path) == "oft"
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    assert methods.method_of_adapter(tmp_path) == "lora"
    assert methods.method_of_adapter(tmp_path / "missing") is None


def _method_name_comparisons(path: Path) -> list[str]:
    """`x == "lora"`, `x != "full"`, `x in ("lora", "oft")`: a decision by method name."""
    names = set(methods.METHODS)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        for op, right in zip(node.ops, node.comparators):
            values = [right] if not isinstance(right, (ast.Tuple, ast.List, ast.Set)) else right.elts
            if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) and any(
                    isinstance(v, ast.Constant) and v.value in names for v in values):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_module_compares_method_names():
    """Code asks the declaration (is it an adapter? may the base be quantized?), so a new method is one
    declaration + one function. The two modules that own the methods are the exception."""
    owners = {ROOT / "backend" / "core" / "methods.py", ROOT / "backend" / "training" / "adapters.py"}
    files = [p for folder in ("backend", "webui") for p in (ROOT / folder).rglob("*.py") if p not in owners]
    hits = [hit for p in files for hit in _method_name_comparisons(p)]
    assert not hits, hits


def test_oft_keys_reach_peft(tiny_llama):
    """oft_rank / oft_block_size / oft_target / module_dropout set the OFT adapter peft builds."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    spec = SimpleNamespace(finetuning_type="oft", oft_rank=4, oft_block_size=0, oft_target="q_proj,o_proj",
                           module_dropout=0.25)
    model = adapters.apply_finetuning(AutoModelForCausalLM.from_pretrained(tiny_llama), spec)
    config = model.peft_config["default"]
    assert (config.peft_type.value, config.r, config.oft_block_size, config.module_dropout) == ("OFT", 4, 0, 0.25)
    assert sorted(config.target_modules) == ["o_proj", "q_proj"]
    wrapped = {type(m).__module__ for n, m in model.named_modules() if n.endswith(("q_proj", "o_proj"))}
    assert wrapped == {"peft.tuners.oft.layer"}
    assert not any(n.endswith(("k_proj", "v_proj")) for n, m in model.named_modules()
                   if type(m).__module__.startswith("peft.tuners.oft"))


def test_method_and_stage_keys_are_declared_beside_them():
    """A method's keys live in backend/core/methods.py (METHOD_KEYS), a stage's beside its declaration
    (backend/stages STAGE_KEYS), and RunSpec inherits them: spec.py names no method and no stage."""
    from backend.stages import STAGE_IDS, STAGE_KEYS, STAGES

    ids = set(methods.METHODS) | set(STAGE_IDS)
    tree = ast.parse((ROOT / "backend" / "core" / "spec.py").read_text(encoding="utf-8"))
    named = [f"spec.py:{n.lineno}: {n.value!r}" for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in ids]
    assert not named, named
    method_keys = {k for section in methods.METHOD_KEYS for k in section.model_fields}
    in_method_groups = {k for k, f in RunSpec.model_fields.items()
                        if f.json_schema_extra["group"] in {m.form_group for m in methods.METHODS.values()}}
    assert in_method_groups and in_method_groups <= method_keys
    stage_keys = {k for section in STAGE_KEYS for k in section.model_fields}
    assert {k for s in STAGES.values() for k in s.fields} == stage_keys
    assert (method_keys | stage_keys) <= set(RunSpec.model_fields)


def test_a_methods_comma_key_takes_a_yaml_list():
    """comma_keys of a method's keys class: a YAML list is joined, as for lora_target."""
    spec = RunSpec.model_validate({"finetuning_type": "oft", "oft_target": ["q_proj", "o_proj"]},
                                  context={"check_files": False})
    assert spec.oft_target == "q_proj,o_proj"


def test_a_key_of_a_switch_that_is_off_is_refused():
    """pissa_iter without pissa_init, galore_* without use_galore: the run would ignore them."""
    import pytest

    from backend.core.spec import REFUSED, SpecError, validate_spec

    for keys, switch in (({"pissa_iter": 4}, "pissa_init"),
                         ({"finetuning_type": "full", "galore_rank": 8}, "use_galore"),
                         ({"finetuning_type": "freeze", "galore_target": "q_proj"}, "use_galore"),
                         ({"finetuning_type": "oft", "oft_block_size": 32, "pissa_iter": 4}, "pissa_init")):
        with pytest.raises(SpecError) as caught:
            validate_spec(keys, check_files=False)
        field, message = caught.value.errors[0]
        assert field in keys and message.startswith(REFUSED) and switch in message
        validate_spec({**keys, switch: True}, check_files=False)  # with the switch on: accepted
