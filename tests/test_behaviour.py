"""How every exported attention module behaves: shapes, modes, dtypes, state, compilation, and its errors."""
import pytest
import torch

from selfattn_nbdev import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttention, SelfAttentionV1, SelfAttentionV2
from conftest import CAUSAL, FACTORIES, WITH_DROPOUT, make

ALL = list(FACTORIES)


@pytest.mark.parametrize('name', ALL)
@pytest.mark.parametrize('d_in,d_out', [(3, 4), (6, 2), (4, 4)])
def test_shapes_2d_and_3d(name, d_in, d_out):
    m = make(name, d_in, d_out, dtype=torch.float32)
    x = torch.randn(2, 5, d_in)
    assert m(x).shape == (2, 5, d_out)
    assert m(x[0]).shape == (5, d_out)
    torch.testing.assert_close(m(x[0]), m(x)[0])       # a 2-D input is a batch of one
    assert m(x[:, :1]).shape == (2, 1, d_out)           # a single token


@pytest.mark.parametrize('name', WITH_DROPOUT)
def test_dropout_only_in_training(name):
    m = make(name, 4, 4, dropout=0.5, dtype=torch.float32).train()
    x = torch.randn(2, 6, 4)
    assert not torch.equal(m(x), m(x))                  # training: a new dropout mask each call
    m.eval()
    torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)
    torch.testing.assert_close(m(x), make(name, 4, 4, dropout=0.0, dtype=torch.float32)(x))  # eval == no dropout


@pytest.mark.parametrize('explicit', [False, True])
def test_fully_masked_query_gets_zero_context_and_no_nan(explicit):
    torch.manual_seed(0)
    m = MultiHeadAttention(4, 4, 6, num_heads=2).train()
    x = torch.randn(2, 6, 4, requires_grad=True)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 0] = True                                     # causal: query 0 of sequence 0 sees only key 0, which is padding
    pad[1] = True                                        # sequence 1 is all padding: every query is dead
    out = m(x, key_padding_mask=pad, return_attn_weights=explicit)
    out = out[0] if explicit else out
    torch.testing.assert_close(out[0, 0], m.out_proj.bias.expand(4))   # zero context -> out_proj(0) = bias
    torch.testing.assert_close(out[1], m.out_proj.bias.expand(6, 4))
    out.sum().backward()
    assert not out.isnan().any() and not x.grad.isnan().any()
    assert all(not p.grad.isnan().any() for p in m.parameters())


def test_padded_keys_are_never_attended():
    torch.manual_seed(0)
    m = MultiHeadAttention(4, 4, 6, num_heads=2, causal=False).eval()
    pad = torch.tensor([[False, False, True, False, True, False]])
    x = torch.randn(1, 6, 4)
    _, w = m(x, key_padding_mask=pad, return_attn_weights=True)
    assert w[..., pad[0]].abs().max() == 0
    x2 = x.clone(); x2[0, pad[0]] = torch.randn(2, 4) * 100   # changing padded tokens changes no real output
    torch.testing.assert_close(m(x2, key_padding_mask=pad)[0, ~pad[0]], m(x, key_padding_mask=pad)[0, ~pad[0]])


@pytest.mark.parametrize('name', ALL)
def test_state_dict_holds_weights_only_and_round_trips(name):
    m = make(name, 4, 4, dtype=torch.float32, seed=1)
    assert all(not k.endswith('mask') for k in m.state_dict())
    assert set(m.state_dict()) == {k for k, _ in m.named_parameters()}
    fresh = make(name, 4, 4, dtype=torch.float32, seed=2)
    fresh.load_state_dict(m.state_dict())
    x = torch.randn(2, 5, 4)
    torch.testing.assert_close(fresh(x), m(x), rtol=0, atol=0)


@pytest.mark.parametrize('name', ALL)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes_and_to(name, dtype):
    m = make(name, 4, 4, dtype=torch.float64)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    reference = m(x)
    m = m.to(dtype)
    if any(b.dtype == torch.bool for b in m.buffers()):
        assert all(b.dtype == torch.bool for b in m.buffers())   # .to(dtype) leaves the boolean mask alone
    out = m(x.to(dtype))
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out.double(), reference, rtol=tol, atol=tol)


@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer makes torch.compile 1.5x slower; the eager tests cover the same lines
@pytest.mark.parametrize('name', ['CausalAttention', 'MultiHeadAttention', 'MultiHeadAttention(explicit)'])
def test_torch_compile_matches_eager(name):
    m = make(name, 8, 8, num_heads=2, dtype=torch.float32)
    compiled = torch.compile(m)
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)


# ---- errors: each names what was expected and what was given ------------------------------------------------

@pytest.mark.parametrize('name', ALL)
@pytest.mark.parametrize('bad,error,message', [
    ([[0.1, 0.2, 0.3, 0.4]], TypeError, r'must be a torch.Tensor .* got list'),
    (torch.zeros(4), ValueError, r'must have 2 dims .* or 3 dims .*; got 1 dims with shape \(4,\)'),
    (torch.zeros(1, 2, 3, 4), ValueError, r'got 4 dims with shape \(1, 2, 3, 4\)'),
    (torch.zeros(2, 3, 5), ValueError, r'last dimension d_in=4; got shape \(2, 3, 5\)'),
    (torch.zeros(2, 3, 4, dtype=torch.int64), TypeError, r'floating-point .* got dtype torch.int64'),
    (torch.zeros(2, 3, 4, dtype=torch.float64), TypeError, r'dtype torch.float64 but the module.s weights are torch.float32'),
])
def test_bad_input(name, bad, error, message):
    m = make(name, 4, 4, dtype=torch.float32)
    with pytest.raises(error, match=message):
        m(bad)


@pytest.mark.parametrize('name', CAUSAL + ['MultiHeadAttention(causal=False)'])
def test_too_many_tokens(name):
    m = make(name, 4, 4, context_length=6, dtype=torch.float32)
    with pytest.raises(ValueError, match=r'7 tokens but the module was built with context_length=6'):
        m(torch.zeros(1, 7, 4))


@pytest.mark.parametrize('build,message', [
    (lambda: SelfAttention(0, 4), r'd_in must be a positive integer; got 0'),
    (lambda: SelfAttentionV1(4, -1), r'd_out must be a positive integer; got -1'),
    (lambda: SelfAttentionV2(4.0, 4), r'd_in must be a positive integer; got 4.0'),
    (lambda: CausalAttention(4, 4, context_length=0), r'context_length must be a positive integer; got 0'),
    (lambda: CausalAttention(4, 4, 6, dropout=1.0), r'dropout must be a probability in \[0, 1\); got 1.0'),
    (lambda: CausalAttention(4, 4, 6, dropout=-0.1), r'got -0.1'),
    (lambda: MultiHeadAttentionWrapper(4, 6, 6, num_heads=4), r'num_heads must divide d_out .* got d_out=6, num_heads=4'),
    (lambda: MultiHeadAttention(4, 6, 6, num_heads=4), r'got d_out=6, num_heads=4'),
    (lambda: MultiHeadAttention(4, 4, 6, num_heads=0), r'num_heads must be a positive integer; got 0'),
    (lambda: MultiHeadAttention(4, 4, 6, dropout=2), r'dropout must be a probability in \[0, 1\); got 2'),
    (lambda: MultiHeadAttention(4, True, 6), r'd_out must be a positive integer; got True'),
])
def test_bad_construction(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize('pad,error,message', [
    (torch.zeros(2, 5, dtype=torch.bool), ValueError, r'must have shape \(batch, num_tokens\) = \(2, 6\); got \(2, 5\)'),
    (torch.zeros(6, dtype=torch.bool), ValueError, r'= \(2, 6\); got \(6,\)'),
    (torch.zeros(2, 6), TypeError, r'must be a bool tensor \(True = padding, ignored\); got dtype torch.float32'),
    ([[False] * 6] * 2, TypeError, r'must be a bool tensor of shape \(batch, num_tokens\) = \(2, 6\); got list'),
])
@pytest.mark.parametrize('explicit', [False, True])
def test_bad_padding_mask(pad, error, message, explicit):
    m = MultiHeadAttention(4, 4, 6)
    with pytest.raises(error, match=message):
        m(torch.zeros(2, 6, 4), key_padding_mask=pad, return_attn_weights=explicit)


def test_padding_mask_for_2d_input():
    m = MultiHeadAttention(4, 4, 6).eval()
    x, pad = torch.randn(6, 4), torch.tensor([False] * 4 + [True] * 2)
    torch.testing.assert_close(m(x, key_padding_mask=pad), m(x[None], key_padding_mask=pad[None])[0])
    with pytest.raises(ValueError, match=r'must have shape \(num_tokens,\) = \(6,\); got \(1, 6\)'):
        m(x, key_padding_mask=pad[None])


# Inputs that used to be accepted silently or rejected with an unclear message.
FLAG_MODULES = {
    'SelfAttentionV2': lambda **kw: SelfAttentionV2(4, 4, **kw),
    'CausalAttention': lambda **kw: CausalAttention(4, 4, 8, **kw),
    'MultiHeadAttentionWrapper': lambda **kw: MultiHeadAttentionWrapper(4, 4, 8, num_heads=2, **kw),
    'MultiHeadAttention': lambda **kw: MultiHeadAttention(4, 4, 8, num_heads=2, **kw),
}


@pytest.mark.parametrize('name', list(FLAG_MODULES))
def test_switches_must_be_booleans(name):
    with pytest.raises(TypeError, match="qkv_bias must be True or False; got 'no'"):
        FLAG_MODULES[name](qkv_bias='no')


def test_causal_must_be_a_boolean():
    with pytest.raises(TypeError, match="causal must be True or False; got 'False'"):
        MultiHeadAttention(4, 4, 8, causal='False')


def test_numpy_integers_are_sizes():
    np = pytest.importorskip('numpy')
    m = MultiHeadAttention(np.int64(4), np.int64(4), np.int64(8), num_heads=np.int64(2))
    assert m(torch.randn(2, 3, 4)).shape == (2, 3, 4)


@pytest.mark.parametrize('name', ['SelfAttention', 'SelfAttentionV1', 'SelfAttentionV2', 'CausalAttention',
                                  'MultiHeadAttention'])
def test_device_mismatch_is_named(name):
    m = make(name, 4, 4)
    with pytest.raises(ValueError, match="x is on device meta but the module's weights are on cpu"):
        m(torch.randn(2, 3, 4, device='meta', dtype=torch.float64))
