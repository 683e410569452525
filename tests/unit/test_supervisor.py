import sys
import threading
from pathlib import Path

import pytest

from harness.federation import Federation, FederationSpec
from harness.process import ManagedProcess, ProcessError
from harness.supervisor import RestartPolicy
from harness.toolchain import Toolchain

FAKE_TOOLCHAIN = Toolchain(
    Path("/nonexistent/kube"), Path("/nonexistent/kwok"), Path("/nonexistent"), "v0"
)


def test_a_crash_loop_backs_off_doubling_and_is_given_up_on() -> None:
    policy = RestartPolicy(initial_delay=1, max_delay=4, stable_after=60, max_quick_exits=5)
    policy.started("webhook", now=0)
    delays = []
    now = 0.0
    for _ in range(5):
        now += 1
        delay = policy.exited("webhook", now)
        assert delay is not None
        delays.append(delay)
        now += delay
        policy.started("webhook", now)
    assert delays == [0, 1, 2, 4, 4]
    assert policy.exited("webhook", now + 1) is None


def test_an_exit_after_a_long_run_is_a_first_one_again() -> None:
    policy = RestartPolicy(stable_after=60)
    policy.started("webhook", now=0)
    assert policy.exited("webhook", now=1) == 0
    policy.started("webhook", now=1)
    assert policy.exited("webhook", now=2) == 1
    policy.started("webhook", now=3)
    assert policy.exited("webhook", now=100) == 0, "ran 97 s: not a crash loop"
    assert policy.exited("descheduler", now=100) == 0, "each process counts its own"


def test_policies_that_would_spin_are_refused() -> None:
    with pytest.raises(ValueError, match="0 < initial <= max"):
        RestartPolicy(initial_delay=0)
    with pytest.raises(ValueError, match="at least one quick exit"):
        RestartPolicy(max_quick_exits=0)


def federation_with(tmp_path: Path, name: str, *argv: str) -> tuple[Federation, ManagedProcess]:
    federation = Federation(tmp_path, FederationSpec(lower=1).clusters(), FAKE_TOOLCHAIN)
    process = ManagedProcess(name, list(argv), tmp_path / f"{name}.log")
    process.start()
    federation.components[name] = process
    return federation, process


def test_a_component_that_exits_is_started_again_and_reported(tmp_path: Path) -> None:
    federation, process = federation_with(tmp_path, "webhook", "sleep", "60")
    first_pid = process.pid
    reports: list[str] = []
    restarted = threading.Event()

    def report(line: str) -> None:
        reports.append(line)
        if "started again" in line:
            restarted.set()

    stop = threading.Event()
    supervisor = threading.Thread(
        target=federation.supervise, args=(stop, report), kwargs={"interval": 0.05}
    )
    supervisor.start()
    try:
        process.kill()
        assert restarted.wait(10)
        assert process.running() and process.pid != first_pid
        assert reports[0].startswith("webhook exited with code -9; starting it again in 0 s")
        assert reports[1] == "webhook started again"
        assert str(process.pid) in (tmp_path / "federation.json").read_text()
    finally:
        stop.set()
        supervisor.join(10)
        process.stop()


def test_a_component_that_keeps_exiting_fails_up_with_its_log(tmp_path: Path) -> None:
    federation, _ = federation_with(
        tmp_path,
        "webhook",
        sys.executable,
        "-c",
        "import sys; print('no certificate here'); sys.exit(3)",
    )
    reports: list[str] = []
    policy = RestartPolicy(initial_delay=0.05, max_delay=0.1, max_quick_exits=3)
    with pytest.raises(ProcessError, match=r"(?s)webhook keeps exiting \(last code 3\).*no cert"):
        federation.supervise(threading.Event(), reports.append, policy, interval=0.02)
    assert reports.count("webhook started again") == 3
