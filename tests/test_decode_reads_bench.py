"""bench/decode_reads.py's own code on tiny models: its `bounded` step is the GPU's rule (decode_bound's columns,
the CPU's rule back after), and `measure` times both ways of one compiled step on the same caches, rolled back so
that every round reads the same length, with the same token chosen."""
import pytest
import torch

pytest.importorskip('transformers')
from bench import decode_reads  # noqa: E402
from conftest import tiny_decoder as tiny  # noqa: E402
from selfattn_nbdev import decoding  # noqa: E402
from selfattn_nbdev.caches import StaticKVCache  # noqa: E402


def test_bounded_sets_decode_bounds_columns_and_gives_the_cpus_rule_back():
    model = tiny('gpt2')
    caches = model.new_caches(128)
    with torch.no_grad(): model(torch.randint(0, 97, (1, 20)), caches)
    rule = StaticKVCache._reads_a_bound
    with decode_reads.bounded():
        assert caches[0].begin_step(1) == 128 and caches[0].columns_read is None   # min(capacity, 256)
    assert StaticKVCache._reads_a_bound is rule
    assert caches[0].begin_step(1) is None and caches[0].columns_read.shape == (22,)


@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer slows torch.compile
@pytest.mark.parametrize('kind', ['gpt2', 'llama'])
def test_measure_times_both_ways_on_the_same_length(kind, monkeypatch):
    monkeypatch.setattr(decode_reads, 'STEPS', 3)
    monkeypatch.setattr(decode_reads, 'ROUNDS', 2)
    model = tiny(kind)
    with torch.no_grad(), decoding.stacked(model), decoding.faster_products(model, compiled=True):
        entry = decode_reads.measure(model, 40)
    assert entry['columns_read'] == {'seen': 41, 'bound': 128}    # the capacity, decode_bound(43, 128), bounds it
    assert entry['same_token'] and all(len(t) == 2 and min(t) > 0 for t in entry['ms_each_round'].values())
    assert entry['ratio_bound_over_seen'] == entry['ms']['bound'] / entry['ms']['seen']
