"""The preloaded driver's server: imports what a submit needs once, then forks a child per command
that becomes that command (rayapp.cli.preloaded has the whole story and the command's side).

    python -m rayapp.cli.preloaded_server SOCKET      # started by `rayapp cluster up`

Forking is safe only in a process with one thread: a thread that holds a lock (an allocator's, a
thread pool's, the import lock) at the fork leaves it held for ever in the child, which then hangs
or corrupts its state. So the server does nothing but import and wait on its socket; it starts no
thread, uses none of the libraries it imported (no Ray connection, no MLflow client, no tensor),
imports them with the two settings that keep their imports from starting threads
(:data:`SINGLE_THREADED_IMPORTS`), and counts its threads (the kernel's count, which sees native
threads Python does not) before every fork: with more than one it declines, and the command runs
in its own process.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import socket
import sys
import time
from pathlib import Path

import psutil

from rayapp.cli.preloaded import (
    PRELOAD,
    import_time_environment,
    interpreter_identity,
    receive_request,
    send_message,
)
from rayapp.launch import preloaded_signals

SINGLE_THREADED_IMPORTS = {
    # numpy's OpenBLAS starts a pool of (cores - 1) threads when loaded, with torch and pandas.
    # The driver does no BLAS work: its children run numpy's BLAS on one thread.
    "OPENBLAS_NUM_THREADS": "1",
    # pyarrow's jemalloc (loaded with MLflow, through pandas) starts a background purging thread;
    # without it jemalloc purges as it allocates.
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}
"""Set in the server alone, for its imports; not passed on to the commands' environment."""


def serve(socket_path: str) -> None:
    """Import PRELOAD, then fork a child per request, forever (SIGTERM ends it)."""
    before = dict(os.environ)
    environment = import_time_environment(before)  # before the imports add their own
    os.environ.update(SINGLE_THREADED_IMPORTS)
    for name in PRELOAD:
        importlib.import_module(name)
    threads = _threads()
    if threads:
        sys.exit(f"rayapp preloaded driver: {threads}; it would decline every command")
    fingerprint = _fingerprint()
    # What the imports set for themselves (Ray: RAY_CLIENT_MODE=0), as they would in the command.
    set_by_imports = {
        name: value
        for name, value in os.environ.items()
        if name not in before and name not in SINGLE_THREADED_IMPORTS
    }
    preloaded_signals.serve_until_terminated(lambda: _stop(socket_path))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = f"{socket_path}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(partial)
    old_umask = os.umask(0o177)  # the socket is the user's alone, as the state file is
    try:
        listener.bind(partial)
    finally:
        os.umask(old_umask)
    listener.listen(8)
    os.rename(partial, socket_path)  # it appears only once it accepts
    print(f"rayapp preloaded driver {os.getpid()}: listening on {socket_path}", flush=True)
    while True:
        connection, _ = listener.accept()
        try:
            request, descriptors = receive_request(connection)
        except (OSError, ValueError) as exc:
            print(f"rayapp preloaded driver: a bad request ({exc})", flush=True)
            connection.close()
            continue
        refusal = _refusal(request, fingerprint, environment) or _threads()
        command = " ".join(request.get("argv", [])[1:])
        child = -1
        if not refusal:
            try:
                child = os.fork()
            except OSError as exc:  # out of memory or processes: the command runs in its own
                refusal = f"cannot fork ({exc})"
        if refusal:
            send_message(connection, {"refused": refusal})
            _wait_until_read(connection)
            print(f"{time.strftime('%H:%M:%S')} declined `{command}`: {refusal}", flush=True)
        elif child == 0:
            listener.close()
            _become(request, descriptors, connection, set_by_imports)  # never returns
        else:
            print(
                f"{time.strftime('%H:%M:%S')} process {child}: `{command}` in {request['cwd']}",
                flush=True,
            )
        for descriptor in descriptors:
            os.close(descriptor)
        connection.close()


def _wait_until_read(connection: socket.socket, timeout_s: float = 5.0) -> None:
    """Close only once the command has read the reply and closed its end (or after timeout_s).
    Closed at once, the reply could be lost to the command: once in a test it said the connection
    closed unanswered, where the server had sent why it declined."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_WR)
        connection.settimeout(timeout_s)
        while connection.recv(4096):
            pass


def _threads() -> str:
    """'' when this process has one thread, the only state in which a fork is safe; else why not."""
    count = psutil.Process().num_threads()
    if count == 1:
        return ""
    return f"the preloaded driver runs {count} threads, and forking it is safe only with one"


def _stop(socket_path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    os._exit(0)


def _fingerprint() -> dict[str, list]:
    """Identity of the code this process runs: rayapp's files and each preloaded library's
    top-level file (a reinstall replaces it: a new inode)."""
    import rayapp

    files = sorted(str(path) for path in Path(rayapp.__file__).parent.rglob("*.py"))
    for name in {name.split(".")[0] for name in PRELOAD}:
        files.append(str(sys.modules[name].__file__))
    stamps: dict[str, list] = {}
    for path in files:
        with contextlib.suppress(OSError):
            status = os.stat(path)
            stamps[path] = [status.st_ino, status.st_mtime_ns, status.st_size]
    return stamps


def _refusal(request: dict, fingerprint: dict, environment: dict[str, str]) -> str:
    """Why the command must run in its own process, or '' when a child of this server will do."""
    if request.get("interpreter") != interpreter_identity():
        return "the command's Python or its flags differ from the server's"
    differing = sorted(
        name
        for name in {*environment, *import_time_environment(request["env"])}
        if environment.get(name) != request["env"].get(name)
    )
    if differing:
        names = ", ".join(differing[:3]) + (" ..." if len(differing) > 3 else "")
        return f"{names} set differently than at `cluster up`"
    if request.get("origins") != {
        name: sys.modules[name].__file__ for name in request.get("origins", {})
    } or set(request.get("origins", {})) != {name.split(".")[0] for name in PRELOAD}:
        return "the command would import rayapp or its libraries from elsewhere than the server did"
    if _fingerprint() != fingerprint:
        return "rayapp or a library it preloads changed on disk since `cluster up`"
    return ""


def _become(
    request: dict, descriptors: list[int], connection: socket.socket, set_by_imports: dict
) -> None:
    """In the forked child: take on the command's streams, directory, environment and arguments,
    then run it as `rayapp` would run it; the exit status goes back to the waiting command."""
    exit_code = 1
    try:
        # Out of the server's session: `cluster down` stopping the server leaves runs be.
        os.setsid()
        for target, descriptor in enumerate(descriptors):
            os.dup2(descriptor, target)
            os.close(descriptor)
        preloaded_signals.as_the_command(request["sigint_ignored"])
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update({**set_by_imports, **request["env"]})
        sys.argv = request["argv"]
        sys.path[:] = request["path"]
        _reopen_standard_streams(request["streams"])
        send_message(connection, {"pid": os.getpid()})
        preloaded_signals.terminate_when_closed(connection)

        from rayapp.cli.program import run_here
        from rayapp.launch import warm

        warm.PRELOADED_DRIVER = True
        exit_code = run_here()
    except BaseException as exc:  # nothing may unwind into the server's loop
        print(
            f"rayapp: the preloaded driver could not run the command: {exc}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        with contextlib.suppress(OSError):
            send_message(connection, {"exit": exit_code})
        os._exit(exit_code)


def _reopen_standard_streams(settings: dict) -> None:
    """Python chose the server's stream buffering and encoding at its start (no terminal then);
    the command's streams get what Python gave the command: its encoding and errors, line
    buffering on a terminal, no buffering where it was unbuffered (-u, PYTHONUNBUFFERED)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        encoding, errors, write_through = settings[name]
        binary = open(
            fd,
            "rb" if fd == 0 else "wb",
            buffering=0 if write_through and fd else -1,
            closefd=False,
        )
        stream = io.TextIOWrapper(
            binary,
            encoding=encoding,
            errors=errors,
            write_through=write_through,
            line_buffering=fd == 2 or (fd == 1 and os.isatty(fd)),
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


if __name__ == "__main__":
    serve(sys.argv[1])
