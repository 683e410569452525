import gc
import logging

from kubekit.client import ApiError
from kubekit.component import GC_YOUNG_THRESHOLD, run_component

log = logging.getLogger("test")


async def finishes() -> None:
    return None


async def fails() -> None:
    raise ApiError(503, "the apiserver is restarting", "GET", "/api")


def test_a_component_runs_with_fewer_young_collections_and_says_why_it_failed() -> None:
    before = gc.get_threshold()
    try:
        assert run_component(finishes(), log) == 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
        assert run_component(fails(), log) == 1
    finally:
        gc.set_threshold(*before)
