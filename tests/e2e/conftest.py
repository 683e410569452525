"""Real control planes for end-to-end tests: one federation for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.federation import Federation, FederationSpec
from harness.toolchain import Toolchain, ToolchainError

# Small nodes keep capacity arithmetic in tests readable.
TEST_FEDERATION = FederationSpec(
    lower=2,
    nodes_per_lower=2,
    node_cpu="8",
    node_memory="32Gi",
    node_pods=300,
    metrics_server=True,
)


@pytest.fixture(scope="session")
def toolchain() -> Toolchain:
    try:
        return Toolchain.locate()
    except ToolchainError as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture(scope="session")
def federation(
    tmp_path_factory: pytest.TempPathFactory, toolchain: Toolchain
) -> Iterator[Federation]:
    federation = Federation(
        tmp_path_factory.mktemp("federation"), TEST_FEDERATION.clusters(), toolchain
    )
    federation.start()
    federation.start_virtual_nodes()
    federation.start_webhook()
    federation.start_multischeduler()
    yield federation
    federation.stop()


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


# Modules whose faults restart control planes run after every other, so that what they
# leave behind (kwok restarted, its Nodes initialized again) reaches no other module.
LAST = ("test_chaos.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name in LAST)
