"""The decode benchmarks on CPU with a tiny model: bench/gpu.py's `decode`, and bench/decode.py's three runs."""
import pytest
import torch

from bench import gpu
from bench.decode import RUNS
from selfattn_nbdev.generation import TinyGPT

TINY = dict(vocab_size=37, context_length=32, d_model=32, num_heads=4, num_layers=2)


def _decode(batch, compile, **options):
    torch.manual_seed(0)
    return gpu.decode(TinyGPT(**TINY), 'cpu', torch.float32, batch, 5, 12, compile=compile, reps=1, **options)


@pytest.mark.parametrize('batch', [pytest.param(1, marks=pytest.mark.slow), 3])  # one in make test
def test_decode_runs_agree_and_report_rates(batch):
    "Three runs (the compiled one traced by dynamo, backend 'eager'): same tokens, positive rates, a limit."
    r = _decode(batch, dict(backend='eager', fullgraph=True), bandwidth=1e11)
    assert set(r) == {'batch', 'prompt_tokens', 'new_tokens', 'num_params', 'mean_tokens', 'bytes_per_step',
                      'limit_tokens_per_s', 'runs'}
    assert list(r['runs']) == list(RUNS)
    assert (r['batch'], r['prompt_tokens'], r['new_tokens'], r['mean_tokens']) == (batch, 5, 12, 11.0)
    num_params = sum(p.numel() for p in TinyGPT(**TINY).parameters())
    assert r['num_params'] == num_params
    assert r['bytes_per_step'] == 4 * num_params + 2 * 2 * 32 * 11.0 * 4 * batch    # float32: 4 bytes
    assert r['limit_tokens_per_s'] == pytest.approx(batch * 1e11 / r['bytes_per_step'])
    for row in r['runs'].values():
        assert set(row) == {'tokens_per_s', 'seconds', 'same_tokens', 'fraction_of_limit'}
        assert row['same_tokens'] is True and row['tokens_per_s'] > 0 and row['seconds'] > 0
        assert row['fraction_of_limit'] == pytest.approx(row['tokens_per_s'] / r['limit_tokens_per_s'])


def test_decode_without_compile_or_bandwidth():
    r = _decode(2, False)
    assert list(r['runs']) == list(RUNS[:2]) and r['limit_tokens_per_s'] is None
    assert all(row['same_tokens'] and row['fraction_of_limit'] is None for row in r['runs'].values())


def test_bandwidth_by_device_name():
    assert gpu.bandwidth_of('NVIDIA H100 80GB HBM3') == 3.35e12 and gpu.bandwidth_of('NVIDIA H200') == 4.8e12
    assert gpu.bandwidth_of('NVIDIA GeForce RTX 4090') is None


def test_bench_decode_runs_write_the_same_tokens():
    """bench/decode.py's three runs (greedy by hand with growing caches, generate with a static cache, generate
    compiled: dynamo's backend 'eager' here) write the same tokens, the check its main makes before it times them."""
    from bench.decode import greedy_kv_cache, runs
    torch.manual_seed(0)
    model = TinyGPT(**TINY).eval()
    prompt = torch.randint(0, TINY['vocab_size'], (2, 5))
    tokens = {name: fn() for name, fn in runs(model, prompt, 6, dict(backend='eager', fullgraph=True)).items()}
    assert list(tokens) == list(RUNS)
    for name, t in tokens.items(): assert t.shape == (2, 11) and torch.equal(t, tokens[RUNS[0]]), name
    assert torch.equal(tokens[RUNS[0]][:, :5], prompt)
    logits = model(tokens[RUNS[0]][:, :-1])[:, 4:]                     # teacher-forced, no cache: each was its argmax
    assert torch.equal(logits.argmax(-1), tokens[RUNS[0]][:, 5:])