"""Packed documents through every module that keeps state across positions, and the delta-rule kernels with
flash-linear-attention's signatures (fla v0.5.2, fla/ops/gated_delta_rule and fla/ops/kda): each document of a
packed row equals that document alone, or the module refuses document_ids by name."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from selfattn_nbdev.linear import (GatedDeltaNet, chunk_gated_delta_rule, chunk_kda,
                                   fused_recurrent_gated_delta_rule, fused_recurrent_kda)
from selfattn_nbdev.deepseek_v3 import LatentAttention
from selfattn_nbdev.sparse import SparseLatentAttention

# fla v0.5.2's parameters, in its order (fla-core 0.5.2, the four functions' signatures)
FLA = {
    chunk_gated_delta_rule: ['q', 'k', 'v', 'g', 'beta', 'scale', 'initial_state', 'output_final_state',
                             'use_qk_l2norm_in_kernel', 'use_beta_sigmoid_in_kernel', 'allow_neg_eigval',
                             'state_v_first', 'cu_seqlens', 'cu_seqlens_cpu', 'cp_context', 'kwargs'],
    fused_recurrent_gated_delta_rule: ['q', 'k', 'v', 'g', 'gk', 'gv', 'beta', 'scale', 'initial_state',
                                       'output_final_state', 'use_qk_l2norm_in_kernel', 'use_gate_in_kernel',
                                       'A_log', 'dt_bias', 'use_beta_sigmoid_in_kernel', 'allow_neg_eigval',
                                       'state_v_first', 'cu_seqlens', 'kwargs'],
    chunk_kda: ['q', 'k', 'v', 'g', 'beta', 'scale', 'initial_state', 'output_final_state',
                'use_qk_l2norm_in_kernel', 'use_gate_in_kernel', 'use_beta_sigmoid_in_kernel', 'allow_neg_eigval',
                'safe_gate', 'lower_bound', 'disable_recompute', 'return_intermediate_states', 'state_v_first',
                'cu_seqlens', 'cu_seqlens_cpu', 'cp_context', 'kwargs'],
    fused_recurrent_kda: ['q', 'k', 'v', 'g', 'beta', 'A_log', 'dt_bias', 'scale', 'initial_state',
                          'output_final_state', 'use_qk_l2norm_in_kernel', 'use_gate_in_kernel',
                          'use_beta_sigmoid_in_kernel', 'allow_neg_eigval', 'lower_bound', 'state_v_first',
                          'cu_seqlens', 'kwargs']}


@pytest.mark.parametrize('fn', FLA, ids=lambda f: f.__name__)
def test_signatures_are_flas(fn):
    "The same names in the same order, **kwargs last: transformers calls these where it calls fla."
    params = inspect.signature(fn).parameters
    assert list(params) == FLA[fn]
    assert params['kwargs'].kind is inspect.Parameter.VAR_KEYWORD


def inputs(kda: bool, lengths=(7, 20, 13), h=2, d_k=8, d_v=4, seed=0):
    "q, k, v, g, beta of sequences packed in one row (batch 1), and a state per sequence."
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    g = -F.softplus(r(1, T, h, d_k) if kda else r(1, T, h))
    beta = torch.rand(1, T, h, generator=gen, dtype=torch.float64)
    return r(1, T, h, d_k), r(1, T, h, d_k), r(1, T, h, d_v), g, beta, r(len(lengths), h, d_k, d_v)


@pytest.mark.parametrize('fn', FLA, ids=lambda f: f.__name__)
@pytest.mark.parametrize('with_state', [False, True])
def test_cu_seqlens_equals_each_sequence_alone(fn, with_state):
    lengths = (7, 20, 13)
    q, k, v, g, beta, S0 = inputs('kda' in fn.__name__, lengths)
    cu = torch.tensor([0, 7, 27, 40])
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True) | (
        dict(chunk_size=8) if fn.__name__.startswith('chunk') else {})
    o, S = fn(q, k, v, g=g, beta=beta, initial_state=S0 if with_state else None, cu_seqlens=cu, **kw)
    assert o.shape == v.shape and S.shape == S0.shape
    for n, (s, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        o_n, S_n = fn(*(x[:, s:e] for x in (q, k, v)), g=g[:, s:e], beta=beta[:, s:e],
                      initial_state=S0[n:n + 1] if with_state else None, **kw)
        torch.testing.assert_close(o[:, s:e], o_n, rtol=0, atol=1e-12)
        torch.testing.assert_close(S[n:n + 1], S_n, rtol=0, atol=1e-12)
    packed_as_one = fn(q, k, v, g=g, beta=beta, **kw)[0]
    assert (packed_as_one[:, 7:] - o[:, 7:]).abs().max() > 1e-3   # without cu_seqlens the state carries over


def test_flas_options():
    "The beta sigmoid (and twice it), the gate computed from A_log and dt_bias, the state's other layout, gk."
    q, k, v, g, beta, S0 = inputs(False, (40,))
    logit = torch.logit(beta)
    base = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    same = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        o, S = fn(q, k, v, g=g, beta=logit, use_beta_sigmoid_in_kernel=True, output_final_state=True)
        same(o, base[0])
        o2 = fn(q, k, v, g=g, beta=logit, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)[0]
        same(o2, chunk_gated_delta_rule(q, k, v, g=g, beta=logit, use_beta_sigmoid_in_kernel=True,
                                        allow_neg_eigval=True)[0])    # beta in [0, 2]: the two agree
        assert (o2 - o).abs().max() > 1e-3                               # and it is not [0, 1]
        _, S_t = fn(q, k, v, g=g, beta=beta, initial_state=S0.mT, state_v_first=True, output_final_state=True)
        _, S_plain = fn(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True)
        same(S_t.mT, S_plain)
        with pytest.raises(ValueError, match='allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True'):
            fn(q, k, v, g=g, beta=beta, allow_neg_eigval=True)
    A_log, dt_bias = torch.randn(2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    raw = torch.randn_like(g)
    gate = -A_log.exp() * F.softplus(raw + dt_bias)
    want = fused_recurrent_gated_delta_rule(q, k, v, g=gate, beta=beta)[0]
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        got = fn(q, k, v, g=raw, beta=beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the gate in float32, as fla computes it
    gk = -F.softplus(torch.randn(*g.shape, 8, dtype=torch.float64))
    same(fused_recurrent_gated_delta_rule(q, k, v, gk=gk, beta=beta)[0], fused_recurrent_kda(q, k, v, gk, beta)[0])
    same(fused_recurrent_gated_delta_rule(q, k, v, g=g, gk=gk, beta=beta)[0],
         fused_recurrent_kda(q, k, v, g[..., None] + gk, beta)[0])


@pytest.mark.parametrize('given, says', [
    (dict(gv=torch.zeros(1, 40, 2, 4)), 'does not compute gv'),
    (dict(cp_context=object()), 'does not compute cp_context'),
    (dict(head_first=True), 'head_first was removed'),
    (dict(cu_seqlens=torch.tensor([0, 10, 30])), 'cu_seqlens must be a 1-D integer tensor rising from 0 to T=40'),
    (dict(use_gate_in_kernel=True), 'use_gate_in_kernel=True needs A_log'),
])
def test_what_fla_takes_and_this_does_not_compute_is_named(given, says):
    q, k, v, g, beta, _ = inputs(False, (40,))
    fn = fused_recurrent_gated_delta_rule if 'gv' in given else chunk_gated_delta_rule
    with pytest.raises(ValueError, match=says):
        fn(q, k, v, g=g, beta=beta, **given)


def gated_delta_net():
    torch.manual_seed(0)
    return GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, chunk_size=8).double().eval()


def test_a_linear_block_resets_at_each_document():
    "document_ids (b, T) and transformers' cu_seq_lens_q (batch 1): each document from a zero state, as alone."
    layer, x = gated_delta_net(), torch.randn(2, 30, 32, dtype=torch.float64)
    ids = torch.tensor([[0] * 10 + [1] * 20, [4] * 25 + [5] * 5])
    with torch.no_grad():
        packed = layer(x, document_ids=ids)
        for r, cut in ((0, 10), (1, 25)):
            torch.testing.assert_close(packed[r:r + 1, :cut], layer(x[r:r + 1, :cut]), rtol=0, atol=1e-12)
            torch.testing.assert_close(packed[r:r + 1, cut:], layer(x[r:r + 1, cut:]), rtol=0, atol=1e-12)
        by_cu = layer(x[:1], cu_seq_lens_q=torch.tensor([0, 10, 30]))
        torch.testing.assert_close(by_cu, packed[:1], rtol=0, atol=1e-12)
        assert (layer(x)[0, 10:] - packed[0, 10:]).abs().max() > 1e-3   # the state would carry over


def test_qwen35_packed_documents():
    "The hybrid model: its linear blocks reset and its attention blocks mask; each document as alone (the case)."
    from selfattn_nbdev.hybrid import Qwen35
    torch.manual_seed(0)
    model = Qwen35(vocab_size=64, context_length=64, d_model=32, num_heads=2, num_layers=4, num_kv_heads=1,
                   d_hidden=48, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=8).double().eval()
    a, b = torch.randint(0, 64, (1, 12)), torch.randint(0, 64, (1, 20))
    ids = torch.cat([torch.zeros(1, 12, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], 1)
    with torch.no_grad():
        out = model(torch.cat([a, b], 1), document_ids=ids)
        torch.testing.assert_close(out[:, :12], model(a), rtol=0, atol=1e-10)
        torch.testing.assert_close(out[:, 12:], model(b), rtol=0, atol=1e-10)


def test_latent_attentions_refuse_documents_by_name():
    "MLA and DSA attend over one sequence per row (DSA's indexer would pick keys across documents): refused."
    torch.manual_seed(0)
    mla = LatentAttention(32, 64, 2, kv_rank=16, rope_dim=8, nope_dim=8, v_dim=8).double().eval()
    dsa = SparseLatentAttention(32, 64, 2, kv_rank=16, rope_dim=8, nope_dim=8, v_dim=8, q_rank=16, index_topk=4,
                                index_heads=2, index_dim=8).double().eval()
    x, ids = torch.randn(1, 20, 32, dtype=torch.float64), torch.tensor([[0] * 8 + [1] * 12])
    for module in (mla, dsa):
        with pytest.raises(ValueError, match='document_ids is not supported'):
            module(x, document_ids=ids)
