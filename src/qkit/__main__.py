"""The entry point (``qkit`` and ``python -m qkit``): Ctrl-C and SIGTERM are handled from the very first moment.

Importing the command line (typer, torch, transformers) takes a second or more; an interrupt during it
must be the same one line as any other, not a KeyboardInterrupt traceback (nor, for SIGTERM, a silent
death). So this module imports nothing of qkit's until its handlers are in place: an interrupt before
``qkit.cli.main`` installs its own exits at once with ``error: interrupted; nothing was written`` and code
130, SIGTERM with ``error: terminated (SIGTERM); nothing was written`` and code 143 (nothing can have been
written and no process started: no command has started).
"""

from __future__ import annotations

import os
import signal
import threading

INTERRUPTED_EXIT = 130  # 128 + SIGINT
TERMINATED_EXIT = 143  # 128 + SIGTERM


def _interrupted_while_starting(signum, _frame) -> None:
    # os.write, not print: the handler may run inside any import; the messages are qkit.cli's
    if signum == signal.SIGTERM:
        os.write(2, b"error: terminated (SIGTERM); nothing was written\n")
        os._exit(TERMINATED_EXIT)
    os.write(2, b"error: interrupted; nothing was written\n")
    os._exit(INTERRUPTED_EXIT)


def main() -> None:
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        signal.signal(signal.SIGINT, _interrupted_while_starting)
        signal.signal(signal.SIGTERM, _interrupted_while_starting)
    from qkit.cli import main as cli_main  # the heavy imports; cli_main replaces the handler first thing

    cli_main()


if __name__ == "__main__":
    main()
