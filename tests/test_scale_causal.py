"""One causal convention and a `scale` on every kernel of the tiled and ring pages (nbs/11_tiled.ipynb,
nbs/16_ring.ipynb): `tiled_attention`, `ring_attention` and `split_kv_attention`, each against softmax(c QKᵀ) V written
out in float64, forward and input gradients.

- T queries over S keys: after a cache (T < S) and as many (T == S). Causal is bottom-right: the queries are the last
  T positions, query i sees keys j <= i + S - T, as `causal_allowed`, `dense_mask` and `block_mask` have it. With fewer
  keys than queries, causal=True is refused by name. The ring holds one sequence (T == S) and refuses any other.
- c: the default 1/sqrt(head_dim), 1.0 and 0.3; anything but None or a finite number above 0 is refused by name.
- with the causal flag, a block mask (a window, padding), a score function (ALiBi, at the same positions as the mask).
- `context_parallel` refuses the RoPE rescalings that pick their frequencies from the longest position a rank sees."""
import math, re

import pytest
import torch

from selfattn_nbdev.causal import causal_allowed
from selfattn_nbdev.distributed import run_ranks
from selfattn_nbdev.masks import (block_mask, causal, dense_mask, key_padding,
                                  sliding_window)
from selfattn_nbdev.llama_attention import LlamaAttention
from selfattn_nbdev.ring import context_parallel, ring_attention, shard_sequence, split_kv_attention
from selfattn_nbdev.tiled import alibi, alibi_slopes, tiled_attention
from test_ring import one_rank  # noqa: F401  (the fixture: a gloo group of one rank in this process)

SCALES = [None, 1.0, 0.3]
SIZES = [(3, 9), (1, 6), (5, 12), (7, 7)]  # (T, S): a chunk after S - T cached keys, and T == S
BAD_SCALES = [0, 0.0, -1.0, math.nan, math.inf, True, '0.3', torch.tensor(0.3)]
TOL = 1e-12


def explicit(q, k, v, scale=None, seen=None, score_mod=None):
    """softmax(c QKᵀ) V in float64, every score written out: key/value heads repeated for their query heads, the
    score function asked at positions (the queries the last T of S), hidden scores -inf."""
    groups = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(groups, -3) for t in (k, v))
    c = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-2, -1) * c                                           # (b, h, T, S)
    T, S = s.shape[-2:]
    if score_mod is not None:
        b, h = torch.arange(s.shape[0])[:, None, None, None], torch.arange(s.shape[1])[:, None, None]
        s = score_mod(s, b, h, torch.arange(S - T, S)[:, None], torch.arange(S)[None])
    if seen is not None: s = s.masked_fill(~seen, -math.inf)
    return torch.softmax(s, -1) @ v


def qkv(T, S, heads=2, kv_heads=2, seed=0, d=8):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, T, d), (2, kv_heads, S, d), (2, kv_heads, S, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def compare(ours, ref, inputs, record_diff, what):
    "The largest forward and gradient errors of `ours` against `ref`, recorded for the summary; both within TOL."
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    grads = [torch.autograd.grad(o, inputs, grad_out) for o in (ours, ref)]
    forward = record_diff(f'{what} out', 'explicit float64', ours, ref)
    backward = max(record_diff(f'{what} grads', 'explicit float64', a, b) for a, b in zip(*grads))
    assert forward < TOL and backward < TOL, (what, forward, backward)


def label(kernel, T, S, scale):
    return f"{kernel} T{'<' if T < S else '='}S c={'1/√d' if scale is None else scale}"


def bottom_right(T, S):
    return causal_allowed(T, num_keys=S)                                      # (T, S), True = seen


# ---- tiled_attention ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('T,S', SIZES)
@pytest.mark.parametrize('scale', SCALES)
@pytest.mark.parametrize('causal_flag', [False, True])
def test_tiled_equals_explicit(T, S, scale, causal_flag, record_diff):
    q, k, v = qkv(T, S, seed=T * S)
    seen = bottom_right(T, S) if causal_flag else None
    for block_size in (1, 2, 4, 64):
        ours = tiled_attention(q, k, v, causal_flag, block_size, scale=scale)
        compare(ours, explicit(q, k, v, scale, seen), (q, k, v), record_diff, label('tiled', T, S, scale))


@pytest.mark.parametrize('T,S', SIZES)
@pytest.mark.parametrize('scale', SCALES)
@pytest.mark.parametrize('mask', ['window, ALiBi', 'padding'])
def test_tiled_with_masks_and_score_functions(T, S, scale, mask, record_diff):
    "The causal flag with a block mask (and ALiBi), all at the same positions: the queries are the last T of S."
    q, k, v = qkv(T, S, seed=T + S)
    if mask == 'padding':
        padding = torch.zeros(2, S, dtype=torch.bool)
        padding[0, 1:3] = True                                                # row 0: keys 1 and 2 are padding
        mask_mod, mod = key_padding(padding), None
    else: mask_mod, mod = sliding_window(3), alibi(alibi_slopes(2))
    seen = dense_mask(mask_mod, T, S, batch=2) & bottom_right(T, S)
    for block_size in (1, 2, 4):
        tiles = block_mask(mask_mod, T, S, block_size=block_size, batch=2)
        ours = tiled_attention(q, k, v, True, block_mask=tiles, score_mod=mod, scale=scale)
        compare(ours, explicit(q, k, v, scale, seen, mod), (q, k, v), record_diff,
                label('tiled, ' + mask, T, S, scale))


def test_the_handed_case_query_0_sees_7_of_9_keys():
    "3 queries after 6 cached keys: query 0 sees keys 0..6, and both spellings of causal agree."
    q, k, v = (t.detach() for t in qkv(3, 9))
    flag = tiled_attention(q, k, v, causal=True, block_size=4)
    torch.testing.assert_close(flag, tiled_attention(q, k, v, block_mask=block_mask(causal, 3, 9, block_size=4)),
                               atol=1e-15, rtol=0)
    for key, seen in [(6, True), (7, False)]:
        moved = k.clone()
        moved[..., key, :] += 1.0
        changed = (tiled_attention(q, moved, v, causal=True, block_size=4) - flag)[..., 0, :].abs().max() > 0
        assert changed == seen, f'query 0 and key {key}'


def test_tiled_refuses_causal_with_fewer_keys_than_queries():
    q, k, v = qkv(9, 5)
    with pytest.raises(ValueError, match=r'causal=True puts the queries at the last num_tokens .*bottom-right'
                                         r'.* needs num_keys >= num_tokens; got num_tokens=9, num_keys=5'):
        tiled_attention(q, k, v, causal=True)
    assert tiled_attention(q, k, v).shape == (2, 2, 9, 8)                    # without the mask: fine


@pytest.mark.parametrize('bad', BAD_SCALES, ids=repr)
def test_every_kernel_refuses_a_scale_that_is_not_a_positive_finite_number(bad, one_rank):
    q, k, v = (t.detach() for t in qkv(4, 4))
    message = rf'scale must be None \(1/sqrt\(head_dim\)\) or a finite number > 0; got {re.escape(repr(bad))}'
    for kernel in (tiled_attention, ring_attention, split_kv_attention):
        with pytest.raises(ValueError, match=message): kernel(q, k, v, scale=bad)


# ---- split_kv_attention ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize('T,S', SIZES)
@pytest.mark.parametrize('scale', SCALES)
@pytest.mark.parametrize('causal_flag', [False, True])
def test_split_kv_equals_explicit(T, S, scale, causal_flag, record_diff):
    "Grouped heads (4 on 2), chunks that divide S or not, with and without a padding mask; gradients by autograd."
    q, k, v = qkv(T, S, heads=4, seed=T * S + 1)
    lengths = torch.tensor([S, S - 1])                                       # row 1: its last key is padding
    allowed = (torch.arange(S) < lengths[:, None])[:, None, None]            # (b, 1, 1, S)
    for mask in (None, allowed):
        seen = None if mask is None else mask
        if causal_flag: seen = bottom_right(T, S) if seen is None else seen & bottom_right(T, S)
        for num_splits in (1, 2, 5):
            ours = split_kv_attention(q, k, v, num_splits, mask, scale=scale, causal=causal_flag)
            compare(ours, explicit(q, k, v, scale, seen), (q, k, v), record_diff, label('split_kv', T, S, scale))


def test_split_kv_refuses_causal_with_fewer_keys_and_a_flag_that_is_not_one():
    q, k, v = (t.detach() for t in qkv(9, 5))
    with pytest.raises(ValueError, match='needs num_keys >= num_tokens; got num_tokens=9, num_keys=5'):
        split_kv_attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal must be True or False; got 'yes'"):
        split_kv_attention(q, k, v, causal='yes')


# ---- ring_attention -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('scale', SCALES)
@pytest.mark.parametrize('causal_flag', [False, True])
def test_ring_on_one_rank_equals_explicit(scale, causal_flag, one_rank, record_diff):
    "The ring passes one sequence, T == S (bottom-right and top-left are one mask there): it refuses two lengths."
    q, k, v = (t.detach() for t in qkv(4, 8))
    with pytest.raises(ValueError, match='queries and keys must have one num_tokens'):
        ring_attention(q, k, v, causal_flag, scale=scale)
    for kv_heads in (2, 1):                                                  # GQA: 2 query heads on 1
        for order in ('zigzag', 'contiguous'):
            q, k, v = qkv(8, 8, kv_heads=kv_heads, seed=kv_heads)
            ours = ring_attention(q, k, v, causal_flag, order, scale=scale)
            seen = bottom_right(8, 8) if causal_flag else None
            compare(ours, explicit(q, k, v, scale, seen), (q, k, v), record_diff, label('ring', 8, 8, scale))


def ring_rank(rank: int, world_size: int, cases: list) -> list:
    "On each rank: ring attention on its share; the explicit float64 answer on the whole sequence, sharded."
    results = []
    for causal_flag, order, scale, kv_heads in cases:
        whole = [t.detach() for t in qkv(16, 16, heads=4, kv_heads=kv_heads, seed=3)]   # the same on every rank
        grad_out = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        whole = [t.requires_grad_() for t in whole]
        ref = explicit(*whole, scale, bottom_right(16, 16) if causal_flag else None)
        ref_grads = torch.autograd.grad(ref, whole, grad_out)
        shard = lambda t: shard_sequence(t, rank, world_size, order)
        mine = [shard(t.detach()).requires_grad_() for t in whole]
        out = ring_attention(*mine, causal_flag, order, scale=scale)
        grads = torch.autograd.grad(out, mine, shard(grad_out))
        results.append({'out': (out - shard(ref)).abs().max().item(),
                        'grads': max((a - shard(b)).abs().max().item() for a, b in zip(grads, ref_grads))})
    return results


@pytest.mark.slow  # starts 2 ranks
def test_ring_on_two_ranks_equals_explicit():
    cases = [(c, order, scale, kv) for c in (False, True) for order in ('zigzag', 'contiguous')
             for scale in SCALES for kv in (4, 2)]
    for rank_results in run_ranks(ring_rank, 2, cases):
        for case, r in zip(cases, rank_results): assert max(r.values()) < TOL, (case, r)


# ---- context_parallel and RoPE that depends on the length -----------------------------------------------------------

NTK = dict(rope_type='dynamic', factor=2.0, original_max_position_embeddings=8)
LONGROPE = dict(rope_type='longrope', factor=4.0, original_max_position_embeddings=8,
                short_factor=[1.0] * 2, long_factor=[2.0] * 2)


@pytest.mark.parametrize('scaling', [NTK, LONGROPE], ids=['dynamic', 'longrope'])
def test_context_parallel_refuses_rope_that_depends_on_the_length(scaling, one_rank):
    """Why: rank 1 of 2 (zig-zag) holds positions 8..23 of 32, and dynamic NTK gives them another base than the whole
    sequence does (cos off by 0.23 at head_dim 16). A rescaling fixed in advance is still sharded."""
    like = torch.zeros(1, dtype=torch.float64)
    positions = shard_sequence(torch.arange(32)[:, None], 1, 2)[:, 0]          # (16,): 8 .. 23
    whole, _ = LlamaAttention(64, 32, num_heads=4, rope_scaling=NTK)._rope_at(None, 32, like)
    rank, _ = LlamaAttention(64, 32, num_heads=4, rope_scaling=NTK)._rope_at(positions[None], 16, like)
    assert (rank.reshape(16, -1) - whole[positions]).abs().max() > 0.1
    layer = LlamaAttention(16, 32, num_heads=4, rope_scaling=scaling)
    with pytest.raises(ValueError, match=f"cannot shard rope_scaling of rope_type '{scaling['rope_type']}'"):
        context_parallel(layer, torch.randn(2, 16, 16))
    fixed = LlamaAttention(16, 32, num_heads=4, rope_scaling=dict(rope_type='linear', factor=2.0)).double()
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(context_parallel(fixed, x), fixed(x), atol=1e-12, rtol=0)
