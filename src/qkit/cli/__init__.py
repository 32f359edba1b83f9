"""The command line: the only package that imports typer; thin: parse, call the library, render, exit.

One module per command family (``quantize``: quantize and verify; ``imatrix``; ``plan``; ``eval``; ``inspect``;
``serving``: kv, budget, speculate, bench, simulate; ``report``: the HTML page of the others' JSON), the shared
option aliases, error handling and parsing in ``common``.
This module makes the ``app``, registers every command (in the order ``qkit --help`` lists them) and holds
the entry point. Every option is defined once (an ``Annotated`` alias) and takes its default from the
library. Library errors (``QkitError``) become one line on stderr and a non-zero exit code, never a
traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import typer

from qkit import console, processes, staging
from qkit.errors import QkitError

app = typer.Typer(
    name="qkit",
    help="Quantize language-model weights and measure, honestly, what it cost.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    """qkit: quantize language-model weights and measure what it cost."""
    console.show_library_status()  # downloads and conversions the library logs become status lines


from qkit.cli import eval as _eval  # noqa: E402  (the modules need nothing from here but the app)
from qkit.cli import imatrix as _imatrix  # noqa: E402
from qkit.cli import inspect as _inspect  # noqa: E402
from qkit.cli import plan as _plan  # noqa: E402
from qkit.cli import quantize as _quantize  # noqa: E402
from qkit.cli import report as _report  # noqa: E402
from qkit.cli import serving as _serving  # noqa: E402

app.command("quantize")(_quantize.quantize)
app.command("imatrix")(_imatrix.imatrix)
app.command("plan")(_plan.plan)
app.command("eval")(_eval.eval_)
app.command("kv")(_serving.kv_)
app.command("budget")(_serving.budget_)
app.command("speculate")(_serving.speculate_)
app.command("bench")(_serving.bench_)
app.add_typer(_serving.simulate_app, name="simulate")
app.command("verify")(_quantize.verify)
app.add_typer(_inspect.inspect_app, name="inspect")
app.command("report")(_report.report)


INTERRUPTED = "interrupted; nothing was written"  # before any output was put in place (see _exit_interrupted)
INTERRUPTED_EXIT = 130  # 128 + SIGINT, the shell's code for a process Ctrl-C ended
TERMINATED_EXIT = 128 + signal.SIGTERM  # 143: the shell's code for SIGTERM, which `timeout` and systemd expect
_STOPPING = (signal.SIGINT, signal.SIGTERM)
_interrupted = threading.Event()
_terminated = threading.Event()  # the interrupt was SIGTERM


def _on_stop(signum, frame) -> None:
    """Ctrl-C (SIGINT) or SIGTERM (``timeout``, systemd, ``docker stop``): note it (typer turns the
    KeyboardInterrupt into a bare exit code 130, so ``main`` could not tell it from a command's own exit),
    then raise KeyboardInterrupt as Python's own handler does: it unwinds every ``with``/``finally``, so
    each atomic write removes its staging sibling, each scratch directory is removed and each process
    group qkit started is killed (``qkit.processes``). A second signal while that runs ends those groups
    and kills the process at once (``_stop_now``); the next run removes what it left
    (``qkit.staging.remove_stale_siblings``)."""
    _interrupted.set()
    if signum == signal.SIGTERM:
        _terminated.set()
    for s in _STOPPING:
        signal.signal(s, _stop_now)
    signal.default_int_handler(signum, frame)


def _stop_now(signum, _frame) -> None:
    """The second Ctrl-C or SIGTERM: kill qkit's child process groups, then die of the signal (its default action)."""
    processes.kill_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _exit_interrupted() -> None:
    # True either way: "nothing was written" only while no output was put in place (a staged write in
    # progress is removed as the stack unwinds); after one was, "interrupted after writing PATH". SIGTERM
    # says so ("terminated (SIGTERM); ...") and exits 143, as a process the signal ended would.
    message = staging.interrupted_message()
    if _terminated.is_set():
        message = "terminated (SIGTERM)" + message.removeprefix("interrupted")
    console.error(message)
    sys.exit(TERMINATED_EXIT if _terminated.is_set() else INTERRUPTED_EXIT)


def main() -> None:
    """Entry point (called by ``qkit.__main__``, which handles Ctrl-C while this module imports): usage
    errors and ``QkitError`` become one line on stderr and exit code 2; Ctrl-C becomes the one line
    ``error: interrupted; nothing was written`` (or ``interrupted after writing PATH``) and exit code 130,
    SIGTERM ``error: terminated (SIGTERM); nothing was written`` and exit code 143, after the same cleanup."""
    import importlib

    # typer vendors click in some versions: take the exception classes from wherever typer's come from.
    cx = importlib.import_module(typer.BadParameter.__module__)
    no_args = getattr(cx, "NoArgsIsHelpError", ())
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        for s in _STOPPING:
            signal.signal(s, _on_stop)
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:  # outside a command's body (typer converts those to exit code 130)
        _exit_interrupted()
    except no_args as exc:  # bare ``qkit`` or a bare sub-app: show its help
        text = exc.ctx.get_help()  # typer's rich help prints itself and returns ""
        if text:
            print(text)
        sys.exit(0)
    except cx.UsageError as exc:  # unknown option, missing argument, bad value
        where = exc.ctx.command_path if exc.ctx is not None else "qkit"
        console.error(f"{exc.format_message()} (see '{where} --help')")
        sys.exit(exc.exit_code)
    except typer.Abort:  # end of input at a prompt (qkit itself never prompts)
        _exit_interrupted()
    except QkitError as exc:  # raised outside a command body
        console.error(str(exc))
        sys.exit(exc.exit_code)
    if _interrupted.is_set():
        _exit_interrupted()
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "main"]
