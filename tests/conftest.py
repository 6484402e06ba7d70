"""Shared pytest configuration. Fixture plugins live next to the parts they start."""

import pytest

pytest_plugins = ["tests.cluster.fixtures", "tests.helpers.hf_models", "tests.helpers.object_store"]


def pytest_itemcollected(item: pytest.Item) -> None:
    """Keep every test of the machine's one real node on one pytest-xdist worker.

    `make test` runs the suite on two xdist workers (`--dist loadgroup`): most tests wait on processes,
    HTTP and the API server, so a second worker uses the idle core. The real node is a singleton that a
    session holds until it ends (`real_cluster`), so its tests form one group; a second worker asking
    for it would wait for the first worker's whole session.

    The group is added as each test is collected: xdist's worker turns the marker into the node id in its
    own `pytest_collection_modifyitems`, which runs before a conftest's.
    """
    if item.get_closest_marker("realnode") or "real_cluster" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group("realnode"))
