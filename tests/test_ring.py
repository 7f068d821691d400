"""Ring attention and context parallelism (nbs/16_ring.ipynb) on gloo CPU ranks: against SDPA on 2 ranks for every
order, mask, dtype and key/value head count over five seeds, a whole layer on 2 ranks in both orders (and one with a
window, a soft cap and sinks over packed documents with padding, by both kernels), the torchrun script the page shows;
and every check on one rank in this process, so that coverage sees the code the ranks run.

The bars are bounds any correct implementation meets, whatever the CPU: in float32, within 1e-5 of the float64 answer by
torch.testing's measure with atol = rtol (|a - x| / (1 + |x|)), as PyTorch's own float32 SDPA is; in float64, within
1e-12 of it."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from selfattn_nbdev.distributed import free_port, run_ranks
from selfattn_nbdev.ring import check_context_parallel, check_ring_attention
from test_distributed import scripts, torchrun

CASES = [(T, dtype, causal, order, kv_heads) for T in (8, 16, 64) for dtype in (torch.float32, torch.float64)
         for causal in (False, True) for order in ('contiguous', 'zigzag') for kv_heads in (4, 2)]  # 4 query heads
BAR = {torch.float32: 1e-5, torch.float64: 1e-12}


def _float_error(a: torch.Tensor, x: torch.Tensor) -> float:
    "The largest |a - x| / (1 + |x|): at most eps means torch.testing's atol = rtol = eps holds."
    x = x.double()
    return ((a.double() - x).abs() / (1 + x.abs())).max().item()


def _sdpa_and_grads(whole: list, grad_out: torch.Tensor, causal: bool, dtype: torch.dtype) -> list:
    "SDPA's output and the gradients of queries, keys and values on the whole sequence, in `dtype`."
    whole = [t.detach().to(dtype).requires_grad_() for t in whole]
    out = F.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=whole[1].shape[1] != whole[0].shape[1])
    out.backward(grad_out.to(dtype))
    return [out.detach()] + [t.grad for t in whole]


def test_float_error_is_absolute_below_one_relative_above():
    assert _float_error(torch.tensor([3.0, 0.5]), torch.tensor([1.0, 0.0])) == 1.0


@pytest.mark.parametrize('causal', [False, True])
def test_the_float32_bar_is_one_sdpa_meets(causal):
    "PyTorch's float32 SDPA, forward and backward, is within the ring's bar of the float64 answer: 20 random sequences."
    for seed in range(20):
        torch.manual_seed(seed)
        *whole, grad_out = torch.randn(4, 2, 3, 16, 8).unbind(0)   # q, k, v, dO: (b, h, T, hd)
        exact = _sdpa_and_grads(whole, grad_out, causal, torch.float64)
        single = _sdpa_and_grads(whole, grad_out, causal, torch.float32)
        assert max(_float_error(s, x) for s, x in zip(single, exact)) < BAR[torch.float32]


def assert_within_bars(results, cases):
    for r, (num_tokens, dtype, causal, order, kv_heads) in zip(results, cases):
        case = f'{num_tokens} tokens, {dtype}, causal={causal}, {order}, {kv_heads} kv heads: {r}'
        assert r['ring'] < BAR[dtype] and r['sdpa'] < BAR[torch.float32], case
        if dtype == torch.float64: assert r['sdpa'] == 0.0, case   # SDPA in float64 is the referee itself


@pytest.mark.slow  # starts 2 ranks; make test runs the page's 4 ranks, CI both
def test_ring_attention_two_ranks():
    "Forward and backward equal SDPA on the whole sequence: 48 cases (half of them GQA) of five seeds each, one start of the ranks."
    for rank_results in run_ranks(check_ring_attention, 2, CASES, 5): assert_within_bars(rank_results, CASES)


@pytest.mark.slow
def test_context_parallel_two_ranks():
    "A causal GQA layer with RoPE (8 query heads, 2 key/value heads) on 2 ranks, both orders: output and gradients equal the whole layer's."
    config = dict(d_in=16, d_out=32, context_length=12, num_heads=8, num_kv_heads=2, rope=True, out_bias=False)
    for order in ('zigzag', 'contiguous'):  # RoPE's positions follow the order
        for rank_results in run_ranks(check_context_parallel, 2, [config], order):
            assert max(rank_results[0].values()) < 1e-12, (order, rank_results)


@pytest.mark.slow
def test_ulysses_two_ranks():
    """Ulysses on 2 ranks, where 2 key/value heads split (one a rank, the GQA path after the trade) and 4 do: forward and
    backward equal SDPA on the whole sequence (the page runs 4 ranks, where 2 key/value heads are repeated)."""
    from selfattn_nbdev.ring import ulysses_attention
    cases = [case for case in CASES if case[0] == 16 and case[1] == torch.float64] + CASES[:4]
    for rank_results in run_ranks(check_ring_attention, 2, cases, 2, ulysses_attention):
        assert_within_bars(rank_results, cases)


@pytest.mark.slow
def test_masks_scores_and_sinks_on_two_ranks():
    """A layer with a window, a soft cap and sinks over packed documents with padding, on 2 ranks, both orders, both
    kernels (the page runs zig-zag on 4): output and gradients equal the whole layer's."""
    from selfattn_nbdev.llama_attention import LlamaAttention
    from selfattn_nbdev.ring import ulysses_attention
    config = dict(d_model=16, context_length=12, num_heads=4, num_kv_heads=2, window=3, softcap=1.5, sinks=True)
    packed = dict(key_padding_mask=torch.arange(12) >= torch.tensor([[12], [9]]),
                  document_ids=torch.tensor([[0] * 5 + [1] * 7, [0] * 2 + [1] * 4 + [2] * 6]))
    for order in ('zigzag', 'contiguous'):
        for attend in (None, ulysses_attention):
            for rank_results in run_ranks(check_context_parallel, 2, [config], order, attend, LlamaAttention, packed):
                assert max(rank_results[0].values()) < 1e-12, (order, attend, rank_results)


@pytest.fixture
def one_rank():
    "A gloo group of one rank in this process."
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_checks_on_one_rank(one_rank):
    "The ring's checks in this process on one rank (the code the ranks run, under coverage)."
    cases = CASES[:16:3] + CASES[-16::5]
    assert_within_bars(check_ring_attention(0, 1, cases, 2), cases)
    small = dict(d_in=16, d_out=32, context_length=8, num_heads=4, num_kv_heads=2, rope=True)
    for order in ('zigzag', 'contiguous'):
        assert max(check_context_parallel(0, 1, [small], order)[0].values()) < 1e-12
    from selfattn_nbdev.ring import ulysses_attention   # and Ulysses', the same way
    assert_within_bars(check_ring_attention(0, 1, cases, 2, ulysses_attention), cases)
    assert max(check_context_parallel(0, 1, [small], 'zigzag', ulysses_attention)[0].values()) < 1e-12


def test_ulysses_refuses_heads_the_ranks_do_not_divide(one_rank, monkeypatch):
    "3 query heads on 2 ranks: refused by name before anything is sent (the world size read as 2 here)."
    from selfattn_nbdev.ring import ulysses_attention
    monkeypatch.setattr(dist, 'get_world_size', lambda group=None: 2)
    queries = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match=r'num_heads // R whole heads.*multiple of R=2; got \(1, 3, 4, 8\)'):
        ulysses_attention(queries, queries, queries, causal=True)
    with pytest.raises(ValueError, match=r'queries must be \(b, heads, T, head_dim\).*got \(3, 4, 8\)'):
        ulysses_attention(queries[0], queries[0], queries[0])      # no batch axis: named, not a failed unpacking
    monkeypatch.undo()
    four = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match=r'scale must be None .* got 0'):  # as the ring checks it
        ulysses_attention(four, four, four, scale=0)


def test_ring_refuses_what_it_cannot_take(one_rank):
    "The argument checks the page does not show: leading dims, values unlike keys, no tokens, another module."
    from torch import nn
    from selfattn_nbdev.multihead import MultiHeadAttention
    from selfattn_nbdev.ring import context_parallel, ring_attention
    queries, keys, values = torch.randn(3, 1, 2, 8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match='leading dims'):
        ring_attention(queries, keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match='one block'): ring_attention(queries, keys, values[..., :2])
    with pytest.raises(ValueError, match='one block'): ring_attention(queries, keys, values[:, :1])
    with pytest.raises(ValueError, match='leading dims'): ring_attention(queries, keys[:, :0], values[:, :0])
    layer = MultiHeadAttention(16, 32, 16, num_heads=4)
    with pytest.raises(ValueError, match='positive'): context_parallel(layer, torch.randn(2, 0, 16))
    with pytest.raises(ValueError, match='multiple of 2'): context_parallel(layer, torch.randn(2, 3, 16))
    with pytest.raises(TypeError, match='MultiHeadAttention'): context_parallel(nn.Linear(16, 32), torch.randn(2, 8, 16))


def test_context_parallel_refuses_what_it_cannot_run(one_rank):
    """Dropout (a mask the backward cannot draw again), a layer that reuses another layer's keys and values (Gemma 4's
    KV sharing: no keys of its own), and padding or document ids not shaped as the whole sequence."""
    from selfattn_nbdev import MultiHeadAttention
    from selfattn_nbdev.gemma4 import Gemma4Attention
    from selfattn_nbdev.ring import context_parallel, sequence_chunks, shard_sequence
    x = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match=r'without dropout; got dropout=0.1 \(training=True\)'):
        context_parallel(MultiHeadAttention(16, 16, 8, num_heads=4, dropout=0.1), x)
    shared = Gemma4Attention(16, 8, num_heads=4, num_kv_heads=2, head_dim=4, shares_kv=True)
    with pytest.raises(ValueError, match=r"this Gemma4Attention reuses another layer's \(KV sharing\)"):
        context_parallel(shared, x)
    layer = MultiHeadAttention(16, 16, 8, num_heads=4)
    with pytest.raises(TypeError, match='key_padding_mask must be a bool tensor'):
        context_parallel(layer, x, key_padding_mask=torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r'key_padding_mask must have shape \(batch, num_tokens\) = \(1, 8\)'):
        context_parallel(layer, x, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))   # the share's, not the whole
    with pytest.raises(TypeError, match=r'document_ids must be an integer tensor of shape \(1, 8\)'):
        context_parallel(layer, x, document_ids=torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r'document_ids must have shape \(8,\)'):
        context_parallel(layer, x[0], document_ids=torch.zeros(1, 8, dtype=torch.long))   # unbatched x: (T,)
    for rank in (2, -1, 1.0, True):   # a rank outside the world gave another rank's chunks
        with pytest.raises(ValueError, match=r'rank must be an int in \[0, world_size=2\)'):
            shard_sequence(torch.arange(8.)[:, None], rank, 2)
    with pytest.raises(ValueError, match='world_size'): sequence_chunks(0, 0)


def test_context_parallel_runs_what_the_layer_runs(one_rank):
    """On one rank context_parallel is the layer: a window, a soft cap and sinks (refused until the ring took masks,
    scores and sinks), packed documents with padding, batched and unbatched, by both kernels; float64, output and the
    gradients of x and of every weight (the sinks' included)."""
    from selfattn_nbdev.llama_attention import LlamaAttention
    from selfattn_nbdev.ring import context_parallel, ulysses_attention
    torch.manual_seed(0)
    layer = LlamaAttention(16, 12, num_heads=4, num_kv_heads=2, window=3, softcap=1.5, sinks=True).double()
    torch.nn.init.normal_(layer.sinks)
    padding = torch.arange(12) >= torch.tensor([[12], [7]])
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 2 + [1] * 10])
    for attend in (None, ulysses_attention):
        for inputs in ({}, dict(key_padding_mask=padding, document_ids=docs)):
            for batched in (True, False):
                x = torch.randn(2, 12, 16, dtype=torch.float64)
                if not batched: x, inputs = x[1], {k: v[1] for k, v in inputs.items()}
                grads = []
                for run in (lambda t: layer(t, **inputs), lambda t: context_parallel(layer, t, attend=attend, **inputs)):
                    layer.zero_grad()
                    t = x.clone().requires_grad_()
                    out = run(t)
                    (out ** 2).sum().backward()
                    grads.append([out, t.grad] + [p.grad.clone() for p in layer.parameters()])
                assert grads[1][-1].abs().max() > 0   # the sinks' gradient is there, and compared
                for a, b in zip(*grads):
                    assert (a - b).abs().max() < 1e-12, (attend, inputs.keys(), batched)


def test_the_ring_skips_the_tiles_a_mask_hides(one_rank, monkeypatch):
    """Two documents that meet at the chunk boundary: of the 3 causal tiles of one rank's two zig-zag chunks, the one
    whose queries are the second document and whose keys the first is hidden whole, and no scores are computed for it
    (forward and backward); the answer is the masked SDPA's."""
    import torch.nn.functional as F
    import selfattn_nbdev.ring as ring
    from selfattn_nbdev.masks import documents
    computed, tile_scores = [], ring._tile_scores
    monkeypatch.setattr(ring, '_tile_scores', lambda q, k, q0, k0, *a: computed.append((q0, k0)) or tile_scores(q, k, q0, k0, *a))
    docs = torch.tensor([[0] * 8 + [1] * 8])
    q, k, v = (torch.randn(1, 2, 16, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = ring.ring_attention(q, k, v, causal=True, mask_mod=documents(docs))
    out.sum().backward()
    assert sorted(set(computed)) == [(0, 0), (8, 8)] and len(computed) == 4, computed
    same = (docs[0][:, None] == docs[0][None]) & torch.ones(16, 16, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=same)
    assert (out - expected).abs().max() < 1e-12


@pytest.mark.heavy  # starts ranks
def test_bench_counts_what_the_page_says():
    """bench/distributed.py's ring, run on 2 and 4 ranks at small sizes, sends the page's 3R - 2 blocks of keys and
    values per rank, and four times as many with the 2 key/value heads repeated to the 8 query heads."""
    from bench.distributed import ring_rank
    ring = dict(num_tokens=64, heads=8, kv_heads=2, head_dim=8)
    for R in (2, 4):
        block = 2 * ring['kv_heads'] * (ring['num_tokens'] // R) * ring['head_dim'] * 4  # keys, values: float32
        for r in run_ranks(ring_rank, R, ring, timeout=120):
            assert r['bytes'] == (3 * R - 2) * block
            assert r['bytes_heads_repeated'] == ring['heads'] // ring['kv_heads'] * r['bytes']


@pytest.mark.slow  # starts torchrun
def test_the_pages_torchrun_script_runs_as_shown(tmp_path):
    shown = scripts('16_ring.ipynb')
    assert list(shown) == ['long_sequence.py']
    assert torchrun(tmp_path, 'long_sequence.py', shown['long_sequence.py'], 4,
                    r'rank \d+: tokens \([\d, ]+\), output \([\d, ]+\)') == [
        f'rank {r}: tokens (2, 16, 16), output (2, 16, 32)' for r in range(4)]
