"""`tuneboard` command line: train | validate | preview | chat | api | export | webui.

Every command that takes a run spec takes it the same way: an optional YAML file followed by
`key=value` overrides (LLaMA-Factory's key vocabulary), validated by backend.core.spec before anything
heavy is imported.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import os
import select
import sys
import warnings

USAGE = """usage: tuneboard <command> [args]

commands:
  train    [SPEC.yaml] [key=value ...]   train a model (SFT, PT, ...) into a run directory
  validate SPEC.yaml [key=value ...]     check a spec; print "ok" and the resolved spec, or the errors
  probe    SPEC.yaml [key=value ...]     measure a run's peak memory and s/step in 2 steps (longest rows first)
  preview  --dataset NAME | --messages FILE.json [options]
                                         show how rows are templated and which tokens are trained
  lint     SPEC.yaml [key=value ...] [--fix drop_duplicates,drop_leaks,drop_empty] [--json]
                                         find duplicates, eval leaks, cut answers, ... in a run's data
  chat     [SPEC.yaml] [key=value ...] [--query TEXT]
                                         talk to a model (+ adapter) in the terminal
  api      [SPEC.yaml] [key=value ...] [--model M] [--adapter PATH ...] [--port P] [--api-key K]
                                         OpenAI-compatible HTTP server
  export   SPEC.yaml [key=value ...]     merge adapters and export (safetensors / GGUF), verified
  eval     SPEC.yaml [key=value ...]     eval loss / perplexity and predictions with metrics
  distill  SPEC.yaml [key=value ...]     documents + a teacher -> a registered dataset -> fine-tune -> scorecard
  promote  RUN_DIR checkpoint-N | --undo  make a checkpoint the run's adapter (the final one kept), or undo it
  webui    [--host H] [--port P] ...     the web UI
  fields                                 list every spec key with its description

Run `tuneboard <command> --help` for a command's options.
"""


from backend.core import supervise  # light: no torch
from backend.training import allocator
from backend.core.launch import launch_commands, visible_accelerators  # light: no torch
from backend.core.spec import load_or_report, spec_fields  # light: no torch
from backend.core.train_rules import train_command_errors  # light: no torch


def _offline_env() -> None:
    # Nothing may be downloaded here: fail fast instead of hanging on a hub lookup.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    # HF's `kernels` (imported with bitsandbytes) warns on every start that offline it skips a hub trust check
    # of kernels nothing here downloads: noise in every command's output
    logging.getLogger("kernels").setLevel(logging.ERROR)
    # peft reads transformers' renamed `is_gradient_checkpointing` on every adapter load (chat, eval, export, api)
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    if not os.environ.get("DS_ACCELERATOR"):  # DeepSpeed (imported by transformers) warns when it has to guess
        if not visible_accelerators():
            os.environ["DS_ACCELERATOR"] = "cpu"


def cmd_validate(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print("usage: tuneboard validate SPEC.yaml [key=value ...]")
        return 0 if args else 2
    spec = load_or_report(args)
    if spec is None:
        return 1
    print("ok")
    print(spec.to_yaml(), end="")
    return 0


def cmd_train(args: list[str]) -> int:
    if args and args[0] in ("-h", "--help"):
        print("usage: tuneboard train [--print-launch] [SPEC.yaml] [key=value ...]\n\n"
              "--print-launch: print the command that starts each node of a multi-node run (nnodes, master_addr)"
              " and exit\n\nkeys: see `tuneboard fields`")
        return 0
    print_launch = "--print-launch" in args
    args = [a for a in args if a != "--print-launch"]
    spec = load_or_report(args)
    if spec is None:
        return 1
    for key, message in train_command_errors(spec)[:1]:
        print(f"error: {key}: {message}", file=sys.stderr)
        return 1
    if print_launch:
        for node, line in enumerate(launch_commands(args, spec)):
            print(f"# node {node}" + (" (main: writes the run folder)" if node == 0 else ""))
            print(line)
        return 0
    from backend.training.train import run  # lazy: a command loads only what it runs

    return run(spec, args)


def cmd_probe(args: list[str]) -> int:
    from backend.training.probe import main as probe_main  # lazy: a command loads only what it runs

    return probe_main(args)


def cmd_fields(args: list[str]) -> int:
    for f in spec_fields():
        choices = f" [{' | '.join(map(str, f['choices']))}]" if f.get("choices") else ""
        print(f"{f['name']:<32} {f['description']}{choices} (default: {f['default']!r})")
    return 0


def cmd_preview(args: list[str]) -> int:
    from backend.dataprep.preview import main as preview_main  # lazy: a command loads only what it runs

    return preview_main(args)


def cmd_lint(args: list[str]) -> int:
    from backend.dataprep.lint import main as lint_main  # lazy: a command loads only what it runs

    return lint_main(args)


def cmd_chat(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tuneboard chat", description="Chat with a model (+ adapter) in the terminal.")
    parser.add_argument("spec", nargs="*", help="[SPEC.yaml] [key=value ...] (model_name_or_path, adapter_name_or_path, template, ...)")
    parser.add_argument("--query", help="ask one question, print the answer and exit")
    opts = parser.parse_intermixed_args(args)  # key=value after --query TEXT too
    spec = load_or_report(opts.spec)
    if spec is None:
        return 1
    from backend.serving.chat import main as chat_main  # lazy: a command loads only what it runs

    return chat_main(spec, query=opts.query)


def cmd_api(args: list[str]) -> int:
    from backend.serving.api import main as api_main  # lazy: a command loads only what it runs

    return api_main(args)


def cmd_not_yet(name: str):
    def run(args: list[str]) -> int:
        print(f"error: not implemented yet: tuneboard {name}", file=sys.stderr)
        return 2

    return run


def cmd_distill(args: list[str]) -> int:
    from backend.distill.pipeline import main as distill_main  # lazy: a command loads only what it runs

    return distill_main(args)


def cmd_promote(args: list[str]) -> int:
    from backend.core.promote import main as promote_main  # lazy: a command loads only what it runs

    return promote_main(args)


def cmd_webui(args: list[str]) -> int:
    try:
        from webui.app import main as webui_main  # lazy: a command loads only what it runs
    except ImportError as exc:
        print(f"error: the web UI is not available: {exc}", file=sys.stderr)
        return 2
    return webui_main(args)


def cmd_export(args: list[str]) -> int:
    from backend.exporting.export import main as export_main  # lazy: a command loads only what it runs

    return export_main(args)


def cmd_eval(args: list[str]) -> int:
    from backend.evaluation.evaluate import main as eval_main  # lazy: a command loads only what it runs

    return eval_main(args)


COMMANDS = {
    "train": cmd_train,
    "validate": cmd_validate,
    "probe": cmd_probe,
    "preview": cmd_preview,
    "lint": cmd_lint,
    "chat": cmd_chat,
    "api": cmd_api,
    "export": cmd_export,
    "eval": cmd_eval,
    "distill": cmd_distill,
    "promote": cmd_promote,
    "webui": cmd_webui,
    "fields": cmd_fields,
}


def _stdout_gone() -> bool:
    """stdout is a pipe whose reader has closed it (`tuneboard validate spec | head -1`): poll reports an error on
    the write end of such a pipe."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is no file
        return False


def main(argv: list[str] | None = None) -> int:
    """Run a command; its exit code. A reader of stdout that goes away (`| head -1`) ends the command quietly, as
    Python's documentation of SIGPIPE recommends, instead of a BrokenPipeError traceback."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # the last buffered output meets a closed pipe here, not at interpreter exit
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # another pipe than stdout's (a subprocess, a socket): a real error
        # Python flushes stdout again at exit: point it at devnull so that write cannot fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(argv: list[str] | None) -> int:
    own_command_line = argv is None  # this process's own command line (not a call from Python): may re-execute
    argv = list(sys.argv[1:] if argv is None else argv)
    _offline_env()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"error: unknown command '{argv[0]}'{hint}\n\n{USAGE}", file=sys.stderr, end="")
        return 2
    if command is cmd_train and own_command_line and supervise.available():
        try:
            env = allocator.preload_env()  # jemalloc/tcmalloc preloaded when installed: see backend/training/allocator.py
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # the training process runs as a watched child, with the allocator preloaded: backend/core/supervise.py
        return supervise.run([sys.executable, *sys.orig_argv[1:]], env or dict(os.environ))
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
