"""Shared fixtures."""

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """A private embedded Ray per test module: `address="local"` never joins a cluster someone else started."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def no_pickle(monkeypatch):
    """Any unpickling in this process fails the test (checkpoints must load without running code)."""
    import pickle

    def refuse(*a, **k):
        raise AssertionError("something was unpickled")

    class Refused(pickle.Unpickler):  # a class, so that modules subclassing pickle.Unpickler still import
        __init__ = refuse

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", Refused)


@pytest.fixture(scope="module")
def standin(model_dir):
    """The SGLang stand-in (tests/sglang_standin.py) serving the test module's own `model_dir`."""
    from tests.sglang_standin import StandinServer

    srv = StandinServer(model_dir, max_running=64)
    srv.start()
    yield srv.wait_ready()  # its model loaded: a test loading one meanwhile would race it
    srv.stop()
