"""bench/row_loop.py's own code on a tiny model: both rules write the same tokens, each round times one call each way,
the rule before (LOOP_ROWS 1) never multiplies a batch by row_dot, and the package's LOOP_ROWS comes back."""
import pytest
import torch

pytest.importorskip('transformers')
from bench import row_loop  # noqa: E402
from conftest import tiny_decoder as tiny  # noqa: E402
from selfattn_nbdev import decoding  # noqa: E402


@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer slows torch.compile
def test_measure_times_both_rules_on_the_same_tokens(monkeypatch):
    monkeypatch.setattr(row_loop, 'NEW', 6)
    monkeypatch.setattr(decoding, 'compiled_gemv_kernel', lambda model, linears=None, rows=1: 'loop')
    dots = []
    real = decoding.row_dot
    monkeypatch.setattr(decoding, 'row_dot', lambda *a: dots.append(a[0].numel() // a[0].shape[-1]) or real(*a))
    model, ids = tiny('gpt2'), torch.randint(0, 97, (2, 5))
    kept = decoding.LOOP_ROWS
    tokens, times = row_loop.call(model, ids, 'before')
    assert tokens.shape == (2, 11) and len(times) == 6 and dots == [] and decoding.LOOP_ROWS == kept
    assert torch.equal(row_loop.call(model, ids, 'loop')[0], tokens) and set(dots) == {2}
    entry = row_loop.measure(model, ids, rounds=2)
    assert entry['same_tokens'] and all(len(t) == 2 and min(t) > 0 for t in entry['ms_each_round'].values())
    assert entry['ratio_before_over_loop'] == entry['ms']['before'] / entry['ms']['loop']
    assert entry['chosen'] == 'loop' and set(entry['first_call_s']) == {'before', 'loop'}
    assert decoding.LOOP_ROWS == kept
