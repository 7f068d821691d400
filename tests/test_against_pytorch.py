"""Differential tests: every module against a reference built from PyTorch's own kernels, forward and gradients.

Two references:
- `F.scaled_dot_product_attention` (SDPA) fed with the module's own projections;
- `nn.MultiheadAttention(batch_first=True)` with the module's weights copied in.

The two libraries' boolean masks mean opposite things, which is the classic source of silent bugs:

| mask | True means |
|---|---|
| SDPA `attn_mask` (bool) | attend |
| `nn.MultiheadAttention` `attn_mask`, `key_padding_mask` (bool) | do not attend |
| `MultiHeadAttention` `key_padding_mask` (this package) | do not attend (padding) |
| `causal_allowed(T)`, `dense_mask`, `mask_mod` (this package) | attend |
"""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn_nbdev import MultiHeadAttention, causal_allowed, to_torch_multihead
from conftest import make

TOL = 1e-10  # float64 throughout


def _proj(layer, x):
    "Apply a projection stored either as an nn.Linear or as a raw (d_in, d_out) parameter."
    return layer(x) if isinstance(layer, nn.Linear) else x @ layer


def sdpa_reference(name, m, x, key_padding_mask=None):
    "The module's function, recomputed from its own parameters with F.scaled_dot_product_attention."
    if name == 'MultiHeadAttention(explicit)': m = m.m
    if name == 'MultiHeadAttentionWrapper':
        return torch.cat([sdpa_reference('CausalAttention', head, x) for head in m.heads], dim=-1)
    q, k, v = (_proj(getattr(m, w), x) for w in ('W_query', 'W_key', 'W_value'))
    if not isinstance(m, MultiHeadAttention):
        return F.scaled_dot_product_attention(q, k, v, is_causal=name == 'CausalAttention')
    b, T, _ = x.shape
    split = lambda t: t.view(b, T, m.num_heads, m.head_dim).transpose(1, 2)   # (b, h, T, hd)
    allowed = torch.ones(b, 1, T, T, dtype=torch.bool)
    if m.causal: allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
    if key_padding_mask is not None: allowed = allowed & ~key_padding_mask[:, None, None, :]
    dead = ~allowed.any(-1, keepdim=True)
    ctx = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=allowed | dead)
    ctx = ctx.masked_fill(dead, 0.0).transpose(1, 2).reshape(b, T, m.d_out)
    return m.out_proj(ctx)


CASES = [  # (d_in, d_out, batch, num_tokens, num_heads, padded)
    (3, 4, 2, 6, 2, False), (8, 8, 1, 5, 4, False), (5, 6, 3, 1, 3, False), (6, 6, 2, 7, 1, False),
    (4, 8, 2, 6, 2, True), (8, 8, 1, 4, 4, True), (6, 6, 3, 8, 3, True),
]
MODULES = ['SelfAttention', 'SelfAttentionV1', 'SelfAttentionV2', 'CausalAttention', 'MultiHeadAttentionWrapper',
           'MultiHeadAttention', 'MultiHeadAttention(explicit)', 'MultiHeadAttention(causal=False)']


def _padding(batch, T, seed):
    "A random padding mask with at least one real token per sequence, and some sequences fully real."
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (batch,), generator=g)
    mask = torch.arange(T)[None] >= lengths[:, None]   # True = padding, at the end
    if batch > 1: mask[0] = torch.rand(T, generator=g) < 0.4   # and one with holes anywhere (may pad the first token)
    return mask


PADDED = ['MultiHeadAttention', 'MultiHeadAttention(explicit)', 'MultiHeadAttention(causal=False)']  # take key_padding_mask


@pytest.mark.parametrize('name,case', [(n, c) for c in CASES for n in MODULES if n in PADDED or not c[5]],
                         ids=lambda v: v if isinstance(v, str) else 'd{}-{}_b{}_T{}_h{}{}'.format(*v[:5], '_pad' if v[5] else ''))
def test_forward_and_gradients_match_sdpa(name, case, record_diff):
    d_in, d_out, batch, T, h, padded = case
    m = make(name, d_in, d_out, context_length=8, num_heads=h)
    x = torch.randn(batch, T, d_in, dtype=torch.float64, requires_grad=True)
    pad = _padding(batch, T, seed=T) if padded else None
    kwargs = {'key_padding_mask': pad} if padded else {}
    ours, theirs = m(x, **kwargs), sdpa_reference(name, m, x, pad)
    assert record_diff(name, 'SDPA forward', ours, theirs) < TOL
    g = torch.randn_like(ours)
    params = [p for p in m.parameters()]
    grads_ours = torch.autograd.grad((ours * g).sum(), [x, *params])
    grads_theirs = torch.autograd.grad((theirs * g).sum(), [x, *params], allow_unused=True)
    for a, b in zip(grads_ours, grads_theirs):
        b = torch.zeros_like(a) if b is None else b
        assert not a.isnan().any()
        assert record_diff(name, 'SDPA gradients', a, b) < TOL


def _torch_mha_for_single_head(m, d):
    "nn.MultiheadAttention with one head computing a single-head module's function (identity out_proj)."
    ref = nn.MultiheadAttention(d, 1, bias=True, batch_first=True, dtype=torch.float64)
    weights = [(_w.weight, _w.bias) if isinstance(_w, nn.Linear) else (_w.T, None) for _w in (m.W_query, m.W_key, m.W_value)]
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([w for w, _ in weights]))
        ref.in_proj_bias.copy_(torch.cat([b if b is not None else torch.zeros(d, dtype=torch.float64) for _, b in weights]))
        ref.out_proj.weight.copy_(torch.eye(d)); ref.out_proj.bias.zero_()
    return ref.eval()


@pytest.mark.parametrize('name', ['SelfAttention', 'SelfAttentionV1', 'SelfAttentionV2', 'CausalAttention'])
@pytest.mark.parametrize('batch,T', [(1, 1), (2, 6), (3, 8)])
def test_single_head_modules_match_torch_multihead(name, batch, T, record_diff):
    m = make(name, 6, 6)
    ref = _torch_mha_for_single_head(m, 6)
    x = torch.randn(batch, T, 6, dtype=torch.float64, requires_grad=True)
    causal = name == 'CausalAttention'
    ours = m(x)
    theirs, _ = ref(x, x, x, attn_mask=~causal_allowed(T) if causal else None, need_weights=False)
    assert record_diff(name, 'nn.MultiheadAttention fwd', ours, theirs) < TOL
    g = torch.randn_like(ours)
    gx_ours, = torch.autograd.grad((ours * g).sum(), x)
    gx_theirs, = torch.autograd.grad((theirs * g).sum(), x)
    assert record_diff(name, 'nn.MultiheadAttention grads', gx_ours, gx_theirs) < TOL


@pytest.mark.parametrize('causal,padded,num_heads,batch,T',
                         [(c, p, h, b, T) for c, p in itertools.product([True, False], [False, True])
                          for h, b, T in [(1, 1, 1), (2, 2, 6), (4, 3, 8)]])
@pytest.mark.parametrize('explicit', [False, True])
def test_multihead_matches_torch_multihead(causal, padded, num_heads, batch, T, explicit, record_diff):
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 8, num_heads=num_heads, qkv_bias=True, causal=causal).double().eval()
    ref = to_torch_multihead(m)
    x = torch.randn(batch, T, 8, dtype=torch.float64, requires_grad=True)
    pad = _padding(batch, T, seed=batch * T) if padded else None
    if pad is not None: pad[:, 0] = False   # nn.MultiheadAttention gives NaN for rows with nothing to attend to
    ours = m(x, key_padding_mask=pad, return_attn_weights=explicit)
    ours, weights = ours if explicit else (ours, None)
    theirs, their_weights = ref(x, x, x, attn_mask=~causal_allowed(T) if causal else None, key_padding_mask=pad,
                                need_weights=explicit, average_attn_weights=False)
    name = 'MultiHeadAttention' + ('(explicit)' if explicit else '')
    assert record_diff(name, 'nn.MultiheadAttention fwd', ours, theirs) < TOL
    if explicit: assert record_diff(name, 'nn.MultiheadAttention weights', weights, their_weights) < TOL
    g = torch.randn_like(ours)
    ours_grads = torch.autograd.grad((ours * g).sum(), [x, m.W_query.weight, m.W_key.weight, m.W_value.weight, m.out_proj.weight])
    theirs_grads = torch.autograd.grad((theirs * g).sum(), [x, ref.in_proj_weight, ref.out_proj.weight])
    in_proj = torch.cat(ours_grads[1:4])
    for a, b in [(ours_grads[0], theirs_grads[0]), (in_proj, theirs_grads[1]), (ours_grads[4], theirs_grads[2])]:
        assert record_diff(name, 'nn.MultiheadAttention grads', a, b) < TOL


@pytest.mark.parametrize('name', MODULES)
def test_gradcheck(name):
    m = make(name, 3, 4, context_length=5, num_heads=2)
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: m(x), (x,), eps=1e-6, atol=1e-5)


def test_gradcheck_with_padding():
    torch.manual_seed(0)
    m = MultiHeadAttention(4, 4, 5, num_heads=2).double()
    pad = torch.tensor([[True, False, False, True, False], [False] * 5])   # first query of sequence 0 sees nothing
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    for explicit in [False, True]:
        f = (lambda x: m(x, key_padding_mask=pad, return_attn_weights=True)[0]) if explicit else (lambda x: m(x, key_padding_mask=pad))
        assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-5)
