"""Shared fixtures."""

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """A private embedded Ray per test module: `address="local"` never joins a cluster someone else started."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
