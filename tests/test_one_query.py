"""A cached token's attention in a compiled CPU step (Generating in batches): `one_query_attention` gives SDPA's context
for grouped and ungrouped heads and padded rows, the fused path hands it a cache's single query only where it applies,
and a real compiled step takes it and writes the eager step's tokens."""
import pytest
import torch
import torch.nn.functional as F

import selfattn_nbdev.decoding as decoding
from selfattn_nbdev import generate
from selfattn_nbdev.decoding import one_query_attention
from selfattn_nbdev.models import GPT2, Llama
from selfattn_nbdev.multihead import MultiHeadAttention


@pytest.mark.parametrize('heads,kv_heads', [(8, 8), (8, 2), (6, 1)])
def test_one_query_attention_is_sdpas_context(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 1, 2 * heads * 16, generator=g)                     # stacked, as _qkv's
    q = qkv[..., :heads * 16].view(3, 1, heads, 16).transpose(1, 2)          # (3, h, 1, 16), strided
    k, v = (torch.randn(3, kv_heads, 20, 16, generator=g) for _ in range(2))
    seen = (torch.arange(20) < torch.tensor([[5], [20], [1]]))[:, None, None]  # (3, 1, 1, 20): padded rows
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=heads != kv_heads)
    got = one_query_attention(q, k, v, seen)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max()


def _module():
    torch.manual_seed(0)
    return MultiHeadAttention(16, 16, context_length=32, dropout=0.1, num_heads=4, num_kv_heads=2)


def _query_kv(dtype=torch.float32, T=1):
    return (torch.randn(1, 4, T, 4, dtype=dtype), torch.randn(1, 2, 9, 4, dtype=dtype),
            torch.randn(1, 2, 9, 4, dtype=dtype), torch.ones(1, 1, T, 9, dtype=torch.bool))


def test_the_fused_path_hands_a_cache_query_to_it_only_in_a_compiled_cpu_step(monkeypatch):
    "Eager, several queries, another dtype or dropout while training: SDPA, as before; else the sums."
    calls = []
    real = decoding.one_query_attention
    monkeypatch.setattr(decoding, 'one_query_attention', lambda *a: calls.append(a[0].shape) or real(*a))
    m = _module().eval()
    with torch.no_grad():
        m._attend_fused(*_query_kv(), every_row=True)                      # eager: not compiling
        assert calls == []
        monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
        for args in (_query_kv(T=2), _query_kv(torch.bfloat16)):           # two queries; bfloat16
            m._attend_fused(*args, every_row=True)
        m.train(); m._attend_fused(*_query_kv(), every_row=True); m.eval()  # dropout while training
        assert calls == []
        q, k, v, allowed = _query_kv()
        got = m._attend_fused(q, k, v, allowed, every_row=True)
        monkeypatch.undo()
    assert calls == [q.shape]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize('family', ['llama', 'gpt2'])
def test_a_compiled_cpu_step_attends_by_it_and_writes_the_eager_tokens(family, monkeypatch):
    "Traced once per layer (grouped heads for Llama, none for GPT-2); padded prompts of two lengths."
    torch.manual_seed(0)
    model = (Llama(vocab_size=64, context_length=64, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2)
             if family == 'llama' else GPT2(vocab_size=64, context_length=64, d_model=32, num_heads=4,
                                            num_layers=2)).eval()
    traced = []
    real = decoding.one_query_attention
    monkeypatch.setattr(decoding, 'one_query_attention', lambda *a: traced.append(a[0].shape) or real(*a))
    prompts = [torch.randint(0, 64, (5,)), torch.randint(0, 64, (9,))]
    torch._dynamo.reset()
    compiled = generate(model, prompts, 12, compile=True)
    eager = generate(model, prompts, 12, compile=False, static=True)
    assert traced and all(s == (2, 4, 1, 8) for s in traced) and len(traced) % 2 == 0  # each layer, a trace
    for c, e in zip(compiled, eager): assert torch.equal(c, e)
