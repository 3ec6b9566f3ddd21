"""The ``siftpipe`` command line: one module per command group (``demo``, ``log``, ``shards``), each
defining ``add_cli(subparsers)``; this module parses, runs and reports errors without credentials."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from .._secrets import redact, secret_values
from .options import add_storage_option_flag, parse_storage_options

__all__ = ["COMMAND_MODULES", "add_storage_option_flag", "main", "parse_storage_options"]

#: Modules of ``siftpipe.cli`` that each define ``add_cli(subparsers)`` for one command group.
COMMAND_MODULES: tuple[str, ...] = ("demo", "log", "shards")


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too: they are made of the parser's class), whose usage
    errors are printed without credentials: argparse quotes what it could not take
    (``unrecognized arguments: --storage_option secret=...``, ``invalid int value: '...'``), and
    printed it in clear before siftpipe's own reporting ran (found by review, 2026-12-06)."""

    #: The credentials of the command line being parsed (``main`` sets them for its parse).
    secrets: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {redact(message, _Parser.secrets)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="siftpipe", description="Sift training data with the live model's loss; inspect the audit log."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"siftpipe.cli.{name}").add_cli(commands)
    return parser


def argv_secrets(argv: Sequence[str]) -> list[str]:
    """Credentials on a command line: in its URLs, and the values of credential-like
    ``--storage-option`` names (with those of the environment)."""
    options: dict[str, Any] = {}
    for before, arg in zip(["", *argv], argv):
        if before == "--storage-option" or arg.startswith("--storage-option="):
            key, _, value = arg.removeprefix("--storage-option=").partition("=")
            options[key.rsplit(".", 1)[-1]] = value
    return secret_values(options, *argv)


class SIGTERM(KeyboardInterrupt):
    """SIGTERM (what a scheduler, ``kill`` or a container stop sends), raised in the main thread:
    the command stops as Ctrl-C stops it, its audit log closed whole, with exit status 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    if hasattr(signal, "SIGCHLD"):
        # a SIGTERM sent to the process group stops the DataLoader workers too, and torch's
        # SIGCHLD handler would then raise "worker killed" in the middle of closing the log
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    raise SIGTERM()


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; a siftpipe error is printed as one line naming the problem (exit status 2),
    any other error as its traceback (exit status 1), both without credentials.

    Called without ``argv`` it is the program (the ``siftpipe`` script, ``python -m siftpipe``):
    a ``log`` command, which only reads, then ends the process with ``os._exit`` once its output
    is flushed, so that no native thread of the libraries it used (Arrow's, the S3 client's) can
    abort the process while the interpreter is being torn down; so does a command interrupted
    with Ctrl-C (exit status 130) or SIGTERM (143), once its own cleanup has run."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    _Parser.secrets = argv_secrets(argv)
    try:
        args = build_parser().parse_args(argv)
    finally:
        _Parser.secrets = ()
    if program and args.command == "log":
        # a reader's warning (a part missing or unreadable) is a line of the command's output, not
        # Python's warning with a source line of the library's
        secrets = argv_secrets(argv)
        said: set[str] = set()

        def show(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
            text = redact(str(message), secrets).removeprefix("siftpipe: ")  # (said once)
            line = f"siftpipe: warning: {text}"
            if line not in said:  # once: whatif lists the log for each policy it replays
                said.add(line)
                print(line, file=sys.stderr)

        warnings.showwarning = show
    if program and threading.current_thread() is threading.main_thread():
        # before 2026-12-05 SIGTERM killed `siftpipe demo` where it stood: its audit log held no
        # record and `log verify` said INCOMPLETE; now it stops as Ctrl-C does
        signal.signal(signal.SIGTERM, _on_sigterm)
    code = _run(args, argv)
    # an interrupted command too (its own cleanup has run): the threads a DataLoader's workers
    # left printed their tracebacks while the interpreter was torn down
    if program and (args.command == "log" or code in (130, 143)):
        if code in (130, 143):
            # DataLoader workers still alive would outlive os._exit and print their broken
            # connections' tracebacks after the command's last line (found by review, 2026-12-05)
            import multiprocessing

            for child in multiprocessing.active_children():
                child.terminate()
            for child in multiprocessing.active_children():
                child.join(timeout=2.0)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    return code


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from ..errors import SiftError

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe can still be told apart from an error
        return code
    except BrokenPipeError:
        # the reader went away (`siftpipe log keys ... | head`): stop quietly, as Unix tools do;
        # stdout goes to /dev/null so the interpreter's final flush does not complain again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE: what a shell reports for a tool that a closed pipe ended
    except SiftError as exc:
        # one line: a cause's message may span lines (botocore's parameter checks do)
        said = " ".join(redact(str(exc), argv_secrets(argv)).splitlines())
        print(f"siftpipe: error: {said}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # Ctrl-C: what the command wrote so far is closed (its audit log included: the program
        # ends with os._exit, which runs no exit handler); no traceback
        from ..audit.log import close_open_logs

        close_open_logs()
        terminated = isinstance(exc, SIGTERM)
        print(f"siftpipe: {'terminated (SIGTERM)' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130  # 128 + the signal, as a shell reports it
    except Exception as exc:
        secrets = argv_secrets(argv)
        text = "".join(traceback.format_exception(exc))
        print(redact(text, secrets), file=sys.stderr, end="")
        return 1
