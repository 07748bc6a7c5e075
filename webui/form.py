"""The Train form's logic, shared by the tabs that fill or read the form (Train, Runs, Distill, Data): form
values -> flat spec (collect), validation with the allowed-folder refusals (check), per-field error updates,
the dataset picker after a stage change, the command preview, Save/Load checks, and spec -> form values
(spec_to_inputs). No tab imports another tab (tests/webui/test_tab_contract.py): what they share lives here."""
from __future__ import annotations

import shlex
from pathlib import Path

import gradio as gr

from backend.core import allowed, teacher_access
from backend.core.spec import SpecError, validate_spec
from backend.core.train_rules import train_command_errors
from webui import choices, jobs
from webui import datasets as D
from webui import fields as F
from webui.i18n import choice_pairs, field_help, refusal, tr
from backend.core.launch import launch_commands
from backend.core.spec import _all_keys


def inputs_of(top: dict, train: dict) -> list:
    """The form's input components in spec_to_inputs / collect order: top-bar fields, booster, extra args,
    form fields (`top`: the top bar's components, `train`: the Train tab's)."""
    return [top[n] for n in F.TOPBAR_FIELDS] + [top["booster"], train["extra_args"]] + \
        [train["fields"][n] for n in train["names"]]


def preset_flat() -> dict:
    flat = {r.name: r.default for r in F.field_table()}
    flat.update(F.PRESET)
    return flat


# ------------------------------------------------------------------ handlers (pure where possible)

def collect(names: list[str], top_names: list[str], values: list) -> tuple[dict, list]:
    """Form values -> flat spec dict. `values` = top-bar values (top_names order) + booster + extra args +
    form values (names order)."""
    n_top = len(top_names)
    top_vals, booster, extra, form_vals = values[:n_top], values[n_top], values[n_top + 1], values[n_top + 2:]
    flat, errors = F.values_to_flat(top_names + names, list(top_vals) + list(form_vals), extra, booster)
    return flat, errors


def check(flat: dict, pre_errors: list, lang: str = "en") -> tuple[object | None, list[tuple[str, str]]]:
    """Validate like `tuneboard train` does (train_rules.train_command_errors too), and refuse paths outside the
    allowed folders (backend.core.allowed: output_dir, dataset_dir, a model that is not a model folder, ...) and a
    scoring endpoint the UI may not ask (endpoint_refusals); returns (spec, []) or (None, [(field, message), ...])."""
    if pre_errors:
        return None, pre_errors
    refused = [(exc.field, refusal(lang, exc, with_field=False)) for exc in allowed.spec_refusals(flat)]
    if refused:
        return None, refused
    try:
        spec = validate_spec(flat)
    except SpecError as exc:
        return None, list(exc.errors)
    refused = train_command_errors(spec)  # the Train tab's spec is a training run's (tuneboard train refuses the same)
    if refused:
        return None, refused
    refused = [(exc.field, refusal(lang, exc, with_field=False)) for exc in endpoint_refusals(spec)]
    return (None, refused) if refused else (spec, [])


def endpoint_refusals(spec) -> list:
    """The scoring endpoint a validated spec's run would ask (stage ppo, reward_model_type api), under the UI's
    endpoint policy (backend.core.teacher_access, as the distill teacher and the eval judge: an offered key for its
    own base URL, no internal address unless the operator allowed it); the key file's folder is
    allowed.spec_refusals' business. The run checks again (backend.stages.ppo.scoring_endpoint)."""
    if spec.stage != "ppo" or spec.reward_model_type != "api" or not spec.reward_model:
        return []
    return teacher_access.check_teacher(spec.reward_model, spec.reward_model_api_key_env,
                                        spec.reward_model_api_key_file, "reward_model", url_field="reward_model")


def error_updates(errors: list[tuple[str, str]], all_names: list[str], lang: str = "en") -> list:
    """One update per field: the error message as the field's info text (red), else its description. The
    top bar's fields carry no description (a few lines of small print under some of its labels pushed their
    boxes out of line), so only an error shows there."""
    by_field: dict[str, list[str]] = {}
    for field, message in errors:
        by_field.setdefault(field, []).append(message)
    table = F.rows_by_name()
    out = []
    for name in all_names:
        if name in by_field:
            # no glyph: the browser's fonts may lack it (a box); the red text and icon come from the CSS class
            out.append(gr.update(info="; ".join(by_field[name]), elem_classes=["tb-field-error"]))
        else:
            out.append(gr.update(info="" if name in F.TOPBAR_FIELDS else field_help(lang, name, table[name].description),
                                 elem_classes=[]))
    return out


def dataset_info_of(dataset_dir) -> dict:
    """The dataset_info.json mapping of the form's dataset folder (the bundled one when empty); {} for a folder
    outside the allowed roots (validate refuses it and says why)."""
    if (dataset_dir or "").strip():
        try:
            allowed.check_read(dataset_dir, "dataset_dir")
        except allowed.PathRefused:
            return {}
    return choices.dataset_info((dataset_dir or "").strip() or None)


def dataset_for_stage(stage, dataset, dataset_dir, lang: str = "en") -> tuple:
    """After a stage change: the dataset picker offers the sets that fit the stage (backend/stages declares
    its data kind), and a current set that does not fit is switched to one that does, said in one line.
    Inputs: stage, dataset, dataset folder, language. Outputs: dataset, message."""
    info = dataset_info_of(dataset_dir)
    value, misfits = D.fit_dataset(stage, dataset, info)
    offered = D.fitting_datasets(stage, info)
    if not misfits:
        return gr.update(choices=offered), gr.skip()
    kind = D.stage_data_kind(stage) or "plain"
    stage_label = dict((i, label) for label, i in choice_pairs(lang, "train-stage", [stage])).get(stage, stage)
    message = tr(lang, "msg.dataset_switched", stage=stage_label, kind=tr(lang, f"data_kind.{kind}"),
                 old=", ".join(misfits), new=value or "–")
    return gr.update(choices=offered, value=value), message


def errors_md(errors: list[tuple[str, str]], lang: str = "en") -> str:
    return f"**{tr(lang, 'msg.fix_these')}**\n\n" + "\n".join(f"- `{f}`: {m}" for f, m in errors)


def preview_of(spec) -> tuple[str, str]:
    """(exact command, YAML) of what Start would run."""
    spec = spec.with_output_dir()
    spec_path = Path(spec.output_dir) / jobs.SPEC_FILE
    command = shlex.join(jobs.train_argv(spec_path))
    if spec.nnodes > 1:  # Start runs node 0 here; each other node is started by hand (ssh, a scheduler)

        others = launch_commands([str(spec_path)], spec)[1:]
        command += ("\n\n# the other nodes (each needs this spec file and the model, data and run folder "
                    "paths, e.g. on a shared disk):\n" + "\n".join(others))
    return command, spec.to_yaml()



SPEC_SUFFIXES = (".yaml", ".yml")


def save_target_check(path, overwrite, lang: str = "en") -> tuple[Path | None, str]:
    """Where Save may write the spec: (resolved path, "") or (None, the refusal in `lang`)."""
    try:
        target = allowed.check_write(path or "", "spec file")
    except allowed.PathRefused as exc:
        return None, refusal(lang, exc)
    if target.suffix.lower() not in SPEC_SUFFIXES:
        return None, tr(lang, "msg.spec_suffix", path=target)
    if target.exists() and not target.is_file():
        return None, tr(lang, "msg.spec_not_file", path=target)
    if target.exists() and not overwrite:
        return None, tr(lang, "msg.spec_exists", path=target)
    return target, ""


def looks_like_spec(data: dict) -> bool:
    """An empty mapping, or one whose keys are at least half TuneBoard spec keys: only then do Load's
    errors (which quote keys and values) describe the file."""

    if not data:
        return True
    known = set(_all_keys())
    return sum(str(k) in known for k in data) * 2 >= len(data)


def spec_to_inputs(spec, top_names: list[str], names: list[str]) -> list:
    """RunSpec -> values for (top bar fields, booster, extra args, form fields)."""
    values, extra, booster = F.spec_to_values(spec, top_names + names)
    n_top = len(top_names)
    return [*values[:n_top], booster, extra, *values[n_top:]]
