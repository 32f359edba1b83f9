"""The entry point (``qkit`` and ``python -m qkit``): Ctrl-C is handled from the very first moment.

Importing the command line (typer, torch, transformers) takes a second or more; an interrupt during it
must be the same one line as any other, not a KeyboardInterrupt traceback. So this module imports
nothing of qkit's until its SIGINT handler is in place: an interrupt before ``qkit.cli.main`` installs
its own handler exits at once with ``error: interrupted; nothing was written`` and code 130 (nothing can
have been written: no command has started).
"""

from __future__ import annotations

import os
import signal
import threading

INTERRUPTED_EXIT = 130


def _interrupted_while_starting(_signum, _frame) -> None:
    # os.write, not print: the handler may run inside any import; the message is qkit.console.error's
    os.write(2, b"error: interrupted; nothing was written\n")
    os._exit(INTERRUPTED_EXIT)


def main() -> None:
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    from qkit.cli import main as cli_main  # the heavy imports; cli_main replaces the handler first thing

    cli_main()


if __name__ == "__main__":
    main()
