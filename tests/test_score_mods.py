"""Scores as functions on every path: a score function (ALiBi, the soft cap) and one more logit per head (the sinks),
carried by the tiled kernel through its recurrence (forward and backward), given to FlexAttention as `score_mod` by
`LlamaAttention`, and applied to the score tensor by the explicit path; each against the formulas in float64."""
import math

import pytest
import torch

from selfattn_nbdev.generation import KVCache
from selfattn_nbdev.masks import (and_masks, causal, dense_mask, documents,
                                  key_padding, sliding_window)
from selfattn_nbdev.kernels import flex_mode
from selfattn_nbdev.masks import block_mask as make_block_mask
from selfattn_nbdev.llama_attention import LlamaAttention, soft_cap, soft_cap_mod, softmax_with_sink
from selfattn_nbdev.tiled import alibi, alibi_slopes, tiled_attention


def dense(q, k, v, score_mod=None, sinks=None, allowed=None):
    "softmax(mod(QKᵀ/√d), masked, with a sink column) V, written out."
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if score_mod is not None:
        b = torch.arange(s.shape[0])[:, None, None, None]
        h = torch.arange(s.shape[1])[:, None, None]
        s = score_mod(s, b, h, torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None])
    if allowed is not None: s = s.masked_fill(~allowed, -math.inf)
    if sinks is None: return torch.softmax(s, -1).nan_to_num(0.0) @ v
    return softmax_with_sink(s, sinks) @ v


def grads(out, inputs):
    torch.manual_seed(9)
    return torch.autograd.grad((out * torch.randn_like(out)).sum(), inputs)


def inputs(b=2, h=4, T=29, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, T, d, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    sinks = torch.randn(h, dtype=torch.float64, generator=g).requires_grad_()
    return q, k, v, sinks


MODS = {'none': None, 'alibi': alibi(alibi_slopes(4)), 'cap': soft_cap_mod(2.0),
        'alibi then cap': lambda s, *i: soft_cap(alibi(alibi_slopes(4))(s, *i), 2.0)}


@pytest.mark.parametrize('mod', list(MODS))
@pytest.mark.parametrize('with_sinks', [False, True])
@pytest.mark.parametrize('mask', ['none', 'causal', 'window', 'padding'])
@pytest.mark.parametrize('block_size', [1, 7, 64])
def test_tiled_carries_score_functions_and_sinks(mod, with_sinks, mask, block_size):
    q, k, v, sinks = inputs()
    T, sinks = q.shape[2], sinks if with_sinks else None
    score_mod, causal_flag, tiles, allowed = MODS[mod], mask == 'causal', None, None
    if causal_flag: allowed = dense_mask(causal, T, T)
    if mask in ('window', 'padding'):
        pad = torch.zeros(2, T, dtype=torch.bool); pad[0, :5] = True
        mask_mod = sliding_window(6) if mask == 'window' else and_masks(causal, key_padding(pad))
        tiles = make_block_mask(mask_mod, T, block_size=block_size, batch=2 if mask == 'padding' else 1)
        allowed = dense_mask(mask_mod, T, T, batch=2 if mask == 'padding' else 1)
    ours = tiled_attention(q, k, v, causal=causal_flag, block_size=block_size, block_mask=tiles,
                           score_mod=score_mod, sinks=sinks)
    ref = dense(q, k, v, score_mod, sinks, allowed)
    assert (ours - ref).abs().max() < 1e-12
    wrt = (q, k, v) + ((sinks,) if with_sinks else ())
    for a, b in zip(grads(ours, wrt), grads(ref, wrt)): assert (a - b).abs().max() < 1e-12


def test_tiled_sinks_alone_give_weight_to_nothing():
    "A query that sees no key puts all its weight on the sink: output 0, and no nan in any gradient."
    q, k, v, sinks = inputs(T=9)
    none_seen = lambda b, h, q_idx, kv_idx: (q_idx >= 3) & (kv_idx <= q_idx)  # queries 0..2 see nothing
    tiles = make_block_mask(none_seen, 9, block_size=4)
    out = tiled_attention(q, k, v, block_mask=tiles, sinks=sinks)
    assert out[:, :, :3].abs().max() == 0
    ref = dense(q, k, v, None, sinks, dense_mask(none_seen, 9, 9))
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(grads(out, (q, k, v, sinks)), grads(ref, (q, k, v, sinks))):
        assert not a.isnan().any() and (a - b).abs().max() < 1e-12


def test_tiled_score_function_in_half_precision_follows_float32():
    q, k, v, sinks = (t.detach() for t in inputs())
    mod = alibi(alibi_slopes(4))
    half = tiled_attention(*(t.bfloat16() for t in (q, k, v)), causal=True, score_mod=mod, sinks=sinks.bfloat16())
    full = dense(*(t.bfloat16().double() for t in (q, k, v)), mod, sinks.bfloat16().double(),
                 dense_mask(causal, q.shape[2], q.shape[2]))
    assert half.dtype == torch.bfloat16 and (half.double() - full).abs().max() < 2e-2


def test_alibi_slopes_are_the_papers():
    "Press et al.: for 8 heads the slopes are 1/2, 1/4, ..., 1/256."
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    with pytest.raises(ValueError, match='num_heads'): alibi_slopes(0)


def test_tiled_refuses_bad_score_changes():
    q, k, v, sinks = (t.detach() for t in inputs())
    with pytest.raises(TypeError, match='score_mod must be a function'):
        tiled_attention(q, k, v, score_mod=3.0)
    with pytest.raises(ValueError, match=r'sinks must have shape \(heads,\)'):
        tiled_attention(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r'sinks must have shape \(heads,\)'):
        tiled_attention(q[0], k[0], v[0], sinks=sinks)
    with pytest.raises(TypeError, match='sinks must be None or a floating-point tensor'):
        tiled_attention(q, k, v, sinks=[0.0] * 4)


def layer(**options):
    torch.manual_seed(0)
    return LlamaAttention(32, 64, num_heads=4, num_kv_heads=2, **options).double()


CASES = {'causal': {}, 'window': dict(window=5)}


@pytest.mark.parametrize('case', list(CASES))
@pytest.mark.parametrize('batch', ['plain', 'padding', 'documents'])
def test_llama_cap_goes_to_flex_score_mod_and_agrees(case, batch, monkeypatch):
    "The fused path hands the cap to FlexAttention (uncompiled here) and gets the explicit path's numbers."
    import selfattn_nbdev.kernels as kernels
    seen = []
    real = kernels.flex_attend
    monkeypatch.setattr(kernels, 'flex_attend', lambda *a, **kw: seen.append(kw['score_mod']) or real(*a, **kw))
    m = layer(softcap=3.0, query_scale=0.3, **CASES[case])
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    kw = {}
    if batch == 'padding': kw['key_padding_mask'] = torch.tensor([[True] * 3 + [False] * 8, [False] * 11])
    if batch == 'documents': kw['document_ids'] = torch.tensor([[0] * 4 + [1] * 7, [0] * 11])
    with torch.no_grad():
        with flex_mode('eager'): flexed = m(x, **kw)
        with flex_mode('off'): explicit = m(x, **kw)
    assert seen and all(f is soft_cap_mod(3.0) for f in seen)
    real_rows = slice(3, None) if batch == 'padding' else slice(None)
    assert (flexed[0, real_rows] - explicit[0, real_rows]).abs().max() < 1e-12
    assert (flexed[1] - explicit[1]).abs().max() < 1e-12


@pytest.mark.parametrize('options', [dict(softcap=3.0), dict(sinks=True), dict(softcap=3.0, sinks=True)])
def test_llama_score_changes_train_and_decode_on_the_explicit_path(options):
    "Forward and backward on CPU (where Flex has no backward), and a cache, against the formulas."
    m = layer(**options)
    if m.sinks is not None:
        with torch.no_grad(): m.sinks.copy_(torch.tensor([-1.0, 0.0, 1.0, 3.0]))
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    out = m(x)
    q, k, v = m._project(x)
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    mod = soft_cap_mod(options['softcap']) if 'softcap' in options else None
    ref = m.out_proj(m._merge_heads(dense(q, k, v, mod, m.sinks, dense_mask(causal, 9, 9))))
    assert (out - ref).abs().max() < 1e-12
    params = [x] + [p for p in m.parameters()]
    for a, b in zip(grads(out, params), grads(ref, params)): assert (a - b).abs().max() < 1e-10
    with torch.no_grad():
        cache = KVCache()
        steps = torch.cat([m(x[:, i:i + 1], cache=cache) for i in range(9)], 1)
    assert (steps - ref).abs().max() < 1e-12


def test_soft_cap_mod_is_one_function_per_cap():
    "Compiled Flex compiles once per score function: the same cap gives the same function."
    assert soft_cap_mod(50.0) is soft_cap_mod(50.0) and soft_cap_mod(50.0) is not soft_cap_mod(30.0)
    s = torch.tensor([-1e4, -1.0, 0.0, 1.0, 1e4], dtype=torch.float64)
    assert torch.allclose(soft_cap_mod(50.0)(s, 0, 0, 0, 0), 50.0 * torch.tanh(s / 50.0))


@pytest.mark.parametrize('mod', ['alibi', 'cap', 'alibi then cap'])
def test_flex_attend_takes_the_same_score_functions(mod):
    "The fused path's kernel, FlexAttention (uncompiled here), with a score function: the formulas' numbers."
    from selfattn_nbdev.kernels import flex_attend
    q, k, v, _ = (t.detach() for t in inputs(T=24))
    with torch.no_grad():
        ours = flex_attend(q, k, v, causal, compiled=False, score_mod=MODS[mod])
    assert (ours - dense(q, k, v, MODS[mod], None, dense_mask(causal, 24, 24))).abs().max() < 1e-12
