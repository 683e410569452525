import os
import sys
import time
from pathlib import Path

import pytest

from harness.process import ManagedProcess, ProcessError, ProcessRecord, start_time_ticks


def test_process_that_dies_at_start_explains_itself_with_its_log(tmp_path: Path) -> None:
    process = ManagedProcess(
        "broken",
        [sys.executable, "-c", "import sys; print('bind: address already in use'); sys.exit(3)"],
        tmp_path / "broken.log",
    )
    process.start()
    deadline = time.monotonic() + 10
    while process.running() and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(
        ProcessError, match=r"(?s)broken exited with code 3.*address already in use"
    ):
        process.check_running()


def test_missing_program_is_a_clear_error(tmp_path: Path) -> None:
    process = ManagedProcess("ghost", [str(tmp_path / "no-such-binary")], tmp_path / "ghost.log")
    with pytest.raises(ProcessError, match="cannot start ghost"):
        process.start()


def test_record_stops_its_process_by_pid(tmp_path: Path) -> None:
    process = ManagedProcess("sleeper", ["sleep", "60"], tmp_path / "sleep.log")
    process.start()
    record = process.record()
    assert record.alive()
    record.stop(grace_seconds=5)
    assert not record.alive(), "stopped through the record alone"
    assert process.exit_code() is not None


def test_record_never_signals_a_reused_pid() -> None:
    own = start_time_ticks(os.getpid())
    assert own is not None
    stale = ProcessRecord("stale", os.getpid(), own + 1)  # same PID, other start time
    assert not stale.alive()
    stale.stop(grace_seconds=0.1)  # would kill this test process if it trusted the PID
