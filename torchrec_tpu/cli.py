"""`torchrec-tpu` command line: one entry point, one subcommand per job.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Only the chosen subcommand's module is imported, so ``torchrec-tpu --help`` stays instant even
though the jobs themselves pull in torch, jax and ray.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
from typing import NoReturn, Sequence

from torchrec_tpu import __version__
from torchrec_tpu.cli_help import DefaultsOnceFormatter, HintingParser, refusals
from torchrec_tpu.suggest import close_match

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("torchrec_tpu.train.cli", "train DLRM end to end (default: embedded synthetic data)"),
    "plan": ("torchrec_tpu.planner.cli", "plan embedding-table sharding onto a TPU slice"),
    "data": ("pipelines.cli", "prepare data: convert Criteo TSV/CSV to Parquet, generate synthetic"),
    "infer": ("torchrec_tpu.inference.cli", "batch inference over Parquet with a trained checkpoint"),
    "export": ("torchrec_tpu.inference.export_cli",
               "export a checkpoint as a self-contained model directory (quantized tables, torch.export towers)"),
    "profile": ("torchrec_tpu.profiling.cli", "profile training steps (torch.profiler + jax.profiler)"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s module (if any) is imported to fill its arguments."""
    parser = HintingParser(
        prog="torchrec-tpu",
        description="Recommendation models on Cloud TPU: train, plan, infer, export, profile.",
    )
    parser.add_argument("--version", action="version", version=f"torchrec-tpu {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text,
                                    formatter_class=DefaultsOnceFormatter)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand parser ``args`` was parsed by (``data generate``'s, say)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None):
            return _chosen_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def _suggestions(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """`` (did you mean --batch-size?)`` for each unknown flag close to one of ``parser``'s."""
    known = [flag for action in parser._actions if action.help != argparse.SUPPRESS for flag in action.option_strings]
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("--")]
    matches = [(flag, close_match(flag, known)) for flag in flags]
    hints = [f"{match} for {flag}" if len(flags) > 1 else match for flag, match in matches if match]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; any exception it lets through becomes one ``torchrec-tpu CMD: error:`` line,
    rc 2 for a user error and 1 otherwise (:func:`torchrec_tpu.errors.report_failure`), Ctrl-C rc 130."""
    argv_given = argv
    argv = list(sys.argv[1:] if argv is None else argv)
    from torchrec_tpu import launcher

    command = next((a for a in argv if not a.startswith("-")), None)
    # before the slow imports: a rank never outlives its launcher and always stops on SIGTERM
    if launcher.under_torchrun():
        launcher.die_with_parent()
    if (launcher.is_rank() or argv_given is None) and threading.current_thread() is threading.main_thread():
        launcher.prepare_process(f"torchrec-tpu {command or ''}".strip())
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    refused = refusals(args, unknown)
    if refused:  # every refusal of the line at once, with the usage of the (sub)command they were given to
        chosen = _chosen_parser(parser, args)
        chosen.error(f"{refused}{_suggestions(chosen, unknown)}")
    label = _chosen_parser(parser, args).prog.removeprefix("torchrec-tpu ")  # "data convert", say
    from torchrec_tpu.log_setup import configure_logging

    configure_logging(label)
    if launcher.is_rank():  # a stalled peer the main thread may wait for without a timeout
        from torchrec_tpu import rank_watch

        rank_watch.on_stall(lambda error: _leave_rank(label, error))
    args._restartable = argv_given is None  # a real command line: it may exec itself again
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write(launcher.stop_line(f"torchrec-tpu {label}", "interrupted"))
        return 130
    except Exception as error:  # noqa: BLE001  (the one place every failure is reported)
        if launcher.is_rank():
            _leave_rank(label, error)
        from torchrec_tpu.errors import report_failure

        return report_failure(label, error)


_leaving = threading.Lock()


def _leave_rank(label: str, error: BaseException) -> NoReturn:
    """Report ``error`` and end this rank now: tearing down while background threads still sit in
    collectives with peers that are gone aborts the process (SIGABRT, rc 134). The first thread
    to come (the main one, or the heartbeat's on a stall) reports; a later one waits for the exit."""
    if not _leaving.acquire(blocking=False):
        threading.Event().wait()
    from torchrec_tpu.errors import report_failure

    rc = report_failure(label, error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
