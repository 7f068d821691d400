"""`tiled_attention` against PyTorch's fused kernel: lengths from 1 to 2,000, many block sizes, float32 and float64,
with and without the causal mask, forward and gradients; the online softmax; the properties every attention has.
With T queries over S keys the causal mask is aligned bottom-right, as after a cache (tests/test_scale_causal.py).

The notebook (nbs/11_tiled.ipynb) shows a few cases; this is the sweep. Lengths up to 33 are all tried, longer ones
sampled around powers of two and up to 2,000; for each length, block sizes from 1 to beyond the length, as long as a
call stays within 4 x 4 tiles (every tile costs a few dozen PyTorch calls), and the default, 64, at 1,000."""
import math, random

import pytest
import torch
import torch.nn.functional as F

from selfattn_nbdev.causal import causal_allowed, leaks_future
from selfattn_nbdev.tiled import online_softmax, online_softmax_step, tiled_attention

TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float64]
LONG = [47, 64, 65, 127, 129, 257, 511, 1023, 2000]
MAX_TILES = 16  # per call in the sweep (every tile costs a few dozen PyTorch calls)


def block_sizes(T: int, rng: random.Random) -> list[int]:
    """Block sizes for length T: tiny, dividing T or not, T itself and beyond, one at random; at most 4 x 4 tiles.
    Beyond 300 tokens (where every call costs more), two: one that does not divide T and one at random."""
    if T > 300: return sorted({T // 3 + 1, rng.randint(math.ceil(T / 8), T + 8)})
    candidates = {1, 2, 3, 5, 7, T - 1, T, T + 7, math.ceil(T / 8), T // 3 + 1, rng.randint(1, T + 8)}
    return sorted(b for b in candidates if b >= 1 and math.ceil(T / b) ** 2 <= MAX_TILES)


def cases() -> list[tuple[int, int]]:
    "(T, block_size): every T up to 33, then lengths around powers of two and up to 2,000; the default 64 at 1,000."
    rng = random.Random(0)
    sweep = [(T, b) for T in list(range(1, 34)) + LONG for b in block_sizes(T, rng)]
    return sweep + [(1000, 64)]


def qkv(T: int, dtype, num_keys: int | None = None, d_v: int = 8, seed: int = 0, requires_grad=False,
        lead=None, head_dim=16):
    """Random queries, keys, values (*lead, T, head_dim), (*lead, num_keys, head_dim), (*lead, num_keys, d_v);
    lead is (batch, heads) = (1, 2), or (1, 1) beyond 300 tokens (long calls cost more)."""
    lead = lead or ((1, 2) if T <= 300 else (1, 1))
    g = torch.Generator().manual_seed(seed)
    S = T if num_keys is None else num_keys
    shapes = [(*lead, T, head_dim), (*lead, S, head_dim), (*lead, S, d_v)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(requires_grad) for s in shapes]


def exact(fn, *tensors):
    "fn on float64 copies of the tensors: the answer float32 is rounding towards."
    return fn(*(t.detach().double() for t in tensors))


@pytest.mark.no_cover  # a sweep of Python loops: slow under coverage's tracer; the small tests below cover the lines
@pytest.mark.parametrize('dtype', DTYPES, ids=str)
def test_forward_equals_sdpa_for_every_length_and_block_size(dtype, record_diff):
    """Within 1e-6 (float32) or 1e-12 (float64) of SDPA. In float32, SDPA itself is sometimes a little more than 1e-6
    from the exact (float64) answer; there tiled_attention must be within 1e-6 of the exact answer and closer to it."""
    for T, block_size in cases():
        q, k, v = qkv(T, dtype, seed=T)
        for causal in (False, True):
            ours = tiled_attention(q, k, v, causal, block_size)
            theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            diff = (ours - theirs).abs().max().item()
            where = f'T={T}, block_size={block_size}, causal={causal}: {diff:.1e} from SDPA'
            if dtype == torch.float64:
                record_diff('tiled_attention', 'SDPA', ours, theirs)
                assert diff <= TOL[dtype], where
                continue
            if diff <= TOL[dtype]: continue
            truth = exact(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v)
            ours_err, sdpa_err = ((t.double() - truth).abs().max().item() for t in (ours, theirs))
            assert ours_err <= TOL[dtype] and ours_err < sdpa_err, (
                f'{where}; {ours_err:.1e} from the exact answer, SDPA {sdpa_err:.1e}')


GRAD_CASES = [(1, 1), (2, 1), (5, 2), (17, 4), (64, 64), (100, 7), (333, 64), (2000, 700)]


@pytest.mark.no_cover  # a sweep of Python loops: slow under coverage's tracer; the small tests below cover the lines
@pytest.mark.parametrize('dtype', DTYPES, ids=str)
def test_gradients_equal_sdpa(dtype, record_diff):
    "float64: within 1e-12 of SDPA. float32: as close to the exact (float64) gradients as SDPA is, give or take 1e-6."
    for T, block_size in GRAD_CASES:
        inputs = qkv(T, dtype, seed=T, requires_grad=True)
        g = torch.Generator().manual_seed(T)
        grad_out = torch.randn(*inputs[0].shape[:-1], 8, dtype=dtype, generator=g)   # dO
        for causal in (False, True):
            sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            ours = torch.autograd.grad(tiled_attention(*inputs, causal, block_size), inputs, grad_out)
            theirs = torch.autograd.grad(sdpa(*inputs), inputs, grad_out)
            where = f'T={T}, block_size={block_size}, causal={causal}'
            if dtype == torch.float64:
                for name, a, b in zip('qkv', ours, theirs):
                    record_diff(f'tiled_attention grad {name}', 'SDPA', a, b)
                    assert (a - b).abs().max() <= 1e-12, f'{where}, d{name}'
                continue
            exact_inputs = [t.detach().double().requires_grad_() for t in inputs]
            truth = torch.autograd.grad(sdpa(*exact_inputs), exact_inputs, grad_out.double())
            for name, a, b, t in zip('qkv', ours, theirs, truth):
                assert (a - b).abs().max() <= 1e-5 * max(1.0, t.abs().max().item()), f'{where}, d{name}'
                ours_err, sdpa_err = (a.double() - t).abs().max(), (b.double() - t).abs().max()
                assert ours_err <= sdpa_err + 1e-6, f'{where}, d{name}: {ours_err:.1e} vs SDPA {sdpa_err:.1e}'


@pytest.mark.no_cover  # a sweep of Python loops: slow under coverage's tracer; the small tests below cover the lines
@pytest.mark.parametrize('causal', [False, True])
def test_gradcheck_in_float64(causal):
    for T, S, block_size in [(1, 1, 1), (7, 7, 3), (5, 9, 2), (9, 5, 4)][:4 - causal]:  # causal: S >= T
        inputs = qkv(T, torch.float64, num_keys=S, d_v=3, requires_grad=True, lead=(1,), head_dim=2)
        assert torch.autograd.gradcheck(lambda q, k, v: tiled_attention(q, k, v, causal, block_size), inputs)


def test_second_derivatives_are_refused_not_wrong():
    q, k, v = qkv(5, torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r'create_graph=True \(second-order gradients\) is not supported'):
        torch.autograd.grad(tiled_attention(q, k, v).sum(), q, create_graph=True)
    grad_q, = torch.autograd.grad(tiled_attention(q, k, v).sum(), q)   # first order: as before
    assert grad_q.shape == q.shape and not grad_q.requires_grad


@pytest.mark.parametrize('T,S', [(5, 9), (9, 5), (1, 30), (30, 1), (64, 200), (200, 64)])
def test_more_or_fewer_keys_than_queries_follow_sdpa(T, S):
    """Causal is bottom-right: the queries are the last T of the S positions, query i sees keys j <= i + S - T
    (SDPA given that mask; its is_causal is top-left). Fewer keys than queries: refused when causal."""
    q, k, v = qkv(T, torch.float64, num_keys=S, d_v=5, seed=S)
    for causal in (False, True):
        if causal and S < T:
            with pytest.raises(ValueError, match=f'needs num_keys >= num_tokens; got num_tokens={T}, num_keys={S}'):
                tiled_attention(q, k, v, causal)
            continue
        seen = causal_allowed(T, num_keys=S) if causal else None
        for block_size in (b for b in (1, 3, 64) if math.ceil(T / b) * math.ceil(S / b) <= 100):
            torch.testing.assert_close(tiled_attention(q, k, v, causal, block_size),
                                       F.scaled_dot_product_attention(q, k, v, attn_mask=seen), atol=1e-12, rtol=0)


def test_any_leading_dims_and_strided_inputs():
    g = torch.Generator().manual_seed(0)
    for lead in [(), (3,), (2, 2, 2)]:
        q, k, v = (torch.randn(*lead, 11, 4, generator=g, dtype=torch.float64) for _ in range(3))
        torch.testing.assert_close(tiled_attention(q, k, v, True, 4),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=True))
    x = torch.randn(2, 11, 3, 4, dtype=torch.float64)          # (b, T, heads, hd): transposed views, not contiguous
    q = k = v = x.transpose(1, 2)
    assert not q.is_contiguous()
    torch.testing.assert_close(tiled_attention(q, k, v, False, 5), F.scaled_dot_product_attention(q, k, v))


def test_large_scores_do_not_overflow():
    q, k, v = qkv(50, torch.float64)
    q = q * 1000                                   # scores in the thousands: exp(score) would overflow unshifted
    assert torch.exp(q @ k.transpose(-2, -1) / 4).isinf().any()
    ours = tiled_attention(q, k, v, True, 8)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-10, rtol=0)


def test_no_queries_give_no_output():
    q, k, v = qkv(0, torch.float32, num_keys=4)
    assert tiled_attention(q, k, v, True).shape == (1, 2, 0, 8)


def test_backward_saves_nothing_of_size_T_squared():
    "The FlashAttention promise: what autograd keeps for the backward is linear in T."
    T = 256
    q, k, v = qkv(T, torch.float32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = tiled_attention(q, k, v, True, 32)
    assert saved and max(saved) <= 2 * T * 16, saved          # the inputs, the output, L: never (T, T)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize('block_size', [1, 3, 4, 16])
def test_the_future_cannot_leak(block_size):
    torch.manual_seed(0)
    W = torch.randn(3, 6, 4, dtype=torch.float64)
    layer = lambda x, causal=True: tiled_attention(x @ W[0], x @ W[1], x @ W[2], causal, block_size)
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    assert not any(leaks_future(layer, x, t) for t in range(8))
    assert leaks_future(lambda x: layer(x, causal=False), x, t=4)


def test_permutation_equivariance_without_the_mask():
    torch.manual_seed(1)
    q, k, v = qkv(23, torch.float64)
    order = torch.randperm(23)
    for block_size in (1, 5, 64):
        out = tiled_attention(q, k, v, False, block_size)
        # shuffling the queries shuffles the outputs; shuffling keys with their values changes nothing
        torch.testing.assert_close(tiled_attention(q[..., order, :], k, v, False, block_size), out[..., order, :])
        torch.testing.assert_close(tiled_attention(q, k[..., order, :], v[..., order, :], False, block_size), out)


def test_online_softmax_equals_softmax():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 50, generator=g, dtype=torch.float64) * 10
    scores[1, :45] = -math.inf                # hidden keys first: the guard against -inf - (-inf)
    scores[2, 1::3] = -math.inf
    scores[3, -1] = 500.0                     # a large score last: everything before is rescaled to ~0
    for block_size in (1, 2, 7, 49, 50, 51):
        torch.testing.assert_close(online_softmax(scores, block_size), torch.softmax(scores, -1), atol=1e-12, rtol=0)
    all_hidden = torch.full((2, 4), -math.inf)
    # a row with no key: 0s, as softmax_stable gives (torch.softmax gives nan)
    assert (online_softmax(all_hidden) == 0).all() and torch.softmax(all_hidden, -1).isnan().all()


def test_online_softmax_step_does_not_depend_on_how_the_row_is_cut():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 40, generator=g, dtype=torch.float64)
    start = scores.new_full((3, 1), -math.inf), scores.new_zeros(3, 1)
    results = []
    for cuts in ([0, 40], [0, 1, 40], [0, 13, 14, 39, 40], list(range(41))):
        m, l = start
        for a, b in zip(cuts, cuts[1:]):
            m, l, _, _ = online_softmax_step(m, l, scores[:, a:b])
        results.append((m, l))
    for m, l in results:
        torch.testing.assert_close(m, scores.amax(-1, keepdim=True))
        torch.testing.assert_close(l, torch.exp(scores - m).sum(-1, keepdim=True))


def test_queries_after_a_cache_are_the_last_positions():
    "3 queries after 5 cached keys equal the last 3 rows of the 8 queries over the same keys, and are no padding trick."
    q, k, v = qkv(3, torch.float64, num_keys=8)
    padded = torch.cat([torch.zeros(1, 2, 5, 16, dtype=torch.float64), q], dim=2)
    for block_size in (1, 2, 3, 64):
        torch.testing.assert_close(tiled_attention(q, k, v, True, block_size),
                                   tiled_attention(padded, k, v, True, block_size)[..., 5:, :], atol=1e-14, rtol=0)


def test_errors_say_what_was_expected_and_what_was_given():
    q, k, v = qkv(6, torch.float32)
    with pytest.raises(TypeError, match=r'queries must be a floating-point torch.Tensor \(\.\.\., num_tokens, dim\); got list'):
        tiled_attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match='values must be a floating-point torch.Tensor .*got torch.int64'):
        tiled_attention(q, k, v.long())
    with pytest.raises(ValueError, match=r'keys must have at least 2 dims .*got shape \(16,\)'):
        tiled_attention(q, k[0, 0, 0], v)
    with pytest.raises(TypeError, match='one dtype; got queries torch.float32, keys torch.float64'):
        tiled_attention(q, k.double(), v)
    with pytest.raises(ValueError, match='one device; got queries cpu, keys meta, values cpu'):
        tiled_attention(q, k.to('meta'), v)
    with pytest.raises(ValueError, match=r'same leading dims \(\.\.\.\); got queries \(1, 2, 6, 16\), keys \(2, 6, 16\)'):
        tiled_attention(q, k[0], v)
    with pytest.raises(ValueError, match='same head_dim'):
        tiled_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match=r'same number of tokens \(dim -2\)'):
        tiled_attention(q, k, v[..., :5, :])
    with pytest.raises(ValueError, match='the number of keys must be a positive integer; got 0'):
        tiled_attention(q, k[..., :0, :], v[..., :0, :])
    with pytest.raises(ValueError, match='head_dim must be a positive integer; got 0'):
        tiled_attention(q[..., :0], k[..., :0], v)
    with pytest.raises(TypeError, match="causal must be True or False; got 'True'"):
        tiled_attention(q, k, v, causal='True')
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f'block_size must be a positive integer; got {bad!r}'):
            tiled_attention(q, k, v, block_size=bad)
    with pytest.raises(ValueError, match='block_size must be a positive integer'):
        online_softmax(q, block_size=0)
