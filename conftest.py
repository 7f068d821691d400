"""pytest's entry point for the whole project: `pytest` (what `make test` runs) collects the tests in tests/ and every
notebook in nbs/ as a test of its own, through the plugin in tools/pytest_notebooks.py."""
import os

pytest_plugins = ['tools.pytest_notebooks', 'pytester']  # pytester: tests/test_tools.py runs pytest on small files


def pytest_configure(config):
    if getattr(config.option, 'numprocesses', None):  # pytest-xdist: a process per core, so one torch thread each
        os.environ.setdefault('OMP_NUM_THREADS', '1')


QUICK_GRID = 6  # a parametrized test with more cases than this runs a covering subset under --quick


def covering(items: list) -> list:
    """The items, in order, that between them give every parameter each of its values at least once: the first
    case, then each later case that brings a value not yet run (as pairwise testing does for one-wise coverage)."""
    seen, keep = set(), []
    for item in items:
        values = set()
        for name, v in item.callspec.params.items():
            try: values.add((name, hash(v), type(v)))
            except TypeError: values.add((name, id(v), type(v)))
        if not values <= seen: keep.append(item); seen |= values
    return keep


def pytest_collection_modifyitems(config, items):
    """`make test-quick` (`--quick`) runs a parametrized test of more than `QUICK_GRID` cases on a covering subset of
    them (each value of each parameter at least once); `make test` and CI run every case."""
    if not config.getoption('quick', False): return
    grids = {}
    for item in items:
        if hasattr(item, 'callspec'): grids.setdefault((item.path, item.originalname), []).append(item)
    dropped = set()
    for cases in grids.values():
        if len(cases) > QUICK_GRID: dropped |= set(cases) - set(covering(cases))
    if dropped:
        config.hook.pytest_deselected(items=[i for i in items if i in dropped])
        items[:] = [i for i in items if i not in dropped]
