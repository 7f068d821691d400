"""Sinks through the log-sum-exp: `tiled_attention(..., return_lse=True)` gives L with its gradient, and
`LlamaAttention(sinks=True)` applies its sinks after the tiled kernel (`sink_after`) instead of building the
(T, keys) scores. In float64 the output and every gradient (inputs, projections, the sinks) equal the explicit
path's, which adds the sinks as one more softmax column."""
import math

import pytest
import torch

from selfattn_nbdev.generation import KVCache
from selfattn_nbdev.llama_attention import LlamaAttention, sink_after, softmax_with_sink
from selfattn_nbdev.tiled import tiled_attention

T, D = 70, 32   # more than one tile of SINK_BLOCK (64), and a short last tile


def dense_lse(q, k, scale, allowed=None):
    s = q @ k.transpose(-2, -1) * scale
    if allowed is not None: s = s.masked_fill(~allowed, -math.inf)
    return s, torch.logsumexp(s, -1)


@pytest.mark.parametrize('causal,num_keys', [(False, 40), (True, 40), (True, 53)])
def test_lse_and_its_gradient(causal, num_keys):
    g = torch.Generator().manual_seed(num_keys)
    q = torch.randn(2, 3, 40, 8, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (torch.randn(2, 3, num_keys, 8, dtype=torch.float64, generator=g).requires_grad_()
            for _ in range(2))
    out, lse = tiled_attention(q, k, v, causal=causal, block_size=16, return_lse=True)
    allowed = (torch.ones(40, num_keys, dtype=torch.bool).tril(num_keys - 40) if causal else None)
    s, ref_lse = dense_lse(q, k, 1 / math.sqrt(8), allowed)
    ref = torch.softmax(s, -1) @ v
    w = torch.randn(40, dtype=torch.float64, generator=g)
    loss = lambda o, L: (o.sin().sum() + (L * w).sum())
    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    ref_grads = torch.autograd.grad(loss(ref, ref_lse), (q, k, v))
    assert lse.shape == (2, 3, 40)
    assert (lse - ref_lse).abs().max() < 1e-12
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() < 1e-12
    # L alone: a gradient only through L reaches the queries and keys, not the values
    lse = tiled_attention(q, k, v, causal=causal, block_size=16, return_lse=True)[1]
    ref_lse = dense_lse(q, k, 1 / math.sqrt(8), allowed)[1]
    only = torch.autograd.grad((lse * w).sum(), (q, k, v))
    ref_only = torch.autograd.grad((ref_lse * w).sum(), (q, k))
    assert (only[0] - ref_only[0]).abs().max() < 1e-12 and (only[1] - ref_only[1]).abs().max() < 1e-12
    assert only[2].abs().max() == 0


def test_lse_gradcheck():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    sinks = torch.randn(2, dtype=torch.float64, generator=g).requires_grad_()
    fn = lambda q, k, v, s: tiled_attention(q, k, v, causal=True, block_size=4, sinks=s, return_lse=True)
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_half_returns_float32_lse():
    q = torch.randn(1, 2, 5, 4).half()
    out, lse = tiled_attention(q, q, q, causal=True, return_lse=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32 and lse.shape == (1, 2, 5)
    with pytest.raises(TypeError, match='return_lse'):
        tiled_attention(q, q, q, return_lse=1)


def test_sink_after_is_the_extra_column():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 4, 6, 7, dtype=torch.float64, generator=g)
    v = torch.randn(2, 4, 7, 3, dtype=torch.float64, generator=g)
    sink = torch.tensor([-3.0, 0.0, 1.0, 5.0], dtype=torch.float64)
    ours = sink_after(torch.softmax(s, -1) @ v, torch.logsumexp(s, -1), sink)
    assert (ours - softmax_with_sink(s, sink) @ v).abs().max() < 1e-14
    dead = torch.full_like(s, -math.inf)            # a query that sees nothing keeps 0, not nan
    out = sink_after(torch.zeros_like(v[..., :6, :]), torch.logsumexp(dead, -1), sink)
    assert torch.equal(out, torch.zeros_like(out))


def module(seed=0, **kwargs):
    torch.manual_seed(seed)
    m = LlamaAttention(D, 200, num_heads=4, num_kv_heads=2, sinks=True, **kwargs).double()
    with torch.no_grad():
        m.sinks.copy_(torch.tensor([-2.0, 0.0, 1.5, 4.0]))
        if m.out_proj.bias is not None: m.out_proj.bias.normal_()
    return m


def explicit(m, x, **kw):
    "The same module forced onto the explicit path (the sinks as one more softmax column)."
    return m(x, return_attn_weights=True, **kw)[0]


def no_explicit(monkeypatch):
    def refuse(*args, **kwargs): raise AssertionError('the explicit path was taken')
    monkeypatch.setattr(LlamaAttention, '_attend_explicit', refuse)


def compare(m, x, monkeypatch, **kw):
    "Forward and every gradient (x, all parameters, sinks included) of the tiled path against the explicit."
    x = x.clone().requires_grad_()
    params = [p for p in m.parameters()]
    w = torch.randn(x.shape[:-1] + (D,), dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    ref = explicit(m, x, **kw)
    ref_grads = torch.autograd.grad((ref * w).sum(), [x, *params])
    with monkeypatch.context() as mp:
        no_explicit(mp)
        out = m(x, **kw)
        grads = torch.autograd.grad((out * w).sum(), [x, *params])
    if 'key_padding_mask' in kw:   # padded queries: their outputs are not compared
        keep = ~kw['key_padding_mask'][..., None]
        out, ref = out * keep, ref * keep
    errors = [(out - ref).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(grads, ref_grads)]
    assert max(errors) < 1e-12, errors
    assert grads[-1].abs().min() > 0 if params[-1] is m.sinks else True
    return max(errors)


CASES = {
    'causal': (dict(), {}),
    'window': (dict(window=9), {}),
    'softcap and query_scale': (dict(softcap=3.0, query_scale=0.3, out_bias=True, qkv_bias=True), {}),
    'qk_norm, yarn': (dict(qk_norm=True, rope_scaling=dict(rope_type='yarn', factor=4.0,
                                                            original_max_position_embeddings=32)), {}),
}


@pytest.mark.parametrize('name', list(CASES))
def test_module_sinks_tiled_equal_explicit(name, monkeypatch):
    kwargs, kw = CASES[name]
    m = module(**kwargs)
    x = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    compare(m, x, monkeypatch, **kw)
    assert m.sinks.grad is None   # autograd.grad: nothing accumulated


def test_module_sinks_with_padding_and_documents(monkeypatch):
    x = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    pad = torch.zeros(2, T, dtype=torch.bool); pad[0, :11] = True; pad[1, -5:] = True
    compare(module(), x, monkeypatch, key_padding_mask=pad)
    compare(module(window=7), x, monkeypatch, key_padding_mask=pad)
    docs = torch.zeros(2, T, dtype=torch.long); docs[0, 30:] = 1; docs[1, 10:] = 1; docs[1, 50:] = 2
    compare(module(), x, monkeypatch, document_ids=docs)


def test_module_sinks_with_a_cache(monkeypatch):
    "A prompt into a cache, then a chunk of many tokens (tiled), then one token (a row: explicit)."
    m = module(window=20)
    x = torch.randn(1, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = explicit(m, x)
        cache = KVCache()
        with monkeypatch.context() as mp:
            no_explicit(mp)
            parts = [m(x[:, :40], cache=cache), m(x[:, 40:69], cache=cache)]
        parts.append(m(x[:, 69:], cache=cache))
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-12


def test_explicit_path_kept_where_it_should_be(monkeypatch):
    "Dropout in training, returned weights and a single query keep the explicit path."
    calls = []
    original = LlamaAttention._attend_explicit
    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(LlamaAttention, '_attend_explicit', spy)
    x = torch.randn(1, 8, D, dtype=torch.float64)
    m = module(dropout=0.1).train()
    m(x); assert calls; calls.clear()
    m.eval(); m(x); assert not calls
    m(x, return_attn_weights=True); assert calls


def test_shared_keys_broadcast_like_repeated_ones():
    "GQA without copies: keys and values with 1 on a leading axis equal the repeated ones, forward and back."
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 3, 4, 21, 8, dtype=torch.float64, generator=g).requires_grad_()   # (kv, b, group, T, hd)
    k, v = (torch.randn(2, 3, 1, 21, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    out, lse = tiled_attention(q, k, v, causal=True, block_size=8, return_lse=True)
    ref, ref_lse = tiled_attention(q, k.expand(-1, -1, 4, -1, -1), v.expand(-1, -1, 4, -1, -1),
                                   causal=True, block_size=8, return_lse=True)
    loss = lambda o, L: o.sin().sum() + L.cos().sum()
    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    ref_grads = torch.autograd.grad(loss(ref, ref_lse), (q, k, v))
    assert grads[1].shape == k.shape
    assert max((a - b).abs().max().item() for a, b in zip((out, lse, *grads), (ref, ref_lse, *ref_grads))) < 1e-12
    with pytest.raises(ValueError, match='where query heads share them'):
        tiled_attention(q, k.expand(-1, -1, 2, -1, -1), v.expand(-1, -1, 2, -1, -1))


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    "The GPU's choice on this CPU: sinks through SDPA with one more key (no tiled kernel), counted."
    from selfattn_nbdev import llama_attention as recent
    calls, real = [], recent.sinks_by_sdpa
    monkeypatch.setattr(LlamaAttention, '_sinks_by_sdpa', lambda self, q, score_mod:
                        score_mod is None and self.softcap is None)
    monkeypatch.setattr(recent, 'sinks_by_sdpa', lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(recent, 'tiled_attention', lambda *a, **k: pytest.fail('the tiled kernel was taken'))
    return calls


@pytest.mark.parametrize('name', ['causal', 'window', 'qk_norm, yarn'])
def test_module_sinks_by_sdpa_equal_explicit(name, monkeypatch, as_on_a_gpu):
    "A GPU's path, run here: forward and every gradient equal the explicit path's (sinks included)."
    kwargs, kw = CASES[name]
    x = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    compare(module(**kwargs), x, monkeypatch, **kw)
    assert as_on_a_gpu


def test_sinks_by_sdpa_with_padding_documents_and_a_cache(monkeypatch, as_on_a_gpu):
    x = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    pad = torch.zeros(2, T, dtype=torch.bool); pad[0, :11] = True; pad[1, -5:] = True
    compare(module(), x, monkeypatch, key_padding_mask=pad)
    docs = torch.zeros(2, T, dtype=torch.long); docs[0, 30:] = 1; docs[1, 10:] = 1; docs[1, 50:] = 2
    compare(module(), x, monkeypatch, document_ids=docs)
    m, x = module(window=20), x[:1]
    with torch.no_grad():
        full, cache = explicit(m, x), KVCache()
        parts = [m(x[:, :40], cache=cache), m(x[:, 40:69], cache=cache), m(x[:, 69:], cache=cache)]
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-12 and len(as_on_a_gpu) == 4  # 1 token: explicit


def test_sinks_by_sdpa_pads_the_head_to_a_multiple_of_eight():
    "One more number for the sink's score, then zeros to a multiple of 8 (the fused kernels' widths)."
    from selfattn_nbdev.llama_attention import sinks_by_sdpa
    for hd in (7, 8, 64):
        q = torch.randn(1, 2, 5, hd, dtype=torch.float64)
        k, v = torch.randn(2, 1, 1, 5, hd, dtype=torch.float64).unbind(0)
        sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(
            ~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
        want = softmax_with_sink(scores, sinks) @ v
        assert (sinks_by_sdpa(q, k, v, sinks, None) - want).abs().max() < 1e-12


def test_a_kernel_asked_for_is_taken_or_refused_by_name(monkeypatch):
    """Under attention_kernel, sinks take 'sdpa' (one more key), 'block' (the tiled kernel's L) and 'explicit', each
    equal to the module's own choice on a padded batch, each counted as taken; every other kernel is refused by name,
    and so is 'sdpa' with a soft cap (a score function) and 'sdpa' or 'block' under dropout."""
    from selfattn_nbdev import llama_attention as recent
    from selfattn_nbdev.kernels import KERNELS, attention_kernel
    taken = []
    for name in ('sinks_by_sdpa', 'tiled_attention'):
        real = getattr(recent, name)
        monkeypatch.setattr(recent, name, lambda *a, real=real, name=name, **k: taken.append(name) or real(*a, **k))
    m = module()
    x = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    pad = torch.zeros(2, T, dtype=torch.bool); pad[0, :7] = True
    with torch.no_grad():
        own = m(x, key_padding_mask=pad)
        for kernel, path in [('sdpa', 'sinks_by_sdpa'), ('block', 'tiled_attention'), ('explicit', None)]:
            taken.clear()
            with attention_kernel(kernel): out = m(x, key_padding_mask=pad)
            assert (out - own)[~pad].abs().max() < 1e-12 and taken == ([path] if path else []), kernel
        for kernel in set(KERNELS) - {'sdpa', 'block', 'explicit'}:
            with attention_kernel(kernel), pytest.raises(ValueError, match=f"attention_kernel\\('{kernel}'\\) cannot"):
                m(x, key_padding_mask=pad)
        with attention_kernel('sdpa'), pytest.raises(ValueError, match='SDPA takes no score function'):
            module(softcap=3.0)(x)
    m.train(); m.dropout.p = 0.1
    for kernel in ('sdpa', 'block'):
        with attention_kernel(kernel), pytest.raises(ValueError, match="drop no weights"):
            m(x)
