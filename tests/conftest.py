"""Shared pytest configuration. Fixture plugins live next to the parts they start."""

pytest_plugins = ["tests.cluster.fixtures", "tests.helpers.hf_models", "tests.helpers.object_store"]
