"""The smaller exports of the story pages, checked outside the story: simple_attention, the training task, reprs."""
import math

import pytest
import torch

from selfattn_nbdev import (CausalAttention, MultiHeadAttention, SelfAttention, causal_allowed, simple_attention, softmax_stable,
                            to_torch_multihead)
from selfattn_nbdev.training import VOCAB, BankSenseClassifier, make_bank_sentences, train_classifier


def test_simple_attention_is_softmax_of_dot_products():
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    context, weights = simple_attention(x, return_attn_weights=True)
    expected = torch.softmax(x @ x.transpose(1, 2), dim=-1)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(context, expected @ x)
    torch.testing.assert_close(simple_attention(x[0]), context[0])
    with pytest.raises(ValueError, match='got 1 dims'):
        simple_attention(x[0, 0])


def test_softmax_stable_never_overflows():
    scores = torch.tensor([[1000.0, 999.0, -1000.0], [-5e4, -5e4, -5e4]])
    w = softmax_stable(scores)
    assert not w.isnan().any()
    torch.testing.assert_close(w, torch.softmax(scores, dim=-1))
    torch.testing.assert_close(w[1], torch.full((3,), 1 / 3))


def test_bank_sentences_are_well_formed():
    ids, labels, pos = make_bank_sentences(300, seed=7, num_tokens=6)
    assert ids.shape == (300, 6) and labels.shape == pos.shape == (300,)
    bank = VOCAB.index('bank')
    assert (ids == bank).sum(1).eq(1).all() and (ids[torch.arange(300), pos] == bank).all()
    sense = ids.clone(); sense[torch.arange(300), pos] = len(VOCAB)      # hide bank
    river = (sense >= 1) & (sense <= 5)
    money = (sense >= 6) & (sense <= 10)
    assert (river.sum(1) + money.sum(1)).eq(1).all()                    # exactly one sense word
    assert torch.equal(money.any(1).long(), labels)                     # and it decides the label
    torch.testing.assert_close(make_bank_sentences(5, seed=1)[0], make_bank_sentences(5, seed=1)[0])
    with pytest.raises(ValueError, match='num_tokens must be an integer >= 2'):
        make_bank_sentences(5, seed=1, num_tokens=1)
    with pytest.raises(ValueError, match='n must be a positive integer'):
        make_bank_sentences(0, seed=1)


def test_bank_classifier_learns_the_sense():
    ids, labels, pos = make_bank_sentences(400, seed=0)
    torch.manual_seed(0)
    model = BankSenseClassifier()
    logits, weights = model(ids, pos, return_attn_weights=True)
    assert logits.shape == (400, 2) and weights.shape == (400, 5, 5)
    losses = train_classifier(model, ids, labels, pos, steps=200, lr=0.02)
    assert losses[-1] < 0.1 * losses[0]
    test_ids, test_labels, test_pos = make_bank_sentences(200, seed=1)
    with torch.no_grad():
        assert (model(test_ids, test_pos).argmax(-1) == test_labels).float().mean() > 0.9


def test_reprs_name_the_sizes():
    assert repr(SelfAttention(4, 3)).startswith('SelfAttention(d_in=4, d_out=3)')
    assert 'context_length=8' in repr(CausalAttention(4, 3, 8))
    assert 'num_heads=2, causal=False' in repr(MultiHeadAttention(4, 4, 8, num_heads=2, causal=False))


def test_to_torch_multihead_refuses_what_it_cannot_express():
    with pytest.raises(ValueError, match=r'needs d_in == d_out; got d_in=3, d_out=4'):
        to_torch_multihead(MultiHeadAttention(3, 4, 8, qkv_bias=True))
    # GQA by the shapes of the projections; a window and RoPE because the outputs differ
    for option, given, why in [('num_kv_heads', 2, 'projects queries, keys and values'),
                               ('window', 3, 'cannot compute what this module computes'),
                               ('rope', True, 'cannot compute what this module computes')]:
        m = MultiHeadAttention(8, 8, 16, num_heads=4, **{option: given})
        with pytest.raises(ValueError, match=rf'{why}.*{option}={given!r}'):
            to_torch_multihead(m)
    m = MultiHeadAttention(8, 8, 16, num_heads=4, window=3).train()
    with pytest.raises(ValueError): to_torch_multihead(m)
    assert m.training                                  # the check leaves the mode as it was


def test_out_bias_can_be_left_out_and_converts_as_zero():
    torch.manual_seed(0)
    m = MultiHeadAttention(4, 4, 8, num_heads=2, out_bias=False).eval()
    assert m.out_proj.bias is None and 'out_bias=False' in repr(m)
    assert 'out_proj.bias' not in m.state_dict()
    ref = to_torch_multihead(m)
    assert torch.count_nonzero(ref.out_proj.bias) == 0
    x = torch.randn(2, 5, 4)
    theirs, _ = ref(x, x, x, attn_mask=~causal_allowed(5), need_weights=False)
    torch.testing.assert_close(m(x), theirs)
    with pytest.raises(TypeError, match='out_bias'):
        MultiHeadAttention(4, 4, 8, out_bias='no')


def test_to_torch_multihead_without_qkv_bias_uses_zero_biases():
    torch.manual_seed(0)
    m = MultiHeadAttention(4, 4, 8, num_heads=2).eval()
    ref = to_torch_multihead(m)
    assert torch.count_nonzero(ref.in_proj_bias) == 0
    x = torch.randn(2, 5, 4)
    theirs, _ = ref(x, x, x, attn_mask=~causal_allowed(5), need_weights=False)
    torch.testing.assert_close(m(x), theirs)
