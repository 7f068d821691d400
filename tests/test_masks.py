"""The causal mask costs nothing until it is used, and survives every way of building a module.

A mask kept as a non-persistent buffer is neither saved nor restored: a module created on the `meta` device (as
FSDP and large-model loading do), given storage with `to_empty` and filled from a state dict would have an
arbitrary mask and see the future. These tests build every causal module that way and compare it with its source,
on every path; they also check that nothing of size context_length² is allocated at construction and that the
book's checkpoints, which carry a `mask` entry, load with strict=True."""
import pytest
import torch

from selfattn_nbdev import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper, causal_allowed, leaks_future

BUILDERS = {
    'CausalAttention': lambda: CausalAttention(16, 16, 64),
    'MultiHeadAttentionWrapper': lambda: MultiHeadAttentionWrapper(16, 16, 64, num_heads=2),
    'MultiHeadAttention': lambda: MultiHeadAttention(16, 16, 64, num_heads=4),
}
PATHS = {  # name -> how to call a module of that kind
    'fused': lambda m, x: m(x),
    'explicit': lambda m, x: m(x, return_attn_weights=True)[0],
    'padding': lambda m, x: m(x, key_padding_mask=torch.arange(x.shape[1]).expand(x.shape[0], -1) >= x.shape[1] - 2),
}


def _cases():
    for name in BUILDERS:
        for path in (PATHS if name == 'MultiHeadAttention' else ['fused']):
            yield name, path


@pytest.mark.parametrize('name,path', list(_cases()))
def test_module_built_on_meta_device_stays_causal(name, path):
    torch.manual_seed(0)
    src = BUILDERS[name]().eval()
    with torch.device('meta'):
        m = BUILDERS[name]()
    m = m.to_empty(device='cpu').eval()
    m.load_state_dict(src.state_dict())
    x = torch.randn(2, 12, 16)
    call = PATHS[path]
    assert torch.equal(call(m, x), call(src, x))
    assert not any(leaks_future(lambda x: call(m, x), x, t) for t in (0, 5, 10))


@pytest.mark.parametrize('name', list(BUILDERS))
def test_no_buffer_grows_with_context_length(name):
    m = BUILDERS[name]()
    assert [n for n, _ in m.named_buffers()] == []
    assert all(not k.endswith('mask') for k in m.state_dict())


def test_long_context_costs_nothing_at_construction():
    m = MultiHeadAttention(d_in=64, d_out=64, context_length=131072, num_heads=4)
    assert list(m.buffers()) == []
    assert sum(p.numel() for p in m.parameters()) == 4 * 64 * 64 + 64


@pytest.mark.parametrize('name', ['CausalAttention', 'MultiHeadAttention'])
def test_book_checkpoint_with_mask_loads_strictly(name):
    torch.manual_seed(0)
    src = BUILDERS[name]()
    checkpoint = {**src.state_dict(), 'mask': torch.ones(64, 64).triu(1)}
    m = BUILDERS[name]()
    m.load_state_dict(checkpoint, strict=True)
    assert 'mask' in checkpoint                          # the caller's dict is left as it was
    x = torch.randn(1, 5, 16)
    assert torch.equal(m(x), src(x))
    with pytest.raises(RuntimeError, match='Unexpected key'):
        m.load_state_dict({**checkpoint, 'other': torch.zeros(1)}, strict=True)  # other extras still fail


def test_causal_allowed():
    assert causal_allowed(3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert causal_allowed(0).shape == (0, 0)
    assert causal_allowed(2, num_keys=4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_old_mask_names_warn_and_keep_their_polarity():
    "causal_mask and window_mask (True = hidden) still answer, and say what replaced them."
    from selfattn_nbdev import causal_mask, window_allowed, window_mask
    with pytest.warns(FutureWarning, match='causal_allowed'):
        assert torch.equal(causal_mask(4, num_keys=6), ~causal_allowed(4, num_keys=6))
    with pytest.warns(FutureWarning, match='window_allowed'):
        assert torch.equal(window_mask(4, 2, num_keys=6), ~window_allowed(4, 2, num_keys=6))


def test_future_mask_is_refused_by_name():
    "A module given a future_mask (True = hidden) would attend to the future: refused, never ignored."
    ca = CausalAttention(3, 2, context_length=6)
    with pytest.raises(TypeError, match='now `allowed`'):
        ca.future_mask = lambda T, device=None: torch.ones(T, T, dtype=torch.bool).triu(1)
    with pytest.raises(TypeError, match='now `allowed`'):
        class Old(CausalAttention):
            def future_mask(self, num_tokens, device=None): return None
    assert not hasattr(ca, 'future_mask')
    class Banded(CausalAttention):  # the new hook: True = attend
        def allowed(self, num_tokens, device=None):
            return causal_allowed(num_tokens, device) & torch.ones(num_tokens, num_tokens, dtype=torch.bool).triu(-1)
    torch.manual_seed(0)
    _, w = Banded(3, 2, context_length=6)(torch.randn(6, 3), return_attn_weights=True)
    assert ((w > 0).sum(-1) == torch.tensor([1, 2, 2, 2, 2, 2])).all()


def test_a_document_that_comes_back_goes_on_where_it_stopped():
    """Equal ids are one document for the mask, so its positions go on across the other document between its two
    parts (they started again at 0, which matched neither reading): packed, its tokens equal the document joined,
    on both models, short and past the length where the CPU runs path starts."""
    from selfattn_nbdev.masks import document_positions
    from selfattn_nbdev.models import Llama
    from selfattn_nbdev import TinyGPT
    torch.manual_seed(0)
    ids = torch.randint(0, 4, (3, 37))
    brute = [[int((row[:t] == row[t]).sum()) for t in range(len(row))] for row in ids]
    assert document_positions(ids).tolist() == brute
    for model in (Llama(50, 2048, 32, 4, 1, num_kv_heads=2, d_hidden=64), TinyGPT(50, 2048, 32, 4, 1)):
        model = model.double().eval()
        for n in (4, 600):
            x = torch.randint(0, 50, (1, 3 * n))
            documents = torch.tensor([[0] * n + [1] * n + [0] * n])
            with torch.no_grad():
                packed = model(x, document_ids=documents)
                joined = model(torch.cat([x[:, :n], x[:, 2 * n:]], 1))
                middle = model(x[:, n:2 * n])
            assert (packed[0, 2 * n:] - joined[0, n:]).abs().max() < 1e-10
            assert (packed[0, n:2 * n] - middle[0]).abs().max() < 1e-10
