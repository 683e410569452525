import asyncio
import threading

import pytest

from kubekit.loops import Background, on_loop, run_together


async def running_thread() -> threading.Thread:
    await asyncio.sleep(0)
    return threading.current_thread()


def test_work_runs_on_its_home_loop_whichever_loop_awaits_it() -> None:
    home = asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever, name="home")
    thread.start()
    try:
        assert asyncio.run(on_loop(home, running_thread())) is thread
        assert asyncio.run(on_loop(None, running_thread())) is threading.current_thread()
    finally:
        home.call_soon_threadsafe(home.stop)
        thread.join()
        home.close()


async def test_work_for_the_caller_s_own_loop_runs_there() -> None:
    home = asyncio.get_running_loop()
    assert await on_loop(home, running_thread()) is threading.current_thread()


async def test_background_tasks_are_awaited_or_ended_together() -> None:
    background = Background()
    finished = background.spawn(asyncio.sleep(0, result="done"))
    await background.wait()
    assert finished.result() == "done"
    forever = background.spawn(asyncio.Event().wait())
    await asyncio.sleep(0)
    assert not forever.done()
    await background.cancel()
    assert forever.cancelled()


async def test_loops_run_together_end_together_when_one_fails() -> None:
    """asyncio.gather alone leaves the others running for a caller that has closed its
    clients and started them all again."""
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append(name)

    async def failing() -> None:
        await asyncio.sleep(0)
        raise ConnectionResetError("the apiserver hung up")

    with pytest.raises(ConnectionResetError, match="hung up"):
        await run_together(forever("pods"), failing(), forever("reflector"))
    assert sorted(ended) == ["pods", "reflector"], "ended before the error reached the caller"


async def test_loops_run_together_until_all_end() -> None:
    done: list[int] = []

    async def after(seconds: float) -> None:
        await asyncio.sleep(seconds)
        done.append(len(done))

    await run_together(after(0.02), after(0))
    assert done == [0, 1]
