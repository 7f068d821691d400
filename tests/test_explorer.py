"""The attention explorer's Python side: its inputs survive the trip through JSON, bad inputs are refused with a
clear message, and `package_attention` is the package's attention for any explorer (the browser walk,
tools/walk_site.py, checks the JavaScript side against it)."""
import html, json, math, re

import pytest
import torch

from selfattn_nbdev import (CausalAttention, MultiHeadAttention, SelfAttention, SelfAttentionV1,
                            SelfAttentionV2)
from selfattn_nbdev.explorer import AttentionExplorer, package_attention, reference_module


def sdpa_weights(ex: AttentionExplorer, causal: bool) -> torch.Tensor:
    "Softmax(Q K^T / sqrt(d_k)) per head, written out: the reference for package_attention."
    X = ex.embeddings
    scores = (X @ ex.W_query) @ (X @ ex.W_key).transpose(-1, -2) / math.sqrt(ex.d_k)  # (h, T, T)
    if causal:
        T = X.shape[0]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float('-inf'))
    return torch.softmax(scores, -1)


@pytest.mark.parametrize('heads,d_k,d_v', [(1, 2, 3), (1, 4, 4), (3, 2, 5), (4, 3, 1)])
@pytest.mark.parametrize('causal', [False, True])
def test_package_attention_is_scaled_dot_product_attention(heads, d_k, d_v, causal):
    g = torch.Generator().manual_seed(heads * 100 + d_k * 10 + d_v)
    T, d_in = 5, 4
    shape = (lambda d: (heads, d_in, d)) if heads > 1 else (lambda d: (d_in, d))
    ex = AttentionExplorer([f't{i}' for i in range(T)], torch.randn(T, d_in, generator=g),
                           torch.randn(shape(d_k), generator=g), torch.randn(shape(d_k), generator=g),
                           torch.randn(shape(d_v), generator=g), causal=causal)
    weights, context = package_attention(ex.inputs())
    back = AttentionExplorer.from_inputs(json.loads(json.dumps(ex.inputs())))  # what the page holds
    assert torch.equal(back.embeddings.float(), ex.embeddings.float())        # the same float32 numbers
    expected = sdpa_weights(back, causal)
    torch.testing.assert_close(weights, expected, atol=1e-12, rtol=0)
    V = back.embeddings @ back.W_value                                     # (h, T, d_v)
    torch.testing.assert_close(context, expected @ V, atol=1e-6, rtol=0)
    # the other mask setting, as the walk asks for it
    torch.testing.assert_close(package_attention(ex.inputs(), not causal)[0],
                               sdpa_weights(back, not causal), atol=1e-12, rtol=0)


def test_from_module_reads_every_attention_module():
    torch.manual_seed(0)
    x = torch.rand(6, 3)
    modules = [SelfAttention(3, 2), SelfAttentionV1(3, 2), SelfAttentionV2(3, 2),
               CausalAttention(3, 2, context_length=6, dropout=0.0),
               MultiHeadAttention(3, 4, context_length=6, num_heads=2).eval(),
               MultiHeadAttention(3, 6, context_length=6, num_heads=3, causal=False).eval()]
    for m in modules:
        ex = AttentionExplorer.from_module(m, list('abcdef'), x)
        with torch.no_grad():
            _, expected = m(x, return_attn_weights=True)
        weights, _ = package_attention(ex.inputs())
        torch.testing.assert_close(weights.float(), expected.reshape(weights.shape), atol=1e-6, rtol=0)
        assert ex.causal == (type(m).__name__ == 'CausalAttention' or getattr(m, 'causal', False))


def test_reference_module_is_the_matching_module():
    ex = AttentionExplorer(list('ab'), torch.eye(2), torch.eye(2), torch.eye(2), torch.eye(2))
    assert type(reference_module(ex.inputs())) is SelfAttention
    assert type(reference_module(ex.inputs(), causal=True)) is CausalAttention
    multi = AttentionExplorer(list('ab'), torch.eye(2), *[torch.eye(2).expand(2, 2, 2)] * 3)
    assert type(reference_module(multi.inputs())) is MultiHeadAttention


def test_html_carries_inputs_and_weights():
    torch.manual_seed(1)
    ex = AttentionExplorer.from_module(MultiHeadAttention(3, 4, context_length=4, num_heads=2),
                                       ['a', 'b<c', 'd"e', 'f'], torch.rand(4, 3))
    page = ex._repr_html_()
    attrs = dict(re.findall(r'data-(inputs|weights)="([^"]*)"', page))
    inputs, weights = json.loads(html.unescape(attrs['inputs'])), json.loads(html.unescape(attrs['weights']))
    assert inputs['tokens'] == ['a', 'b<c', 'd"e', 'f']      # escaped in the attribute, intact in the JSON
    assert inputs['num_heads'] == 2 and len(inputs['W_query']) == 2
    torch.testing.assert_close(torch.tensor(weights, dtype=torch.float64), package_attention(inputs)[0][0],
                               atol=1e-6, rtol=0)
    assert 'data-attention-explorer' in page and '<script>' in page and 'https://' not in page
    assert page.count('</script>') == 1                       # the script cannot close itself early


def test_json_keeps_what_float32_holds():
    x = torch.tensor([[0.1, 1 / 3], [2e-8, -7.25]], dtype=torch.float32)
    ex = AttentionExplorer(['a', 'b'], x, torch.eye(2), torch.eye(2), torch.eye(2))
    back = torch.tensor(json.loads(json.dumps(ex.inputs()))['embeddings'], dtype=torch.float32)
    assert torch.equal(back, x)


@pytest.mark.parametrize('kwargs,message', [
    (dict(tokens=[]), 'non-empty list'),
    (dict(tokens=['a', '']), 'non-empty strings'),
    (dict(tokens='ab'), 'non-empty list'),
    (dict(embeddings=torch.ones(3, 2)), 'one row per token (2)'),
    (dict(embeddings=torch.ones(2)), 'one row per token'),
    (dict(embeddings=torch.tensor([[1.0, float('nan')], [0.0, 1.0]])), 'finite'),
    (dict(W_query=torch.ones(3, 2)), 'd_in=2'),
    (dict(W_query=torch.ones(2, 2, 2)), 'one matrix per head'),
    (dict(W_key=torch.ones(2, 3)), 'the shape of W_query'),
    (dict(W_value=torch.ones(2, 0)), 'W_value must have shape'),
    (dict(W_value=torch.full((2, 2), float('inf'))), 'W_value must be finite'),
    (dict(causal=1), 'True or False'),
    (dict(query=2), '0 to 1'),
    (dict(query=True), '0 to 1'),
    (dict(head_names=['x', 'y']), 'each of the 1 heads'),
])
def test_bad_input_is_refused_with_a_message(kwargs, message):
    args = dict(tokens=['a', 'b'], embeddings=torch.eye(2), W_query=torch.eye(2), W_key=torch.eye(2),
                W_value=torch.eye(2)) | kwargs
    with pytest.raises(ValueError if 'causal' not in kwargs else TypeError, match=re.escape(message)):
        AttentionExplorer(**args)


def test_from_module_refuses_what_it_cannot_draw():
    with pytest.raises(ValueError, match='without biases'):
        AttentionExplorer.from_module(SelfAttentionV2(3, 2, qkv_bias=True), list('ab'), torch.rand(2, 3))
    with pytest.raises(TypeError, match='got Linear'):
        AttentionExplorer.from_module(torch.nn.Linear(3, 2), list('ab'), torch.rand(2, 3))
