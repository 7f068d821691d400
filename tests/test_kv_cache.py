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


def _full_and_chunked(model, ids, caches, sizes):
    "Loss and gradients of the whole sequence, then of it in chunks through the caches (training through them)."
    def run(chunked):
        model.zero_grad()
        pieces = ids.split(sizes, 1) if chunked else [ids]
        out = torch.cat([model(p, caches if chunked else None) for p in pieces], 1)
        out.double().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return run(False), run(True)


@pytest.mark.parametrize('family', ['llama growing', 'llama static', 'llama window ring', 'gemma', 'deepseek-v3',
                                    'qwen3.5 hybrid'])
def test_training_through_a_cache_in_chunks_gives_the_whole_sequences_gradients(family):
    """A long text trained in chunks through the model's caches (each chunk attending to the cached keys of those
    before, the gradient flowing back into them) gives the loss and gradients of the whole text at once: every
    cache writes its storage in place, so backward reads copies of what attention read. Without them, autograd
    refused ('modified by an inplace operation')."""
    from selfattn_nbdev.deepseek_v3 import DeepSeekV3
    from selfattn_nbdev.gemma import Gemma
    from selfattn_nbdev.hybrid import Qwen35
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    kind = family.split()[0]
    model = {'llama': lambda: Llama(50, 32, 32, 4, 2, num_kv_heads=2, window=4 if 'window' in family else None),
             'gemma': lambda: Gemma(50, 32, 32, 4, 2, num_kv_heads=2, d_hidden=48, head_dim=8, window=4,
                                    layer_types=['sliding_attention', 'full_attention']),
             'deepseek-v3': lambda: DeepSeekV3(50, 32, 32, 4, 2, d_hidden=48, kv_rank=8, rope_dim=4, nope_dim=4,
                                               v_dim=8),
             'qwen3.5': lambda: Qwen35(50, 32, 32, 4, 4, 2, 48, 8, linear_num_key_heads=2, linear_num_value_heads=4,
                                       linear_key_head_dim=8, linear_value_head_dim=8)}[kind]().double()
    ids = torch.randint(0, 50, (2, 14))
    caches = model.new_caches(16) if ('static' in family or 'ring' in family) else model.new_caches()
    sizes = [5] + [1] * 9 if 'ring' in family else [5, 1, 4, 4]  # a ring: one token at a time after the first
    (whole, grads), (chunked, chunk_grads) = _full_and_chunked(model, ids, caches, sizes)
    assert (whole - chunked).abs().max() < 1e-10, family
    assert grads.keys() == chunk_grads.keys()
    assert max((grads[n] - chunk_grads[n]).abs().max().item() for n in grads) < 1e-10, family


def test_training_through_a_cache_with_sinks():
    "The same for attention with sinks (gpt-oss), whose tiled path takes the cache's keys: one module, in chunks."
    from selfattn_nbdev.llama_attention import LlamaAttention
    torch.manual_seed(0)
    m = LlamaAttention(16, 32, num_heads=4, num_kv_heads=2, sinks=True).double()
    with torch.no_grad(): m.sinks.normal_()
    x = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    grads = []
    for chunked in (False, True):
        m.zero_grad(); x.grad = None
        cache = KVCache()
        out = (torch.cat([m(p, cache=cache) for p in x.split([5, 1, 6], 1)], 1) if chunked else m(x))
        out.pow(2).mean().backward()
        grads.append((out.detach(), x.grad.clone(), m.W_key.weight.grad.clone(), m.sinks.grad.clone()))
    for a, b in zip(*grads): assert (a - b).abs().max() < 1e-10



def _every_cache():
    "One of each cache the package has, and whether it holds keys and values."
    from selfattn_nbdev import caches
    source = caches.KVSource(caches.KVCache())
    source.positions(3)  # a sharing layer answers what its source answered this step
    return [(caches.KVCache(), True), (caches.StaticKVCache(8), True), (caches.RingKVCache(8), True),
            (caches.PagedKVCache(caches.BlockPool(4), 0), True), (source, True), (caches.SharedKV(source), True),
            (caches.RecurrentCache(), False), (caches.HybridCache(), False)]


def test_every_cache_lives_in_caches_and_keeps_the_protocol():
    "One home, one protocol: every class shaped like a cache is in `caches`, and answers CacheProtocol (KV ones more)."
    import importlib, inspect, pkgutil
    import selfattn_nbdev
    from selfattn_nbdev import caches
    from selfattn_nbdev.caches import CacheProtocol, KVCacheProtocol
    every = _every_cache()
    shaped = {c for info in pkgutil.iter_modules(selfattn_nbdev.__path__)
              for _, c in inspect.getmembers(importlib.import_module(f'selfattn_nbdev.{info.name}'), inspect.isclass)
              if c.__module__.startswith('selfattn_nbdev.') and not issubclass(c, torch.nn.Module)
              and all(hasattr(c, a) for a in ('positions', 'reset')) and c not in (CacheProtocol, KVCacheProtocol)}
    assert {c.__module__ for c in shaped} == {caches.__name__}, {c.__name__: c.__module__ for c in shaped}
    assert shaped == {type(c) for c, _ in every}, shaped ^ {type(c) for c, _ in every}
    for cache, holds_keys in every:
        assert isinstance(cache, CacheProtocol), type(cache).__name__
        assert isinstance(cache, KVCacheProtocol) == holds_keys, type(cache).__name__
        assert cache.num_seen == 0 and len(cache) == 0
        rows = cache.positions(3)  # (b | 1, 3); a paged cache has no rows until a batch is set
        assert rows.shape[-1] == 3 and all(r == [0, 1, 2] for r in rows.tolist()), type(cache).__name__
    assert not isinstance(object(), CacheProtocol)


def test_the_caches_keep_their_old_addresses():
    "Nothing lost: each cache is still importable from the module that first held it, as the same class."
    from selfattn_nbdev import caches, decoding, gemma4, generation, gqa_window_rope, hybrid, linear, serving
    for old, name in [(generation, 'KVCache'), (decoding, 'StaticKVCache'), (decoding, 'decode_bound'),
                      (decoding, 'DECODE_MIN_BOUND'), (gqa_window_rope, 'RingKVCache'), (linear, 'RecurrentCache'),
                      (hybrid, 'HybridCache'), (serving, 'PagedKVCache'), (serving, 'BlockPool'),
                      (gemma4, 'KVSource'), (gemma4, 'SharedKV'), (hybrid, 'SharedKV')]:
        assert getattr(old, name) is getattr(caches, name), (old.__name__, name)
        if old is not hybrid or name != 'SharedKV':  # hybrid took Gemma 4's names by name only
            names = {}
            exec(f'from {old.__name__} import *', names)
            assert names.get(name) is getattr(caches, name), (old.__name__, name, '`import *`')
