"""bench/thread_split.py's own code on tiny models: the products it names are every weight product of a decode step
(q, k and v one product, as `generate` stacks them; gate and up one), and the C loop it times runs them under each
schedule and refuses what it does not know."""
import shutil, subprocess

import pytest
import torch

pytest.importorskip('transformers')
from bench import thread_split  # noqa: E402
from conftest import tiny_decoder as tiny  # noqa: E402


def elements(products) -> int:
    "Weights the named products hold: rows x columns x count, summed."
    total = 0
    for p in products:
        shape, count = p.split('*')
        rows, cols = map(int, shape.split('x'))
        total += rows * cols * int(count)
    return total


@pytest.mark.parametrize('kind', ['gpt2', 'llama'])
def test_the_products_are_every_weight_a_step_multiplies_by(kind):
    model = tiny(kind)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    products = thread_split.products(model)
    assert elements(products) == sum(m.weight.numel() for m in linears)
    if kind == 'gpt2':  # q, k, v stacked: 3 x 32 rows, once a block
        assert '96x32*2' in products and '97x32*1' in products
    else:  # 4 query heads and 2 key/value heads of 8: 32 + 2 x 16 rows; gate and up: 2 x 48
        assert '64x32*2' in products and '96x32*2' in products


@pytest.mark.skipif(shutil.which('gcc') is None, reason='needs gcc')
def test_the_loop_runs_every_schedule_and_refuses_an_unknown_one(tmp_path):
    binary = thread_split.build(str(tmp_path))
    for schedule in thread_split.SCHEDULES:
        assert thread_split.loop_rate(binary, schedule, 2, ['64x32*2', '97x32'], reps=3) > 0
    bad = subprocess.run([binary, 'static', '3', '64x32'], capture_output=True, text=True)
    assert bad.returncode == 2 and 'SCHEDULE must be even, dynamic or guided; got static' in bad.stderr
    bad = subprocess.run([binary, 'even', '3', '64by32'], capture_output=True, text=True)
    assert bad.returncode == 2 and 'ROWSxCOLS or ROWSxCOLS*COUNT, positive; got 64by32' in bad.stderr
    bad = subprocess.run([binary, 'even', '0', '64x32'], capture_output=True, text=True)
    assert bad.returncode == 2 and 'REPS must be a positive integer; got 0' in bad.stderr
