"""KVCache: feeding a sequence through the cache in chunks of any sizes reproduces the full forward pass."""
import random

import pytest
import torch

from selfattn_nbdev import KVCache, MultiHeadAttention

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _chunks(total, seed):
    "Random chunk sizes that add up to `total`, starting with 1, 3, 5 as the issue asks."
    rng, sizes = random.Random(seed), [1, 3, 5]
    while sum(sizes) < total: sizes.append(rng.randint(1, 6))
    sizes[-1] -= sum(sizes) - total
    return [s for s in sizes if s > 0]


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('explicit', [False, True])
@pytest.mark.parametrize('seed', range(3))
def test_chunked_generation_reproduces_the_full_forward(dtype, explicit, seed):
    torch.manual_seed(seed)
    m = MultiHeadAttention(12, 12, 40, num_heads=3, qkv_bias=seed % 2 == 1).to(dtype).eval()
    x = torch.randn(2, 31, 12, dtype=dtype)
    with torch.no_grad():
        full = m(x, return_attn_weights=True) if explicit else (m(x), None)
        cache, seen = KVCache(), 0
        for size in _chunks(31, seed):
            out = m(x[:, seen:seen + size], cache=cache, return_attn_weights=explicit)
            out, weights = out if explicit else (out, None)
            assert (out - full[0][:, seen:seen + size]).abs().max() <= TOL[dtype]
            if explicit:
                want = full[1][:, :, seen:seen + size, :seen + size]  # new queries x keys so far
                assert (weights - want).abs().max() <= TOL[dtype]
            seen += size
            assert len(cache) == seen


def test_non_causal_module_attends_to_everything_cached():
    "Without the causal mask, new tokens see every cached token: the full pass over the prefix."
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 20, num_heads=2, causal=False).eval()
    x = torch.randn(2, 9, 8)
    cache = KVCache()
    with torch.no_grad():
        m(x[:, :5], cache=cache)
        torch.testing.assert_close(m(x[:, 5:], cache=cache), m(x)[:, 5:], atol=1e-6, rtol=0)


def test_unbatched_and_one_token_at_a_time():
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 20, num_heads=2).eval()
    x = torch.randn(10, 8)
    cache = KVCache()
    with torch.no_grad():
        steps = torch.cat([m(x[t:t + 1], cache=cache) for t in range(10)])
        torch.testing.assert_close(steps, m(x), atol=1e-6, rtol=0)


def test_reset_and_errors():
    m = MultiHeadAttention(8, 8, 6, num_heads=2).eval()
    cache = KVCache()
    assert len(cache) == 0 and repr(cache) == 'KVCache(0 tokens)'
    m(torch.randn(1, 4, 8), cache=cache)
    with pytest.raises(ValueError, match='has seen 4 tokens and x adds 3: 7 is more than context_length=6'):
        m(torch.randn(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match='batch of 1 sequences; got x with batch size 2'):
        m(torch.randn(2, 1, 8), cache=cache)
    other = MultiHeadAttention(8, 4, 6, num_heads=2)
    with pytest.raises(ValueError, match='holds the keys of another module'):
        other(torch.randn(1, 1, 8), cache=cache)
    cache.reset()
    assert len(cache) == 0
    m(torch.randn(1, 6, 8), cache=cache)   # a full context after the reset
