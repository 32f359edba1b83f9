"""Where independent work runs: here, one item after another (``serial``), or as Ray tasks (``ray``).

Layer 1 (beside ``threads``). ``qkit eval``'s torch rows and ``qkit plan``'s per-tensor candidate costs
are each a function of one item and a shared context; an ``Executor`` maps such a function over the
items and yields the results **in the items' order**, whichever finished first, so a table or a plan
built from them is the serial one. ``--executor ray`` (``--ray-address HOST:PORT``: a running cluster,
``ray start --head`` prints it; without it a local cluster is started for the run and shut down after)
runs each item as one Ray task. Ray is an optional install (``pip install 'qkit[ray]'``), imported only
in ``RayExecutor``.

The same numbers: each task sets torch's intra-op threads to the driver's count first (Ray starts its
workers with one; torch's CPU reductions split by thread count, so a different count could round
differently), and reads its inputs from the files the driver reads (the model's safetensors, a file
the driver wrote), never from a copy made another way.

A worker that dies mid-task (killed, out of memory, its node lost) is **not retried**
(``max_retries=0``): the run stops with one ``ExecutorError`` line, and
nothing is written (every qkit output is staged and moved into place only at the end); the tasks still
running end with the run's Ray job. A task that
raises a ``QkitError`` re-raises it in the driver as it is; any other exception likewise (its traceback
is a bug report, as in a serial run).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from qkit.errors import ExecutorError, InputError

SERIAL, RAY = "serial", "ray"
EXECUTORS = (SERIAL, RAY)
RAY_EXTRA = "pip install 'qkit[ray]'"
CONNECT_TIMEOUT_S = 3.0  # the --ray-address reachability probe: ray.init itself waits minutes on a dead address

T = TypeVar("T")
R = TypeVar("R")


class Executor(Protocol):
    """Maps ``fn(shared, item)`` over ``items``, yielding the results in the items' order."""

    name: str
    parallel: bool  # True: items run in other processes (``fn`` and its arguments are pickled)

    def map(self, fn: Callable[[Any, T], R], items: Iterable[T], shared: Any = None) -> Iterator[R]:
        ...


class SerialExecutor:
    """Here, one item after another (the default): ``fn(shared, item)`` for each item, lazily."""

    name = SERIAL
    parallel = False

    def map(self, fn: Callable[[Any, T], R], items: Iterable[T], shared: Any = None) -> Iterator[R]:
        return (fn(shared, item) for item in items)


SERIAL_EXECUTOR = SerialExecutor()


def _in_worker(fn: Callable[[Any, T], R], threads: int, shared: Any, item: T) -> R:
    """One Ray task: torch at the driver's thread count, then ``fn(shared, item)``."""
    import torch  # the task's own process: torch's pool is per process

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return fn(shared, item)


class RayExecutor:
    """Each item one Ray task (``num_cpus=1``, ``max_retries=0``), on the cluster ``ray.init`` connected to.
    ``shared`` is put in the object store once and handed to every task by reference."""

    name = RAY
    parallel = True

    def __init__(self, threads: int):
        self.threads = threads

    def map(self, fn: Callable[[Any, T], R], items: Iterable[T], shared: Any = None) -> Iterator[R]:
        import ray  # optional (qkit[ray]): only here
        from ray.exceptions import RayTaskError, TaskCancelledError

        task = ray.remote(num_cpus=1, max_retries=0)(_in_worker)
        ref = ray.put(shared)
        pending = [task.remote(fn, self.threads, ref, item) for item in items]
        # On an error the tasks still running are not cancelled here: ray.cancel(force=True) on a task that
        # is finishing crashed Ray's core worker in the driver (2.60: "Tried to complete task that was not
        # pending", the process aborted). They end with the job, when ``open`` disconnects (ray.shutdown).
        for i, future in enumerate(pending):
            try:
                yield ray.get(future)
            except RayTaskError as e:  # the task raised: the same exception as a serial run's
                cause = getattr(e, "cause", None)
                if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
                    raise cause from None
                raise ExecutorError(f"a Ray task failed: {_first_line(e)}") from None
            except TaskCancelledError:
                raise ExecutorError("a Ray task was cancelled before it finished; nothing was written") from None
            except ray.exceptions.RayError as e:  # the worker or its node died: not retried
                raise ExecutorError(
                    f"a Ray worker died while running task {i + 1} of {len(pending)} ({type(e).__name__}: "
                    f"{_first_line(e)}); the run stopped and nothing was written (tasks are not retried: "
                    "run again, with fewer workers or more memory per worker if it was killed for memory)"
                ) from None


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:200]


@dataclass(frozen=True)
class ExecutorOptions:
    """``--executor`` (serial, ray) and ``--ray-address`` (HOST:PORT or ray://HOST:PORT of a running
    cluster; None with ray: a local cluster for this run)."""

    name: str = SERIAL
    address: str | None = None

    def validate(self) -> None:
        """Every check before the model is touched (milliseconds, but a connection probe of ``address``)."""
        if self.name not in EXECUTORS:
            raise InputError(f"unknown executor {self.name!r}; use one of: {', '.join(EXECUTORS)}")
        if self.name != RAY:
            if self.address is not None:
                raise InputError("--ray-address is for --executor ray; add --executor ray or drop --ray-address")
            return
        if importlib.util.find_spec("ray") is None:
            raise InputError(f"--executor ray needs Ray: {RAY_EXTRA}")
        if self.address is not None:
            check_reachable(self.address)

    @contextlib.contextmanager
    def open(self, threads: int) -> Iterator[Executor]:
        """The executor for a run: serial, or Ray connected (``ray.init``) for the block and disconnected
        after (``ray.shutdown``; a local cluster this started is stopped with it). Ray already initialised
        by the caller (a script's own ``ray.init``) is used as it is and left running."""
        self.validate()
        if self.name == SERIAL:
            yield SERIAL_EXECUTOR
            return
        import ray  # optional (qkit[ray]): only here

        started = not ray.is_initialized()
        if started:
            _quiet_ray_errors()
            kwargs: dict[str, Any] = ({"address": self.address} if self.address is not None else
                                      {"address": "local", "include_dashboard": False})
            try:
                ray.init(**kwargs, log_to_driver=False, logging_level=logging.ERROR)
            except (ConnectionError, RuntimeError, ValueError, OSError) as e:
                with contextlib.suppress(Exception):
                    ray.shutdown()
                where = self.address or "a local cluster"
                auth = ("; the cluster uses Ray's token authentication: give this process its token (RAY_AUTH_MODE=token "
                        "and ~/.ray/auth_token or RAY_AUTH_TOKEN)" if "auth" in str(e).lower() else "")
                raise InputError(f"--executor ray: cannot start or connect to {where} ({_first_line(e)}){auth}") from None
        try:
            yield RayExecutor(threads)
        finally:
            if started:
                ray.shutdown()


def _quiet_ray_errors() -> None:
    """Ray's driver prints every worker death it hears of (a multi-line ``(raylet) A worker died ...``) on
    stdout from a thread of its own; qkit says it in one line instead (``ExecutorError``). The switch is a
    module global of Ray (2.60, pinned in qkit[ray]); absent in another version, Ray's lines stay."""
    with contextlib.suppress(ImportError, AttributeError):
        from ray._private import worker

        if hasattr(worker, "_worker_logs_enabled"):
            worker._worker_logs_enabled = False


def check_reachable(address: str) -> None:
    """Refuse, in one line, a ``--ray-address`` that is malformed or where nothing listens (a TCP connect
    within ``CONNECT_TIMEOUT_S``): ``ray.init`` would retry for minutes first."""
    host_port = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = host_port.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--ray-address {address!r} must be HOST:PORT (or ray://HOST:PORT), e.g. 127.0.0.1:6379 "
                         "(what `ray start --head` prints)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise InputError(f"--ray-address {address}: no Ray cluster answers there ({e.strerror or e}); start one with "
                         "`ray start --head` or drop --ray-address to start a local one") from None


def executor_options(executor: str | None, address: str | None) -> ExecutorOptions:
    """The options the command line gave (None: the default)."""
    return ExecutorOptions(executor.strip().lower() if executor is not None else SERIAL, address)


__all__ = ["EXECUTORS", "Executor", "ExecutorOptions", "RAY", "RAY_EXTRA", "RayExecutor", "SERIAL",
           "SERIAL_EXECUTOR", "SerialExecutor", "check_reachable", "executor_options"]
