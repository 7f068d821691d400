"""Nothing silently wrong: the cases a server, a trainer or a notebook meets that once gave a wrong answer or a raw
error without a word (the flex mode per thread and the bounded block masks are in tests/test_mask_paths.py, the
failing rank of run_ranks in tests/test_distributed.py)."""
import copy, gc

import pytest
import torch
import torch.nn.functional as F

from selfattn_nbdev import MultiHeadAttention, sample_next
from selfattn_nbdev import decoding
from selfattn_nbdev.decoding import StaticKVCache, generate
from selfattn_nbdev.generation import KVCache, TinyGPT
from selfattn_nbdev.decoding import generate_stream
from selfattn_nbdev.tiled import tiled_attention


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('scale', [30, 300, 3000])
def test_half_precision_is_finite_where_sdpa_is(dtype, scale):
    "The explicit path and tiled attention compute their scores in float32, as SDPA's kernels do: no overflow."
    torch.manual_seed(0)
    m32 = MultiHeadAttention(64, 64, 128, num_heads=4).eval()
    x32 = torch.randn(2, 64, 64) * scale
    m, x = copy.deepcopy(m32).to(dtype), x32.to(dtype)
    with torch.no_grad():
        reference, fused = m32(x32), m(x)
        explicit, weights = m(x, return_attn_weights=True)
    assert torch.isfinite(fused).all() and torch.isfinite(explicit).all() and torch.isfinite(weights).all()
    assert weights.dtype == dtype
    # as close to float32's answer as the fused path is (half precision's own rounding)
    off = lambda t: ((t.float() - reference).abs().max() / reference.abs().max()).item()
    assert off(explicit) <= 2 * off(fused) + 1e-2
    q = (torch.randn(2, 4, 64, 16) * scale).to(dtype)
    sdpa = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    tiled = tiled_attention(q, q, q, causal=True)
    assert torch.isfinite(sdpa).all() and torch.isfinite(tiled).all() and tiled.dtype == dtype
    assert (tiled.float() - sdpa.float()).abs().max() <= 0.02 * sdpa.float().abs().max()


@pytest.mark.parametrize('temperature', [1e-40, 1e-300])
def test_a_tiny_temperature_is_greedy(temperature):
    "Below the point where logits / t overflows, sampling picks the likeliest token, as greedy decoding does."
    logits = torch.randn(64, 50)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, temperature, generator=generator), logits.argmax(-1))
    assert torch.equal(sample_next(logits, temperature, top_k=5, top_p=0.5, generator=generator),
                       logits.argmax(-1))


@pytest.mark.parametrize('make', [lambda: KVCache(), lambda: StaticKVCache(16)], ids=['KVCache', 'StaticKVCache'])
def test_a_cache_stays_its_modules_after_the_module_is_gone(make):
    "Refused by a second module also once the first is garbage-collected; reset() frees it for anyone."
    torch.manual_seed(0)
    first, second = (MultiHeadAttention(8, 8, 16, num_heads=2).eval() for _ in range(2))
    cache, x = make(), torch.randn(1, 4, 8)
    with torch.no_grad(): first(x, cache=cache)
    del first; gc.collect()
    with pytest.raises(ValueError, match='another module'): second(x[:, :1], cache=cache)
    twin = copy.deepcopy(second)                                   # a copy is another module
    cache.reset()
    with torch.no_grad(): second(x, cache=cache)
    with pytest.raises(ValueError, match='another module'): twin(x[:, :1], cache=cache)


def test_settings_are_fixed_once_built():
    "What __init__ checked and the forward reads cannot change behind the module's back (RoPE's table, the masks)."
    m = MultiHeadAttention(8, 8, 16, num_heads=2, window=3, rope=True)
    for name, value in [('rope_base', 500.0), ('causal', False), ('window', 5), ('num_heads', 4), ('head_dim', 2)]:
        with pytest.raises(AttributeError, match=f'{name} is fixed'): setattr(m, name, value)
    m.dropout.p = 0.1                                              # the layers stay free
    m.train(); m.eval(); m.double()


def test_a_static_cache_says_when_the_module_was_cast():
    m, cache = MultiHeadAttention(8, 8, 16, num_heads=2).eval(), StaticKVCache(16)
    with torch.no_grad(): m(torch.randn(1, 4, 8), cache=cache)
    m.double()
    with pytest.raises(ValueError, match='holds torch.float32 keys on cpu; the module now makes torch.float64'):
        m(torch.randn(1, 1, 8, dtype=torch.float64), cache=cache)


@pytest.mark.parametrize('stream', [generate_stream, decoding.generate_stream], ids=['generation', 'batches'])
def test_generate_gives_back_the_training_mode(stream):
    "On every exit: the end, a stream left half-read, and an error inside."
    torch.manual_seed(0)
    model = TinyGPT(11, 32, d_model=16, num_heads=2).train()
    prompt = torch.randint(0, 11, (1, 4))
    list(stream(model, prompt, 3)); assert model.training
    s = stream(model, prompt, 3); next(s); assert not model.training   # writing: evaluation mode
    s.close(); assert model.training
    class Broken(TinyGPT):                                               # fails at its first decode step
        def forward(self, token_ids, caches=None):
            if token_ids.shape[1] == 1: raise RuntimeError('a step failed')
            return super().forward(token_ids, caches)
    torch.manual_seed(0)
    broken = Broken(11, 32, d_model=16, num_heads=2).train()
    with pytest.raises(RuntimeError, match='a step failed'): list(stream(broken, prompt, 3))
    assert broken.training


def test_step_times_wait_for_the_device(monkeypatch):
    "Each step's time is read after the device has run it: a stand-in for torch.cuda.synchronize counts the waits."
    waits = []
    monkeypatch.setattr(decoding, '_synchronize', lambda device: waits.append(device.type))
    model = TinyGPT(11, 32, d_model=16, num_heads=2)
    times = []
    generate(model, torch.randint(0, 11, (1, 4)), 5, step_times=times)
    assert len(times) == 5 and waits == ['cpu'] * 6                     # once before, once per step
    waits.clear(); generate(model, torch.randint(0, 11, (1, 4)), 5)
    assert waits == []                                                   # not asked for: no wait
