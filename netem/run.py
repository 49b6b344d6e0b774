"""Run commands and Python callables inside network namespaces, and always clean them up.

    with ProcessGroup() as group:
        sink = group.call_async("w1", ns_w1, receive, 9000, 20_000_000)  # a callable, in ns_w1
        group.start("learner", ["python", "-m", "bench.send"], ns=ns_learner)  # a command
        print(sink.result(timeout_s=60))
        outputs = group.wait(timeout_s=60)  # {name: Result}; raises CommandError on failure

A callable travels by pickle (so it must be a module-level function, possibly in `__main__`)
to a fresh Python process started with `ip netns exec`; coroutine functions are run with
`asyncio.run`.
Every process the group started is terminated, then killed, when the group closes, even when
the body raised. Output goes to temporary files, never pipes, so a chatty child cannot block.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import CommandError, CommandTimeout, RemoteCallError

_GRACE_S = 3.0  # how long a process gets to exit after SIGTERM before SIGKILL


def netns_argv(ns: str | None, argv: Sequence[str]) -> list[str]:
    """`argv` prefixed with `ip netns exec ns` (unchanged when `ns` is None: the root namespace)."""
    return ["ip", "netns", "exec", ns, *argv] if ns else list(argv)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: ours, with our `sys.path` so it imports the same modules."""
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class Result:
    """How one process ended: exit status, its combined stdout+stderr, and its run time."""

    name: str
    argv: list[str]
    returncode: int
    output: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Process:
    """One child process with its output captured to a temporary file."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], workdir: Path, stdin: bool = False
    ) -> None:
        self.name = name
        self.argv = argv
        self._log: IO[bytes] = tempfile.TemporaryFile(dir=workdir)
        self._start = time.monotonic()
        try:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, so stop() reaches its children
            )
        except OSError as e:
            self._log.close()
            raise CommandError(f"{name}: cannot start `{' '.join(argv)}`: {e}") from None
        self._result: Result | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """Exit status, or None while it runs."""
        return self.popen.poll()

    def wait_listening(self, port: int, timeout_s: float = 10.0) -> None:
        """Block until a TCP socket listens on `port` in this process's network namespace.

        Reads `/proc/<pid>/net/tcp{,6}`, which shows the namespace of that pid, so it works
        from the root namespace. Raises `CommandError` if the process exits or time runs out.
        """
        deadline = time.monotonic() + timeout_s
        while not _listening(self.pid, port):
            if self.poll() is not None:
                raise CommandError(
                    f"{self.name} exited ({self.poll()}) before listening on port {port}:\n"
                    f"{self.output()[-2000:]}",
                    self.poll(),
                    self.output(),
                )
            if time.monotonic() > deadline:
                raise CommandError(f"{self.name}: nothing listens on port {port} after {timeout_s:g} s")
            time.sleep(0.01)

    def output(self) -> str:
        """What it has printed so far (stdout and stderr interleaved)."""
        # pread, not seek + read: the child writes through the same open file, so moving its
        # offset would make the child's next write land over what it wrote first.
        fd = self._log.fileno()
        chunks, offset = [], 0
        while chunk := os.pread(fd, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks).decode(errors="replace")

    def wait(self, timeout_s: float, check: bool = False) -> Result:
        """Wait for exit; on timeout stop it and raise `CommandTimeout` (a `CommandError`) with its output.

        With `check`, a non-zero exit also raises `CommandError` (with the output's tail).
        """
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise CommandTimeout(
                f"{self.name}: `{' '.join(self.argv)}` still running after {timeout_s:g} s; "
                "it was killed (raise timeout_s if it needs longer)",
                None,
                self.output(),
            ) from None
        if self._result is None:
            self._result = Result(self.name, self.argv, code, self.output(), time.monotonic() - self._start)
        if check and not self._result.ok:
            r = self._result
            raise CommandError(
                f"{r.name}: `{' '.join(r.argv)}` exited {r.returncode}; its output:\n{r.output[-4000:]}",
                r.returncode,
                r.output,
            )
        return self._result

    def stop(self) -> None:
        """SIGTERM its process group, then SIGKILL after a grace period; idempotent."""
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=_GRACE_S)
        if self.popen.stdin:
            self.popen.stdin.close()

    def close(self) -> None:
        self.stop()
        self._log.close()


def _listening(pid: int, port: int) -> bool:
    """True if the network namespace of `pid` has a TCP socket listening on `port`."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)  # header
                for line in f:
                    cols = line.split()
                    # cols[1] is "HEXADDR:HEXPORT", cols[3] the state; 0A is LISTEN.
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except (FileNotFoundError, ProcessLookupError):
            continue
    return False


def _main_ref() -> tuple[str, str] | None:
    """How a child can load our `__main__` (like multiprocessing's spawn): by module or path."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return ("module", spec.name)
    path = getattr(main, "__file__", None)
    return ("path", os.path.abspath(path)) if path else None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # pid == pgid: we started it with start_new_session
    except ProcessLookupError:
        pass


class CallHandle:
    """A Python callable running in another process; `result()` returns its value or raises."""

    def __init__(self, process: Process, result_path: Path) -> None:
        self.process = process
        self._path = result_path

    def wait_listening(self, port: int, timeout_s: float = 10.0) -> None:
        """Block until the callable listens on `port` (see `Process.wait_listening`)."""
        self.process.wait_listening(port, timeout_s)

    def result(self, timeout_s: float = 60.0) -> Any:
        """The callable's return value; `RemoteCallError` with its traceback if it raised."""
        done = self.process.wait(timeout_s)
        try:
            status, value = pickle.loads(self._path.read_bytes())
        except (FileNotFoundError, EOFError, pickle.UnpicklingError):
            raise RemoteCallError(
                f"{done.name}: the child exited {done.returncode} without a result; its output:\n"
                f"{done.output[-4000:]}"
            ) from None
        if status != "ok":
            raise RemoteCallError(f"{done.name} raised in its namespace:\n{value}")
        return value


class ProcessGroup:
    """Processes started in namespaces; all are stopped when the group closes."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="echo-netem-")
        self.workdir = Path(self._tmp.name)
        self.processes: list[Process] = []
        self._calls = 0

    def start(
        self,
        name: str,
        argv: Sequence[str],
        ns: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bool = False,
    ) -> Process:
        """Start `argv` in namespace `ns` (None: ours); output is collected.

        Names are made unique (`name#2`, ...) so `wait()` can report each process.
        """
        taken = {p.name for p in self.processes}
        unique = next(n for i in itertools.count(1) if (n := name if i == 1 else f"{name}#{i}") not in taken)
        proc = Process(unique, netns_argv(ns, argv), child_env(env), self.workdir, stdin=stdin)
        self.processes.append(proc)
        return proc

    def call_async(
        self, name: str, ns: str | None, func: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> CallHandle:
        """Start `func(*args, **kwargs)` in a new Python process in `ns`; return its handle."""
        self._calls += 1
        result_path = self.workdir / f"call-{self._calls}.pickle"
        # Header first, so the child can load our __main__ before unpickling what refers to it.
        main_ref = _main_ref() if getattr(func, "__module__", None) == "__main__" else None
        payload = pickle.dumps(main_ref) + pickle.dumps((func, args, kwargs))
        proc = self.start(name, [sys.executable, "-m", "netem._child", str(result_path)], ns, stdin=True)
        assert proc.popen.stdin is not None
        try:
            proc.popen.stdin.write(payload)
            proc.popen.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; result() reports its output
        return CallHandle(proc, result_path)

    def call(
        self,
        name: str,
        ns: str | None,
        func: Callable[..., Any],
        *args: Any,
        timeout_s: float = 60.0,
        **kwargs: Any,
    ) -> Any:
        """Run `func(*args, **kwargs)` in `ns` and return its value (blocking)."""
        return self.call_async(name, ns, func, *args, **kwargs).result(timeout_s)

    def wait(self, timeout_s: float, check: bool = True) -> dict[str, Result]:
        """Wait for every process (one shared deadline); with `check`, a failure raises."""
        return {r.name: r for r in self.wait_all(self.processes, timeout_s, check)}

    @staticmethod
    def wait_all(processes: Sequence[Process], timeout_s: float, check: bool = False) -> list[Result]:
        """Wait for `processes` under one shared deadline; with `check`, a failure raises."""
        deadline = time.monotonic() + timeout_s
        return [p.wait(max(0.0, deadline - time.monotonic()), check) for p in processes]

    def close(self) -> None:
        """Stop every process (even if another fails to stop) and remove the output files."""
        try:
            for proc in self.processes:
                try:
                    proc.close()
                except OSError:
                    pass
        finally:
            self._tmp.cleanup()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_in(ns: str | None, argv: Sequence[str], timeout_s: float = 60.0, check: bool = True) -> Result:
    """Run `argv` in namespace `ns` to completion and return its `Result`."""
    with ProcessGroup() as group:
        return group.start(argv[0], argv, ns).wait(timeout_s, check)
