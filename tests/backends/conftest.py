"""Fixtures of the backend tests."""
import pytest


@pytest.fixture
def chainers_own_functions():
    """``F.*`` and Chainer's links run Chainer's own functions during the test.

    Any earlier test that built a replica installed the stock dispatchers
    (``cpu_kernels.stock``), after which ``F.max_pooling_2d`` on NumPy is ours: a test that
    takes Chainer's functions as the reference takes them out first, and puts them back after.
    """
    from pipeline.backends.chainer.cpu_kernels import stock
    was = stock.installed()
    stock.uninstall()
    yield
    if was:
        stock.install()
