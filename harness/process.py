"""Child processes of a local control plane: started with a log file each, stopped by PID."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1

# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process.
# Children that must die with us are therefore forked from this one long-lived thread,
# whatever thread asks for them (clusters start in parallel from short-lived threads).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="process-spawner")


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the harness is killed (even with
    # SIGKILL), the kernel stops its control planes too, so no test run leaks them.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ProcessError(RuntimeError):
    """A child process could not start or died while starting."""


def start_time_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, which tells a PID that
    was reused by an unrelated process from the one we started."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after it are plain.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


@dataclass(frozen=True)
class ProcessRecord:
    """What is kept in a state file to find and stop a process later."""

    name: str
    pid: int
    start_ticks: int

    def alive(self) -> bool:
        return start_time_ticks(self.pid) == self.start_ticks and not _is_zombie(self.pid)

    def stop(self, grace_seconds: float = 10.0) -> None:
        stop_pid(self.pid, self.start_ticks, grace_seconds)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def stop_pid(pid: int, start_ticks: int, grace_seconds: float) -> None:
    """SIGTERM, then SIGKILL after the grace period; never signals a reused PID."""
    if start_time_ticks(pid) != start_ticks:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if start_time_ticks(pid) != start_ticks or _is_zombie(pid):
            return
        time.sleep(0.05)
    if start_time_ticks(pid) == start_ticks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class ManagedProcess:
    """One control-plane component: its command line, its log file, its PID."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.die_with_parent = die_with_parent
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise ProcessError(f"{self.name} was never started")
        return self._popen.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            log.flush()

            def spawn(preexec: Callable[[], None] | None) -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=preexec,
                )

            try:
                if self.die_with_parent:
                    self._popen = _SPAWNER.submit(spawn, _die_with_parent).result()
                else:
                    self._popen = spawn(None)
            except OSError as error:
                raise ProcessError(f"cannot start {self.name} ({self.argv[0]}): {error}") from error

    def record(self) -> ProcessRecord:
        ticks = start_time_ticks(self.pid)
        if ticks is None:
            raise ProcessError(self.failure_message())
        return ProcessRecord(self.name, self.pid, ticks)

    def exit_code(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def check_running(self) -> None:
        if not self.running():
            raise ProcessError(self.failure_message())

    def failure_message(self) -> str:
        return (
            f"{self.name} exited with code {self.exit_code()} while starting; "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL, as a crash would: no chance to clean up."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait()

    def stop(self, grace_seconds: float = 10.0) -> None:
        if self._popen is None or self._popen.poll() is not None:
            return
        self._popen.terminate()
        try:
            self._popen.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()
