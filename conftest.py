"""pytest's entry point for the whole project: `pytest` (what `make test` runs) collects the tests in tests/ and every
notebook in nbs/ as a test of its own, through the plugin in tools/pytest_notebooks.py."""
import os

pytest_plugins = ['tools.pytest_notebooks']


def pytest_configure(config):
    if getattr(config.option, 'numprocesses', None):  # pytest-xdist: a process per core, so one torch thread each
        os.environ.setdefault('OMP_NUM_THREADS', '1')
