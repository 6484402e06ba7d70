"""Shared pytest configuration. Fixture plugins live next to the parts they start."""

import pytest

pytest_plugins = ["tests.cluster.fixtures", "tests.helpers.hf_models", "tests.helpers.object_store"]


@pytest.hookimpl(tryfirst=True)  # before xdist turns the group marker into the node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep every test of the machine's one real node on one pytest-xdist worker.

    `make test` runs the suite on two xdist workers (`--dist loadgroup`): most tests wait on processes,
    HTTP and the API server, so a second worker uses the idle core. The real node is a singleton that a
    session holds until it ends (`real_cluster`), so its tests form one group; a second worker asking
    for it would wait for the first worker's whole session.
    """
    for item in items:
        if item.get_closest_marker("realnode") or "real_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("realnode"))
