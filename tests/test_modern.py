"""Grouped-query heads, sliding windows and rotary positions in MultiHeadAttention: each against an independent
reference written out here, each with the KV cache, all three together, and with the defaults unchanged."""
import itertools, math

import pytest
import torch
import torch.nn.functional as F

from selfattn_nbdev import KVCache, MultiHeadAttention, leaks_future
from selfattn_nbdev.gqa_window_rope import apply_rope, repeat_kv, rope_angles, window_allowed

TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def reference(m: MultiHeadAttention, x, key_padding_mask=None):
    """Everything written out from the definitions, one head at a time, in plain loops over heads:
    RoPE as complex multiplication, keys/values of head h from kv head h // group, the banded mask."""
    b, T, _ = x.shape
    hd, group = m.head_dim, m.num_heads // m.num_kv_heads
    q = m.W_query(x).view(b, T, m.num_heads, hd).transpose(1, 2)
    k = m.W_key(x).view(b, T, m.num_kv_heads, hd).transpose(1, 2)
    v = m.W_value(x).view(b, T, m.num_kv_heads, hd).transpose(1, 2)
    if m.rope:
        theta = m.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)      # (hd/2,)
        turn = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64),
                           torch.arange(T, dtype=torch.float64)[:, None] * theta)      # e^{i m theta}
        def rotate(t):
            z = torch.complex(t[..., :hd // 2].double(), t[..., hd // 2:].double()) * turn
            return torch.cat([z.real, z.imag], -1).to(t.dtype)
        q, k = rotate(q), rotate(k)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    allowed = torch.ones(T, T, dtype=torch.bool)
    if m.causal: allowed &= j <= i
    if m.window is not None: allowed &= j > i - m.window
    outs = []
    for h in range(m.num_heads):
        scores = q[:, h] @ k[:, h // group].transpose(1, 2) / math.sqrt(hd)           # (b, T, T)
        mask = allowed[None].expand(b, T, T)
        if key_padding_mask is not None: mask = mask & ~key_padding_mask[:, None, :]
        weights = torch.softmax(scores.masked_fill(~mask, -torch.inf), -1).nan_to_num(0.0)
        outs.append(weights @ v[:, h // group])
    return m.out_proj(torch.cat(outs, -1))


OPTIONS = [dict(num_kv_heads=kv, window=w, rope=r)
           for kv, w, r in itertools.product([None, 2, 1], [None, 1, 3], [False, True])]
name = lambda o: '-'.join(f'{k}={v}' for k, v in o.items())


@pytest.mark.no_cover  # 36 and 18 combinations: slow under coverage's tracer; the tests below cover the lines
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('opts', OPTIONS, ids=name)
def test_both_paths_equal_the_reference(opts, dtype):
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 16, 32, num_heads=4, **opts).to(dtype).eval()
    x = torch.randn(2, 11, 16, dtype=dtype)
    pad = torch.zeros(2, 11, dtype=torch.bool); pad[1, 8:] = True; pad[0, 0] = True
    with torch.no_grad():
        for mask in [None, pad]:
            want = reference(m, x, mask)
            fused = m(x, key_padding_mask=mask)
            explicit, weights = m(x, key_padding_mask=mask, return_attn_weights=True)
            assert (fused - want).abs().max() <= TOL[dtype]
            assert (explicit - want).abs().max() <= TOL[dtype]
            assert weights.shape == (2, 4, 11, 11)


@pytest.mark.no_cover  # 36 and 18 combinations: slow under coverage's tracer; the tests below cover the lines
@pytest.mark.parametrize('opts', OPTIONS, ids=name)
def test_cache_reproduces_the_full_forward(opts):
    torch.manual_seed(1)
    m = MultiHeadAttention(16, 16, 64, num_heads=4, **opts).double().eval()
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    with torch.no_grad():
        full, full_weights = m(x, return_attn_weights=True)
        for explicit in [False, True]:
            cache, seen = KVCache(), 0
            for size in [1, 3, 5, 1, 1, 7, 2, 1, 1, 10, 8]:
                out = m(x[:, seen:seen + size], cache=cache, return_attn_weights=explicit)
                out = out[0] if explicit else out
                assert (out - full[:, seen:seen + size]).abs().max() <= 1e-12
                seen += size
                assert cache.num_seen == seen
                if opts['window'] is not None: assert len(cache) <= opts['window'] - 1
                else: assert len(cache) == seen
            assert seen == 40


def test_sliding_window_cache_stays_flat():
    "However long the generation, a windowed cache holds window - 1 tokens in storage of 2 x window."
    torch.manual_seed(0)
    window = 8
    m = MultiHeadAttention(8, 8, 1000, num_heads=2, window=window).eval()
    cache, sizes = KVCache(), set()
    with torch.no_grad():
        for t in range(600):
            m(torch.randn(1, 1, 8), cache=cache)
            if t > 50: sizes.add((len(cache), cache._keys.shape[2]))
    assert sizes == {(window - 1, 2 * window)}


def test_grouped_query_equals_repeated_heads_and_sdpa_gqa():
    torch.manual_seed(0)
    gqa = MultiHeadAttention(16, 16, 20, num_heads=4, num_kv_heads=2).double().eval()
    mha = MultiHeadAttention(16, 16, 20, num_heads=4).double().eval()
    state = gqa.state_dict()
    for n in ['W_key.weight', 'W_value.weight']:  # (kv_heads * hd, d_in): each kv head serves 2 heads
        state[n] = state[n].view(2, 4, 16).repeat_interleave(2, dim=0).reshape(16, 16)
    mha.load_state_dict(state)
    x = torch.randn(3, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), atol=1e-12, rtol=0)
        q = gqa.W_query(x).view(3, 12, 4, 4).transpose(1, 2)
        k = gqa.W_key(x).view(3, 12, 2, 4).transpose(1, 2)
        v = gqa.W_value(x).view(3, 12, 2, 4).transpose(1, 2)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        want = gqa.out_proj(sdpa.transpose(1, 2).reshape(3, 12, 16))
        torch.testing.assert_close(gqa(x), want, atol=1e-12, rtol=0)
    assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())


def test_rope_scores_depend_only_on_the_distance():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 10, 8, dtype=torch.float64), torch.randn(2, 3, 10, 8, dtype=torch.float64)
    positions = torch.arange(10)
    scores = apply_rope(q, positions) @ apply_rope(k, positions).transpose(-1, -2)
    for shift in [1, 7, 1000, 123_456]:
        shifted = apply_rope(q, positions + shift) @ apply_rope(k, positions + shift).transpose(-1, -2)
        assert (shifted - scores).abs().max() <= 1e-9
    # and it is a rotation: lengths do not change, position 0 is the identity
    torch.testing.assert_close(apply_rope(q, positions).norm(dim=-1), q.norm(dim=-1), atol=1e-12, rtol=0)
    torch.testing.assert_close(apply_rope(q[..., :1, :], positions[:1]), q[..., :1, :], atol=0, rtol=0)


def test_defaults_leave_the_module_as_it_was():
    torch.manual_seed(0)
    m = MultiHeadAttention(12, 12, 20, num_heads=3)
    assert {n: tuple(p.shape) for n, p in m.state_dict().items()} == {
        'W_query.weight': (12, 12), 'W_key.weight': (12, 12), 'W_value.weight': (12, 12),
        'out_proj.weight': (12, 12), 'out_proj.bias': (12,)}
    assert (m.num_kv_heads, m.window, m.rope) == (3, None, False)
    assert 'rope' not in repr(m) and 'window' not in repr(m)


@pytest.mark.parametrize('opts', [dict(window=2), dict(rope=True), dict(num_kv_heads=1),
                                  dict(num_kv_heads=2, window=3, rope=True)], ids=name)
def test_no_future_leaks(opts):
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 12, num_heads=4, **opts).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    assert not any(leaks_future(m, x, t) for t in range(8))
    explicit = lambda inputs: m(inputs, return_attn_weights=True)[0]
    assert not any(leaks_future(explicit, x, t) for t in range(8))


def test_window_allowed_is_the_band():
    for T, keys, w in [(5, 5, 1), (5, 5, 2), (6, 6, 10), (3, 9, 4)]:
        i, j = torch.arange(keys - T, keys)[:, None], torch.arange(keys)[None]
        assert torch.equal(window_allowed(T, w, num_keys=keys), (j <= i) & (j > i - w))
    assert torch.equal(repeat_kv(torch.arange(2.).view(1, 2, 1, 1), 3).flatten(), torch.tensor([0., 0, 0, 1, 1, 1]))


@pytest.mark.slow  # inductor compiles for 4 s: make test-slow (CI runs it)
@pytest.mark.no_cover  # coverage's tracer slows torch.compile; the eager tests cover the same lines
def test_gradients_flow_and_compile_matches_eager():
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 16, num_heads=4, num_kv_heads=2, window=4, rope=True).eval()
    x = torch.randn(2, 10, 8)
    compiled = torch.compile(m)
    torch.testing.assert_close(compiled(x), m(x), atol=1e-5, rtol=1e-5)
    m(x).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


@pytest.mark.slow  # inductor compiles a training step for about 8 s
@pytest.mark.no_cover
def test_a_compiled_training_step_compiles_once():
    """The first compiled forward used to build the RoPE table and keep it on the module: the next call met a table
    the graph had not seen and compiled everything again. Inside a graph the rows it needs are made and kept nowhere."""
    from torch._dynamo.utils import counters
    from selfattn_nbdev.models import Llama
    torch._dynamo.reset(); counters.clear()
    torch.manual_seed(0)
    m = Llama(32, 64, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2)
    x = torch.randint(0, 32, (2, 16))
    step = torch.compile(m)
    for _ in range(3): step(x).sum().backward()
    assert counters['stats']['unique_graphs'] == 1, dict(counters['stats'])
    compiled_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(); m(x).sum().backward()
    assert max((a / 3 - p.grad).abs().max().item() for a, p in zip(compiled_grads, m.parameters())) < 1e-4


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(num_kv_heads=3), ValueError, 'num_kv_heads must divide num_heads'),
    (dict(num_kv_heads=0), ValueError, 'num_kv_heads must be a positive integer'),
    (dict(window=0), ValueError, 'window must be a positive integer'),
    (dict(window=2.5), ValueError, 'window must be a positive integer'),
    (dict(window=3, causal=False), ValueError, 'it needs causal=True'),
    (dict(rope=1), TypeError, 'rope must be True or False'),
    (dict(rope=True, rope_base=1), ValueError, 'rope_base must be a number greater than 1'),
    (dict(rope=True, d_out=12, num_heads=4), ValueError, 'head_dim (d_out // num_heads) must be even; got 3'),
])
def test_bad_options_are_refused_with_a_message(kwargs, error, message):
    args = dict(d_in=8, d_out=8, context_length=8, num_heads=4) | kwargs
    with pytest.raises(error, match=message.replace('(', r'\(').replace(')', r'\)')):
        MultiHeadAttention(**args)
    with pytest.raises(ValueError, match='head_dim must be even; got 3'):
        rope_angles(torch.arange(4), 3)


def test_a_models_blocks_share_one_rope_table_while_it_lives():
    """Every block's RoPE table holds the cos and sin of every position up to context_length: built once and shared
    by the blocks that need the same one (a Llama-1B-sized context of 131,072 positions took 16 copies, 1 GiB), and
    freed with the model. Gemma's sliding and global blocks have different bases, so two tables."""
    import gc
    from selfattn_nbdev import rope
    from selfattn_nbdev.generation import TinyGPT
    from selfattn_nbdev.gemma import Gemma
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    llama = Llama(37, 512, d_model=32, num_heads=4, num_layers=4, num_kv_heads=2, d_hidden=48).eval()
    gemma = Gemma(37, 512, d_model=32, num_heads=4, num_layers=4, num_kv_heads=2, d_hidden=48, head_dim=8,
                  window=4, local_rope_base=10.0, layer_types=['sliding_attention', 'full_attention'] * 2).eval()
    tiny = TinyGPT(37, 512, d_model=32, num_heads=4, num_layers=3, rope=True).eval()
    ids = torch.randint(0, 37, (1, 6))
    with torch.no_grad():
        for model, tables in ((llama, 1), (gemma, 2), (tiny, 1)):
            before = model(ids)
            kept = {b.attn._rope_cache[0].data_ptr() for b in model.blocks}
            assert len(kept) == tables
            for b in model.blocks: b.attn._rope_cache = None        # each block its own table again
            assert torch.equal(model(ids), before)
    keys = {k for k, _ in rope._TABLES.keys()}
    assert {k[0] for k in keys} >= {'rope', 'llama'}
    del llama, gemma, tiny, model, b; gc.collect()
    assert not {k for k, _ in rope._TABLES.keys()} & keys                # freed with the models


def test_a_model_hands_its_blocks_the_positions_and_each_tables_rows_once(monkeypatch):
    """A decode step finds its tokens' positions once, in the model, and hands that tensor to every block (the data
    flows one way): no block asks its cache again, and the rows of a RoPE table at those positions are gathered by the
    first block that reads that table and kept for the others (Gemma's sliding and global blocks: two tables, two
    gathers). The logits equal those of the same blocks called one by one, each finding its own positions, also for
    left-padded rows of a hybrid model, whose first cache (a linear block's) gives each row's positions as its
    attention blocks' caches do."""
    import selfattn_nbdev.deepseek_v3 as deepseek_v3, selfattn_nbdev.rope as rope
    import selfattn_nbdev.llama_attention as llama_attention
    from selfattn_nbdev.llama_attention import soft_cap
    from selfattn_nbdev.gemma import Gemma
    from selfattn_nbdev.hybrid import Qwen35
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    models = {
        'llama': (Llama(37, 64, d_model=32, num_heads=4, num_layers=3, num_kv_heads=2, d_hidden=48), 1),
        'gemma': (Gemma(37, 64, d_model=32, num_heads=4, num_layers=4, num_kv_heads=2, d_hidden=48, head_dim=8,
                        window=4, local_rope_base=10.0, layer_types=['sliding_attention', 'full_attention'] * 2), 2),
        'deepseek': (deepseek_v3.DeepSeekV3(37, 64, d_model=32, num_heads=4, num_layers=2, d_hidden=48, kv_rank=8,
                                            rope_dim=4, nope_dim=4, v_dim=8), 1),
        'qwen3.5, left-padded rows': (Qwen35(37, 64, 32, 4, 4, 2, 48, 8, linear_num_key_heads=2,
                                             linear_num_value_heads=4, linear_key_head_dim=8,
                                             linear_value_head_dim=8), 1)}
    ids, nxt, pads = torch.randint(0, 37, (2, 5)), torch.randint(0, 37, (2, 1)), torch.tensor([3, 0])
    fresh = lambda model: model.new_caches(16, pads) if isinstance(model, Qwen35) else model.new_caches()
    asked, gathered, real_rows = [], [], rope._rows_at
    def rows_at(cos, sin, positions):
        before = len(positions.__dict__.get('_rope_rows', {}))
        out = real_rows(cos, sin, positions)
        gathered.append(len(positions.__dict__['_rope_rows']) - before)    # 1: gathered, 0: kept rows read
        return out
    for module in (rope, llama_attention, deepseek_v3): monkeypatch.setattr(module, '_rows_at', rows_at)
    for name, (model, tables) in models.items():
        model.eval()
        with torch.no_grad():
            caches = fresh(model); model(ids, caches)
            kinds = {type(cache): type(cache).positions for cache in caches}
            def counting(real):
                def counted(cache, *args, **kwargs):
                    asked.append(cache); return real(cache, *args, **kwargs)
                return counted
            for kind, real in kinds.items(): monkeypatch.setattr(kind, 'positions', counting(real))
            asked.clear(); gathered.clear()
            handed = model(nxt, caches)
            assert len(asked) == 1, (name, len(asked))                         # the model's one question
            turned = sum(not getattr(b, 'linear', False) for b in model.blocks)  # Qwen3.5: 1 block in 4
            assert sum(gathered) == tables and len(gathered) == turned, (name, gathered)
            for kind, real in kinds.items(): monkeypatch.setattr(kind, 'positions', real)
            caches = fresh(model); model(ids, caches)                        # again, block by block
            x = model.token_emb(nxt)
            for block, cache in zip(model.blocks, caches): x = block(x, cache=cache)
            alone = model.head(model.norm(x))
            if getattr(model, 'final_softcap', None): alone = soft_cap(alone, model.final_softcap)
            assert torch.equal(handed, alone), name


def test_kept_rope_rows_follow_their_positions():
    "Rows kept on a positions tensor are gathered again once it is written in place (its version changes)."
    from selfattn_nbdev.gqa_window_rope import _rows_at, rope_angles
    cos, sin = rope_angles(torch.arange(16), 8)
    positions = torch.tensor([[3, 4, 5]])
    first = _rows_at(cos, sin, positions)
    assert _rows_at(cos, sin, positions)[0] is first[0]                   # kept
    positions += 7
    again = _rows_at(cos, sin, positions)
    assert torch.equal(again[0], cos[positions][:, None]) and torch.equal(again[1], sin[positions][:, None])
    other = rope_angles(torch.arange(16), 8, base=100.0)
    assert torch.equal(_rows_at(*other, positions)[0], other[0][positions][:, None])  # another table: its own


def test_a_decode_step_under_inference_mode_equals_no_grad():
    """Under torch.inference_mode, where tensors keep no version counter, a decode step hands its positions and keeps
    its rows as under no_grad, with the same logits (inference mode is how many users call a model)."""
    from selfattn_nbdev.deepseek_v3 import DeepSeekV3
    from selfattn_nbdev.gemma import Gemma
    from selfattn_nbdev.generation import TinyGPT
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    models = [Llama(37, 64, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=48),
              Gemma(37, 64, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=48, head_dim=8,
                    window=4, local_rope_base=10.0, layer_types=['sliding_attention', 'full_attention']),
              DeepSeekV3(37, 64, d_model=32, num_heads=4, num_layers=2, d_hidden=48, kv_rank=8, rope_dim=4,
                         nope_dim=4, v_dim=8),
              TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2, rope=True)]
    ids, nxt = torch.randint(0, 37, (2, 5)), torch.randint(0, 37, (2, 1))
    for model in models:
        model.eval()
        out = {}
        for name, mode in (('no_grad', torch.no_grad), ('inference', torch.inference_mode)):
            with mode():
                caches = model.new_caches(); model(ids, caches)
                out[name] = (model(nxt, caches), model(nxt, caches))
        for a, b in zip(out['no_grad'], out['inference']): assert torch.equal(a, b), type(model).__name__


def test_packed_documents_positions_are_found_once_a_forward(monkeypatch):
    """With packed documents the model finds each token's position in its document once and hands it to every block,
    as with caches: document_positions runs once a forward, not once a block, and the logits are unchanged."""
    import selfattn_nbdev.kernels as kernels
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    model = Llama(37, 16, d_model=32, num_heads=4, num_layers=3, num_kv_heads=2, d_hidden=48).eval()
    ids = torch.randint(0, 37, (2, 12))
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    calls, real = [], kernels.document_positions
    def counted(document_ids):
        calls.append(1); return real(document_ids)
    with torch.no_grad():
        expected = torch.cat([model(ids[:, :5])[:1], model(ids[:1, 5:])], 1)   # row 0's documents, each alone
        monkeypatch.setattr(kernels, 'document_positions', counted)
        packed = model(ids, document_ids=documents)
    assert len(calls) == 1, len(calls)
    assert (packed[:1] - expected).abs().max() < 1e-5
