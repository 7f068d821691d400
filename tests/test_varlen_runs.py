"""Packed documents and padding on varlen flash attention, and training without padding (`unpad`).

varlen flash attention runs on CUDA only: here its logic runs on the CPU, and so does its CPU form (SDPA run by run). `varlen_runs` against the predicate it
replaces, `varlen_attend` with a stand-in kernel (SDPA on each run, in either of varlen_attn's signatures) against
the dense mask, the model's route to it (once per forward, FlexAttention for a document in two runs), and `unpad`'s
loss and gradients against the padded batch's. tests/test_cuda.py runs the real kernel on a GPU."""
import pytest
import torch
import torch.nn.functional as F

import selfattn_nbdev.kernels as kernels
from selfattn_nbdev.generation import TinyGPT
from selfattn_nbdev.masks import (and_masks, causal, dense_mask, documents,
                                  key_padding, sliding_window)
from selfattn_nbdev.kernels import unpad, varlen_attend, varlen_runs
from selfattn_nbdev.pretrained import Gemma, Llama
from selfattn_nbdev.llama_attention import LlamaAttention

from test_mask_paths import _fake_varlen


def _random_batch(seed, b=3, T=30, padded=True, docs=True):
    "Right padding of random lengths (a row may be all padding) and documents as runs of random lengths."
    g = torch.Generator().manual_seed(seed)
    pad = torch.arange(T) >= torch.randint(0, T + 1, (b, 1), generator=g) if padded else None
    ids = torch.randint(0, 4, (b, T), generator=g).sort(-1).values * 7 if docs else None  # runs, gaps in ids
    return pad, ids


def _runs_mask(runs, b, T):
    "Which real token pairs share a run, as a dense (b, T, T) mask, from cu_seqlens alone."
    n = int(runs.cu_seqlens[-1])
    run_of = torch.repeat_interleave(torch.arange(len(runs.cu_seqlens) - 1), runs.cu_seqlens.diff().long())
    real = torch.ones(b, T, dtype=torch.bool) if runs.real is None else runs.real
    where = torch.full((b, T), -1, dtype=torch.long)
    where[real] = run_of if n else where[real]
    same = (where[:, :, None] == where[:, None, :]) & (where[:, :, None] >= 0)
    return same


@pytest.mark.parametrize('seed', range(12))
@pytest.mark.parametrize('padded,docs', [(True, False), (False, True), (True, True)])
def test_runs_are_the_predicate(seed, padded, docs):
    "Two real tokens share a run exactly when the padding and documents predicate lets them see each other."
    b, T = 3, 30
    pad, ids = _random_batch(seed, b, T, padded, docs)
    runs = varlen_runs(pad, ids)
    mods = ([key_padding(pad)] if padded else []) + ([documents(ids)] if docs else [])
    allowed = dense_mask(and_masks(*mods), T, batch=b)[:, 0]                  # (b, T, T): key is real, same doc
    real = torch.ones(b, T, dtype=torch.bool) if pad is None else ~pad
    allowed = allowed & real[:, :, None]                                       # real queries only
    assert torch.equal(_runs_mask(runs, b, T), allowed)
    lengths = runs.cu_seqlens.diff()
    assert runs.cu_seqlens.dtype == torch.int32 and int(runs.cu_seqlens[-1]) == int(real.sum())
    assert runs.longest == (int(lengths.max()) if len(lengths) else 0) and (lengths > 0).all()


class CountWaits(torch.overrides.TorchFunctionMode):
    "Counts the calls that bring a value from the device to the host (a CUDA GPU's queue drains at each)."
    WAITS = {torch.Tensor.nonzero, torch.nonzero, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.masked_select, torch.Tensor.masked_select}

    def __init__(self):
        super().__init__(); self.waits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        boolean_index = func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) and (
            args[1].dtype == torch.bool)
        self.waits += func in self.WAITS or boolean_index
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('padded,docs,waits', [(False, True, 1), (True, False, 2), (True, True, 2)])
def test_the_host_waits_once_for_documents_and_once_more_for_padding(padded, docs, waits):
    pad, ids = _random_batch(3, 4, 64, padded, docs)
    with CountWaits() as counted: runs = varlen_runs(pad, ids)
    assert runs is not None and counted.waits == waits


def test_edge_cases_of_the_runs():
    "All padding: no run; the same document id in two rows: two runs; int32 ids; one token per run."
    empty = varlen_runs(torch.ones(2, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.long))
    assert empty.cu_seqlens.tolist() == [0] and empty.longest == 0
    two_rows = varlen_runs(None, torch.zeros(2, 3, dtype=torch.int32))
    assert two_rows.cu_seqlens.tolist() == [0, 3, 6] and two_rows.longest == 3
    singles = varlen_runs(None, torch.arange(6).reshape(1, 6))
    assert singles.cu_seqlens.tolist() == list(range(7)) and singles.longest == 1
    pad = torch.tensor([[False, False, True, True], [False, True, True, True]])
    back = torch.tensor([[5, 6, 5, 5], [1, 1, 1, 1]])  # 5 comes back only where it is padding: one run each
    assert varlen_runs(pad, back).cu_seqlens.tolist() == [0, 1, 2, 3]
    assert varlen_runs(None, back) is None               # unpadded, 5 comes back after 6
    negative = varlen_runs(None, torch.tensor([[-3, -3, 2, 2, -1]]))
    assert negative.cu_seqlens.tolist() == [0, 2, 4, 5]


@pytest.mark.parametrize('ids_shape', [(2, 5), (3, 4), (4,), (1, 4)])
def test_padding_and_documents_of_different_shapes_are_refused(ids_shape):
    with pytest.raises(ValueError, match=r'one shape; got shapes'):
        varlen_runs(torch.zeros(2, 4, dtype=torch.bool), torch.zeros(ids_shape, dtype=torch.long))


def test_a_document_in_two_runs_has_no_varlen_runs():
    ids = torch.tensor([[0, 0, 1, 1, 0], [2, 2, 2, 3, 3]])
    assert varlen_runs(None, ids) is None
    with pytest.raises(ValueError, match='one run of tokens'):
        varlen_attend(*torch.randn(3, 2, 2, 5, 4).unbind(0), None, True, ids)
    # the same id in two rows is two documents: that is fine
    assert varlen_runs(None, torch.tensor([[0, 0, 1], [0, 1, 1]])).cu_seqlens.tolist() == [0, 2, 3, 4, 6]


@pytest.mark.parametrize('new_api', [True, False], ids=['window_size', 'is_causal'])
@pytest.mark.parametrize('is_causal', [True, False], ids=['causal', 'bidirectional'])
@pytest.mark.parametrize('padded', [True, False], ids=['padded', 'unpadded'])
def test_varlen_documents_on_cpu(monkeypatch, new_api, is_causal, padded):
    "Documents (and padding) through varlen_attend's packing, the kernel faked, against the dense mask."
    monkeypatch.setattr(kernels, '_varlen_kernel', lambda device: _fake_varlen(new_api))
    b, T = 3, 30
    pad, ids = _random_batch(5, b, T, padded, True)
    pad = None if pad is None else pad & (torch.arange(T) > 0)               # every row keeps a token
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, 4, T, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ours = varlen_attend(q, k, v, pad, is_causal, ids)
    mods = ([causal] if is_causal else []) + [documents(ids)] + ([key_padding(pad)] if padded else [])
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=dense_mask(and_masks(*mods), T, batch=b))
    real = torch.ones(b, 1, T, 1, dtype=torch.bool) if pad is None else ~pad[:, None, :, None]
    assert (ours - ref).masked_fill(~real, 0).abs().max() < 1e-12
    assert (ours.masked_fill(real, 0) == 0).all()


def _varlen_everywhere(monkeypatch):
    "Make the CPU take the varlen route (pick_kernel as on CUDA in half precision) with the stand-in kernel."
    monkeypatch.setattr(kernels, '_varlen_kernel', lambda device: _fake_varlen(True))
    real_pick = kernels.pick_kernel
    def pick(device_type, masked, T, S, needs_grad, dropout, runs_only=False, half=False, scored=False, mode=None):
        if masked and runs_only and not dropout and not scored: return 'varlen'
        return real_pick(device_type, masked, T, S, needs_grad, dropout, runs_only, half, scored, mode)
    monkeypatch.setattr(kernels, 'pick_kernel', pick)
    found = []
    monkeypatch.setattr(kernels, 'varlen_runs', lambda *a: found.append(1) or varlen_runs(*a))
    return found


def test_a_model_finds_the_runs_once_per_forward(monkeypatch):
    "TinyGPT's 3 blocks share one varlen_runs per forward; logits and gradients equal the dense mask's."
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=16, context_length=12, d_model=16, num_heads=2, num_layers=3).double()
    tokens = torch.randint(0, 16, (2, 30))
    ids = torch.tensor([[0] * 12 + [1] * 10 + [2] * 8, [4] * 7 + [5] * 12 + [6] * 11])
    dense = model(tokens, document_ids=ids)                       # the CPU's own route: the dense mask
    grad_dense = torch.autograd.grad(dense.square().sum(), model.token_emb.weight)[0]
    found = _varlen_everywhere(monkeypatch)
    ours = model(tokens, document_ids=ids)
    assert len(found) == 1
    grad = torch.autograd.grad(ours.square().sum(), model.token_emb.weight)[0]
    assert (ours - dense).abs().max() < 1e-12 and (grad - grad_dense).abs().max() < 1e-10
    model(tokens, document_ids=ids)
    assert len(found) == 2                                        # a new forward, a new search


def test_a_document_in_two_runs_takes_flexattention(monkeypatch):
    torch.manual_seed(0)
    m = TinyGPT(vocab_size=16, context_length=30, d_model=16, num_heads=2, num_layers=2).double()
    tokens = torch.randint(0, 16, (1, 12))
    ids = torch.tensor([[0] * 4 + [1] * 4 + [0] * 4])             # document 0 comes back
    with torch.no_grad():
        expected = m(tokens, document_ids=ids)
        _varlen_everywhere(monkeypatch)
        assert (m(tokens, document_ids=ids) - expected).abs().max() < 1e-12


def test_packed_rows_may_be_longer_than_the_context_but_not_a_document():
    m = TinyGPT(vocab_size=16, context_length=8, d_model=16, num_heads=2, num_layers=1)
    tokens = torch.randint(0, 16, (1, 20))
    assert m(tokens, document_ids=torch.arange(20)[None] // 5).shape == (1, 20, 16)
    with pytest.raises(ValueError, match='longest document has 10 tokens.*context_length=8'):
        m(tokens, document_ids=torch.arange(20)[None] // 10)
    with pytest.raises(ValueError, match='more than context_length=8'):
        m(tokens)
    with pytest.raises(ValueError, match='document_ids cannot be combined with caches'):
        m(tokens[:, :4], m.new_caches(), document_ids=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize('family', ['tinygpt', 'llama'])
def test_unpad_gives_the_padded_batch_loss_and_gradients(family):
    "A right-padded batch and its unpadded row: the same loss, the same gradients, the same logits at real tokens."
    torch.manual_seed(0)
    if family == 'tinygpt': model = TinyGPT(32, 16, d_model=16, num_heads=2, num_layers=2)
    else: model = Llama(32, 16, d_model=16, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=24)
    model = model.double()
    lengths = torch.tensor([16, 3, 11, 1])
    pad = torch.arange(16) >= lengths[:, None]
    tokens, targets = torch.randint(0, 32, (2, 4, 16)).unbind(0)
    real = ~pad
    padded_logits = model(tokens)
    padded = F.cross_entropy(padded_logits[real], targets[real])
    g_padded = torch.autograd.grad(padded, list(model.parameters()))
    row = unpad(tokens, pad)
    assert row.token_ids.shape == (1, 31) and row.document_ids[0].tolist() == [0] * 16 + [1] * 3 + [2] * 11 + [3]
    assert row.positions[0, 16:19].tolist() == [0, 1, 2]
    logits = model(row.token_ids, document_ids=row.document_ids)   # 31 tokens: more than the context of 16
    packed = F.cross_entropy(logits[0], row.pack(targets)[0])
    g_packed = torch.autograd.grad(packed, list(model.parameters()))
    assert abs(packed.item() - padded.item()) < 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(g_packed, g_padded)) < 1e-12
    back = row.unpack(logits, fill=float('nan'))                    # (4, 16, 32)
    assert torch.equal(back.isnan().all(-1), pad)
    assert (back[real] - padded_logits[real]).abs().max() < 1e-12


def test_unpad_errors_name_the_argument():
    tokens = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match='key_padding_mask must be a bool tensor shaped like token_ids'):
        unpad(tokens, torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r'key_padding_mask must be .*got torch.bool \(2, 4\)'):
        unpad(tokens, torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match='token_ids must be an int64 or int32 tensor'):
        unpad(tokens.float(), torch.zeros(2, 5, dtype=torch.bool))


def test_the_cpu_attends_run_by_run_with_a_backward():
    """On a CPU, from RUNS_MIN_TOKENS tokens, padding and documents go to SDPA run by run (no dense mask over the
    packed row): an unpadded batch of 1,200 tokens gives the padded batch's loss and gradients; past RUNS_MAX runs,
    the dense mask again."""
    torch.manual_seed(0)
    _padded_equals_unpadded_run_by_run(TinyGPT(32, 512, d_model=16, num_heads=2, num_layers=2))
    assert kernels.pick_kernel('cpu', True, 1200, 1200, True, 0.0, runs_only=True) == 'varlen'
    many = torch.arange(1100)[None] // 4                                   # 275 documents of 4 tokens
    assert len(varlen_runs(None, many).cu_seqlens) - 1 > kernels.RUNS_MAX
    m = kernels.MultiHeadAttention(8, 8, 1100, num_heads=2).double()
    x = torch.randn(1, 1100, 8, dtype=torch.float64)
    with torch.no_grad():
        alone = torch.cat([m(part) for part in x.split(4, dim=1)], dim=1)
        assert (m(x, document_ids=many) - alone).abs().max() < 1e-12


@pytest.mark.parametrize('is_causal', [True, False], ids=['causal', 'bidirectional'])
@pytest.mark.parametrize('padded', [True, False], ids=['padded', 'unpadded'])
def test_the_cpu_kernel_itself(is_causal, padded):
    "varlen_attend with its own CPU kernel (SDPA run by run), grouped heads, forward and backward, against the dense mask."
    b, T = 3, 30
    pad, ids = _random_batch(7, b, T, padded, True)
    pad = None if pad is None else pad & (torch.arange(T) > 0)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, 4, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, 2, T, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mods = ([causal] if is_causal else []) + [documents(ids)] + ([key_padding(pad)] if padded else [])
    real = torch.ones(b, 1, T, 1, dtype=torch.bool) if pad is None else ~pad[:, None, :, None]
    ours = varlen_attend(q, k, v, pad, is_causal, ids).masked_fill(~real, 0)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=dense_mask(and_masks(*mods), T, batch=b)).masked_fill(~real, 0)
    assert (ours - ref).abs().max() < 1e-12
    w = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((out * w).sum(), (q, k, v)) for out in (ours, ref)]
    assert max((a - c).abs().max().item() for a, c in zip(*grads)) < 1e-12


@pytest.mark.parametrize('window', [1, 3, 8, 64])
def test_the_cpu_kernel_with_a_window(window):
    "A window goes run by run too, as flash attention's window_size (W - 1, 0): forward and backward against the dense mask."
    b, T = 3, 30
    _, ids = _random_batch(11, b, T, padded=False)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, 4, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, 2, T, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ours = varlen_attend(q, k, v, None, True, ids, window=window)
    allowed = dense_mask(and_masks(sliding_window(window), documents(ids)), T, batch=b)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed)
    assert (ours - ref).abs().max() < 1e-12
    w = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((out * w).sum(), (q, k, v)) for out in (ours, ref)]
    assert max((a - c).abs().max().item() for a, c in zip(*grads)) < 1e-12




@pytest.mark.parametrize('family', ['llama window', 'gemma softcap'])
def test_unpadded_training_with_a_window_or_a_cap_goes_run_by_run(family):
    """A window, a soft cap and local/global blocks, unpadded on a CPU: each document alone (no n x n mask over the
    packed row), the padded batch's loss and gradients."""
    torch.manual_seed(0)
    if family == 'llama window':
        model = Llama(32, 512, d_model=16, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=24, window=40)
    else:
        model = Gemma(32, 512, d_model=16, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=24, head_dim=8,
                      window=40, layer_types=['sliding_attention', 'full_attention'], softcap=20.0,
                      final_softcap=30.0, qk_norm=True)
    _padded_equals_unpadded_run_by_run(model)


def test_sinks_go_run_by_run_as_each_document_alone():
    torch.manual_seed(0)
    m = LlamaAttention(16, 1100, num_heads=4, num_kv_heads=2, sinks=True, window=50).double()
    with torch.no_grad(): m.sinks.normal_()
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([400, 3, 300, 97, 300]))[None]
    x = torch.randn(1, 1100, 16, dtype=torch.float64)
    with torch.no_grad():
        alone = torch.cat([m(part) for part in x.split([400, 3, 300, 97, 300], dim=1)], dim=1)
        assert (m(x, document_ids=ids) - alone).abs().max() < 1e-12


def _padded_equals_unpadded_run_by_run(model):
    """Three right-padded rows of 512 (1,200 real tokens), in float64: the unpadded row takes SDPA (or the explicit
    path) run by run in both blocks, and gives the padded batch's loss and gradients."""
    model = model.double()
    pad = torch.arange(512) >= torch.tensor([512, 300, 388])[:, None]
    tokens, targets = torch.randint(0, 32, (2, 3, 512)).unbind(0)
    padded = F.cross_entropy(model(tokens)[~pad], targets[~pad])
    g_padded = torch.autograd.grad(padded, list(model.parameters()))
    row = unpad(tokens, pad)
    assert row.token_ids.shape[1] >= kernels.RUNS_MIN_TOKENS
    picked, runs, real_pick, real_by_run = [], [], kernels.pick_kernel, kernels._by_run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, 'pick_kernel', lambda *a, **kw: picked.append(real_pick(*a, **kw)) or picked[-1])
        mp.setattr(kernels, '_by_run', lambda *a: runs.append(1) or real_by_run(*a))
        packed = F.cross_entropy(model(row.token_ids, document_ids=row.document_ids)[0], row.pack(targets)[0])
    assert picked.count('varlen') == 2 and len(runs) == 2, picked   # both blocks, run by run
    g_packed = torch.autograd.grad(packed, list(model.parameters()))
    assert abs(packed.item() - padded.item()) < 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(g_packed, g_padded)) < 1e-12


def _route(m, x, **kw):
    "Which way a module's masked attention went: 'runs', 'flex' (not run here), 'tiled' (sinks, by L) or 'dense'."
    went, real_by_run, real_sunk = [], kernels._by_run, LlamaAttention._attend_sunk
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, '_by_run', lambda *a: went.append('runs') or real_by_run(*a))
        mp.setattr(LlamaAttention, '_attend_sunk',
                   lambda self, *a, **k: went.append('tiled') or real_sunk(self, *a, **k))
        mp.setattr(kernels, '_attend_flex',
                   lambda m, q, *a, **k: went.append('flex') or torch.zeros_like(q))
        m(x, **kw)
    return went[0] if went else 'dense'


def test_a_window_goes_run_by_run_only_where_flex_would_not_run():
    """Run by run, a window costs each document's whole square; compiled Flex skips the tiles outside the window
    (8,192 tokens in 2 documents, window 256, inference: 0.83 s by run, 0.25 s Flex, on 2 CPU cores). So a window goes
    by run where the dense mask would have been chosen: a backward on a CPU, texts shorter than FLEX_MIN_TOKENS, or
    Flex turned off."""
    m = kernels.MultiHeadAttention(8, 8, 4096, num_heads=2, window=8)
    ids = torch.repeat_interleave(torch.arange(2), 2048)[None]
    long, short = torch.randn(1, 4096, 8), torch.randn(1, 2048, 8)
    with torch.no_grad():
        assert _route(m, long, document_ids=ids) == 'flex'                       # inference: Flex
        with kernels.flex_mode('off'): assert _route(m, long, document_ids=ids) == 'runs'
        assert _route(m, short, document_ids=ids[:, :2048]) == 'runs'
        ends = torch.arange(2048) < 100                                         # padding at the start: runs
        assert _route(m, short, document_ids=ids[:, :2048], key_padding_mask=ends[None]) == 'runs'
        split = (torch.arange(2048) // 100) == 3                               # padding inside a row moves
        assert _route(m, short, key_padding_mask=split[None]) == 'dense'       # the distances: the dense mask
    assert _route(m, long.requires_grad_(), document_ids=ids) == 'runs'          # a backward: no CPU Flex
    assert not kernels._cuts_into_runs(None, None, None, short[:, None])           # no padding, no documents


def test_gapless_is_padding_at_the_ends_of_each_row_only():
    T = torch.arange(10)
    for pad, expected in [(T < 3, True), (T >= 7, True), ((T < 2) | (T >= 8), True), (T < 10, True),
                          (T < 0, True), ((T >= 4) & (T < 6), False), (T % 3 == 1, False)]:
        assert kernels._gapless(torch.stack([T >= 5, pad])) is expected, pad   # row 0 is gapless


@pytest.mark.parametrize('kind', ['window', 'softcap', 'sinks'])
def test_a_padded_window_goes_run_by_run_as_each_row_alone(kind):
    """Padding at the ends of a row keeps the distances a window measures, so its real tokens go run by run (not one
    dense mask over the padded rows): each row's output and gradients are those of its real tokens alone."""
    torch.manual_seed(0)
    extra = dict(softcap=dict(softcap=20.0), sinks=dict(sinks=True)).get(kind, {})
    m = LlamaAttention(16, 1100, num_heads=4, num_kv_heads=2, window=50, **extra).double()
    if kind == 'sinks':
        with torch.no_grad(): m.sinks.normal_()
    T = torch.arange(1100)
    pad = torch.stack([T >= 1100, T >= 700, T < 300, (T < 10) | (T >= 1000)])          # none, right, left, both
    x = torch.randn(4, 1100, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 1100, 16, dtype=torch.float64)
    assert _route(m, x, key_padding_mask=pad) == ('tiled' if kind == 'sinks' else 'runs')  # sinks: by their L
    out = m(x, key_padding_mask=pad)
    (grad,) = torch.autograd.grad((out * w)[~pad].sum(), x)
    for row in range(4):
        real = ~pad[row]
        alone = m(x[row, real][None])[0]
        (grad_alone,) = torch.autograd.grad((alone * w[row, real]).sum(), x)
        assert (out[row, real] - alone).abs().max() < 1e-12
        assert (grad[row] - grad_alone[row]).abs().max() < 1e-12


@pytest.mark.slow  # compiles a forward and a backward at 1,100 tokens
def test_a_padded_window_in_a_whole_compiled_graph_keeps_the_dense_mask():
    """Runs need the host to read the padding (is it at the ends of each row?), which a graph compiled with
    fullgraph=True cannot do: there a padded window keeps the dense mask, as before, and equals eager on real tokens."""
    torch.manual_seed(0)
    m = kernels.MultiHeadAttention(16, 16, 1100, num_heads=2, window=64)
    x = torch.randn(2, 1100, 16, requires_grad=True)
    pad = torch.arange(1100) >= torch.tensor([[1100], [900]])
    torch._dynamo.reset()
    out = torch.compile(m, fullgraph=True)(x, key_padding_mask=pad)
    (grad,) = torch.autograd.grad(out[~pad].sum(), x)
    eager = m(x, key_padding_mask=pad)
    (eager_grad,) = torch.autograd.grad(eager[~pad].sum(), x)
    assert (out - eager)[~pad].abs().max() < 1e-5 and (grad - eager_grad).abs().max() < 1e-5


def test_runs_go_one_call_each_only_where_the_calls_pay():
    """A call per run costs 0.3 to 0.5 ms on a CPU (forward and backward); the dense mask costs n². Measured on 2 cores
    (d 64 and 256, with and without a window): at 1,100 tokens 32 runs were 0.6-1.07x the dense mask's time and 128
    runs 1.1-2.8x; at 4,096 tokens 255 runs were 0.3-0.83x. So at most n² / RUN_WORTH runs go by run, and never more
    than RUNS_MAX (exactly RUNS_MAX do: it is a count of runs)."""
    def few(n, count): return kernels._cpu_runs(None, (torch.arange(n) * count // n)[None], None) is not None
    assert few(4096, kernels.RUNS_MAX) and not few(4096, kernels.RUNS_MAX + 1)
    most = 1100 * 1100 // kernels.RUN_WORTH                                            # 73
    assert few(1100, most) and not few(1100, most + 1)


def test_varlen_attend_checks_its_window_as_a_module_does():
    q = torch.randn(1, 2, 8, 4)
    ids = torch.zeros(1, 8, dtype=torch.long)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match='window must be a positive integer'):
            varlen_attend(q, q, q, None, True, ids, window=bad)
    with pytest.raises(ValueError, match='window=3 needs causal=True'):
        varlen_attend(q, q, q, None, False, ids, window=3)


def test_sinks_with_a_window_in_documents_take_the_tiled_kernel():
    "Sinks are no score function, so Flex never takes them: a long window in documents goes tiled (L), not n x n."
    torch.manual_seed(0)
    m = LlamaAttention(16, 4096, num_heads=2, sinks=True, window=16).double().eval()
    capped = LlamaAttention(16, 4096, num_heads=2, softcap=20.0, window=16).double().eval()
    ids = torch.repeat_interleave(torch.arange(2), 2048)[None]
    x = torch.randn(1, 4096, 16, dtype=torch.float64)
    with torch.no_grad():
        assert _route(m, x, document_ids=ids) == 'tiled'
        assert _route(capped, x, document_ids=ids) == 'flex'                     # a soft cap alone: Flex's score_mod
        alone = torch.cat([m(part) for part in x.split(2048, dim=1)], dim=1)
        assert (m(x, document_ids=ids) - alone).abs().max() < 1e-12
