"""Shared fixtures live in tests/fixtures/*; each module owns one real service or artifact."""

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.s3",
    "tests.fixtures.ray_cluster",
    "tests.fixtures.pipeline_data",
]
