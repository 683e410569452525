from collections.abc import AsyncIterator

import pytest

from tests.unit.fakekubelet import Kubelet, serving


@pytest.fixture
async def kubelet() -> AsyncIterator[Kubelet]:
    async with serving() as started:
        yield started
