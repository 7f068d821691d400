"""A caller's `mask_mod`, `score_mod` and `scale` on every module, block and model, through the one kernel choice.

Every kernel that can take a call is forced with `attention_kernel` and compared with the explicit path (the one that
returns the weights) in float64: the forward, and the gradients of the input and of every parameter. On a CPU,
FlexAttention has no backward pass, so its forward alone is compared. A kernel that cannot take a call refuses it by
name, and the choice left to itself never sends a call there."""
import warnings

import pytest
import torch

import selfattn_nbdev  # noqa: F401  (every module, so every later version is in place)
import selfattn_nbdev.kernels as kernels
from selfattn_nbdev.masks import and_masks, causal, documents
from selfattn_nbdev.kernels import attention_kernel, pick_kernel
from selfattn_nbdev.multihead import MultiHeadAttention
from selfattn_nbdev.llama_attention import LlamaAttention
from selfattn_nbdev.tiled import alibi, alibi_slopes

B, T, D, H, KV = 2, 24, 16, 4, 2
PAD = torch.arange(T) >= torch.tensor([[T], [T - 6]])       # row 1: its last 6 tokens are padding
DOCS = torch.tensor([[0] * 10 + [1] * 14, [0] * 7 + [1] * 8 + [2] * 9])
SEEN = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) > 0.3   # a tensor a predicate reads
PREFIX = torch.tensor([5, 9])                                # each row's prefix, seen in both directions


def prefix_lm(b, h, q_idx, kv_idx): return (kv_idx <= q_idx) | (kv_idx < PREFIX[b])
def reads_a_tensor(b, h, q_idx, kv_idx): return (kv_idx <= q_idx) & (SEEN[b, kv_idx] | (kv_idx == q_idx))
def capped(score, b, h, q_idx, kv_idx): return 4.0 * torch.tanh(score / 4.0)
def identity(score, b, h, q_idx, kv_idx): return score


ALIBI = alibi(alibi_slopes(H))
FUNCTIONS = {
    'prefix-LM': dict(mask_mod=prefix_lm),
    'ALiBi': dict(score_mod=ALIBI),
    'soft cap': dict(score_mod=capped),
    'documents+padding': dict(document_ids=DOCS, key_padding_mask=PAD),
    'documents as mask_mod+padding': dict(mask_mod=and_masks(causal, documents(DOCS)), key_padding_mask=PAD),
    'a predicate reading a tensor': dict(mask_mod=reads_a_tensor),
    'prefix-LM, ALiBi, scale': dict(mask_mod=prefix_lm, score_mod=ALIBI, scale=0.3),
}
PATHS = ['dense', 'block', 'flex_eager', 'varlen', 'explicit']


def takes(path: str, name: str) -> bool:
    "Which kernel can take which call: SDPA no score function, runs only padding and documents."
    kw = FUNCTIONS[name]
    if path == 'dense': return 'score_mod' not in kw
    if path == 'varlen': return set(kw) <= {'document_ids', 'key_padding_mask'}
    return True


def module(kind: str):
    torch.manual_seed(0)
    if kind == 'mha': return MultiHeadAttention(D, D, T, num_heads=H, num_kv_heads=KV).double()
    if kind == 'llama': return LlamaAttention(D, T, H, KV).double()                 # RoPE
    if kind == 'gemma': return LlamaAttention(D, T, H, KV, query_scale=0.4, softcap=3.0).double()  # its own cap
    raise ValueError(kind)


def run(m, kw, kernel=None, grad=True):
    "Output and gradients (input, every parameter) at the real tokens; kernel None: the explicit path."
    torch.manual_seed(1)
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=grad)
    w = torch.randn(B, T, D, dtype=torch.float64)
    real = ~kw['key_padding_mask'] if 'key_padding_mask' in kw else torch.ones(B, T, dtype=torch.bool)
    with torch.set_grad_enabled(grad):
        if kernel is None: out = m(x, return_attn_weights=True, **kw)[0]
        else:
            with attention_kernel(kernel): out = m(x, **kw)
    if not grad: return [out[real]]
    params = [p for p in m.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * w)[real].sum(), [x, *params], allow_unused=True)
    return [out[real]] + [g for g in grads if g is not None]


@pytest.mark.parametrize('kind', ['mha', 'llama', 'gemma'])
@pytest.mark.parametrize('name', list(FUNCTIONS))
@pytest.mark.parametrize('path', PATHS)
def test_every_path_equals_the_explicit_path_in_float64(path, name, kind, record_property):
    m, kw = module(kind), FUNCTIONS[name]
    if not takes(path, name) or (path == 'dense' and kind == 'gemma'):   # Gemma: its own cap, always
        with pytest.raises(ValueError, match=f"attention_kernel\\('{path}'\\)"):
            run(m, kw, path)
        return
    grad = path != 'flex_eager'                       # no backward pass on a CPU
    ours, ref = run(m, kw, path, grad), run(m, kw, None, grad)
    assert len(ours) == len(ref) and len(ref) >= (1 if not grad else 5)
    worst = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    what = f"{path}{'' if grad else ' (forward)'}: {name}"    # the largest over the modules, printed at the end
    record_property('max_diff', (what, 'explicit path', worst))
    assert worst < 1e-12, (path, name, kind, worst)


@pytest.mark.parametrize('name', list(FUNCTIONS))
def test_the_choice_left_to_itself_equals_the_explicit_path(name):
    "Unforced, with gradients on a CPU: the choice takes a kernel that can take the call, and it agrees."
    for kind in ('mha', 'gemma'):
        m, kw = module(kind), FUNCTIONS[name]
        ours, ref = run(m, kw), run(m, kw, None)
        assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-12


def test_sinks_take_the_callers_mask_and_scores():
    """Sinks go through the tiled kernel and its L ('block'), with a caller's functions too, equal to the explicit path;
    a kernel asked for that has no place for one more logit ('dense') is refused by name, not passed over."""
    torch.manual_seed(0)
    m = LlamaAttention(D, T, H, KV, sinks=True, softcap=5.0).double()
    with torch.no_grad(): m.sinks.copy_(torch.tensor([-1.0, 0.0, 1.0, 3.0]))
    for name in ('prefix-LM, ALiBi, scale', 'a predicate reading a tensor', 'documents+padding'):
        kw = FUNCTIONS[name]
        with pytest.MonkeyPatch.context() as mp:
            went = []
            real = LlamaAttention._attend_sunk
            mp.setattr(LlamaAttention, '_attend_sunk', lambda self, *a, **k: went.append(1) or real(self, *a, **k))
            ours = run(m, kw, 'block')
        assert went, name
        with pytest.raises(ValueError, match=r"attention_kernel\('dense'\) cannot take this call: a sink"):
            run(m, kw, 'dense')
        ref = run(m, kw, None)
        assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-12, name


def test_a_score_function_reads_the_query_head_under_grouped_heads():
    "h is the query head on every path (keys repeated, not grouped): a score function that reads h sees 0 .. H-1."
    seen = set()
    def by_head(score, b, h, q_idx, kv_idx):
        seen.update(torch.as_tensor(h).flatten().tolist())
        return score + h
    m = module('mha')
    for path in ('block', 'explicit'):
        seen.clear(); run(m, dict(score_mod=by_head), path)
        assert seen == set(range(H)), (path, seen)


def test_scale_is_the_factor_on_the_scores():
    "scale=c gives softmax(c q·k): the module's own scale changes nothing; another equals the hand-written formula."
    m = module('llama').eval()
    x = torch.randn(B, T, D, dtype=torch.float64)
    with torch.no_grad():
        assert (m(x, scale=m._scale()) - m(x)).abs().max() < 1e-12
        q, k, v = m._project(x)
        k, v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
        c = 0.7
        scores = c * q @ k.transpose(2, 3)                                  # (b, h, T, T)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf)
        by_hand = m.out_proj(m._merge_heads(torch.softmax(scores, -1) @ v))
        assert (m(x, scale=c) - by_hand).abs().max() < 1e-12


def test_the_mask_mod_replaces_causal_and_padding_still_applies():
    "mask_mod in place of causal: no mask at all lets a query see the future; padded keys stay hidden."
    m = module('mha').eval()
    x = torch.randn(B, T, D, dtype=torch.float64)
    everything = lambda b, h, q, kv: kv >= 0
    with torch.no_grad():
        _, w = m(x, mask_mod=everything, return_attn_weights=True)
        assert (w[..., 0, 1:] > 0).all()                      # the first query sees later keys
        _, w = m(x, mask_mod=everything, key_padding_mask=PAD, return_attn_weights=True)
        assert (w[1, ..., PAD[1]] == 0).all()


def test_one_warning_for_a_large_call_on_the_explicit_path(monkeypatch):
    "A score function with dropout goes to no fused kernel: once per process, a warning names the path taken."
    monkeypatch.setattr(kernels, '_said', set())
    m = MultiHeadAttention(4, 4, 2048, num_heads=1, dropout=0.1).train()
    x = torch.randn(1, 2048, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(2): m(x, score_mod=identity)
        m.eval(); m(x[:, :64], score_mod=identity)             # small: no warning either
    said = [str(w.message) for w in caught if 'attention took' in str(w.message)]
    assert len(said) == 1 and "'explicit'" in said[0] and 'dropout' in said[0], said


def test_a_large_score_function_with_a_backward_goes_tiled(monkeypatch):
    "From BLOCK_MIN_PAIRS pairs, a score function on a CPU with a backward takes the tiled kernel, and says nothing."
    import selfattn_nbdev.mods as mods
    calls, real = [], mods.tiled_attention
    monkeypatch.setattr(mods, 'tiled_attention', lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(kernels, '_said', set())
    m = MultiHeadAttention(4, 4, 2048, num_heads=1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        m(torch.randn(1, 2048, 4), score_mod=identity)
    assert calls == [1]
    assert pick_kernel('cpu', True, 2047, 2048, True, 0.0, scored=True) == 'explicit'
    assert pick_kernel('cpu', True, 2048, 2048, True, 0.0, scored=True) == 'block'


def test_forced_kernels_refuse_by_name():
    m = module('mha')
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    for kernel, kw, words in [('dense', dict(score_mod=capped), 'score function'),
                              ('varlen', dict(mask_mod=prefix_lm), 'mask_mod'),
                              ('flex', dict(mask_mod=prefix_lm), 'backward')]:
        with attention_kernel(kernel), pytest.raises(ValueError, match=words):
            m(x, **kw)
    m.dropout.p = 0.5
    with attention_kernel('block'), pytest.raises(ValueError, match='drops no weights'):
        m.train()(x, score_mod=capped)


# ---- blocks and models: the three reach every attention module ----

def _models():
    from selfattn_nbdev.generation import TinyGPT
    from selfattn_nbdev.deepseek_v3 import DeepSeekV3
    from selfattn_nbdev.gemma import Gemma
    from selfattn_nbdev.models import GPT2, Llama
    torch.manual_seed(0)
    yield 'TinyGPT', TinyGPT(50, T, 16, 2, 2, rope=True)
    yield 'GPT2', GPT2(50, T, 16, 2, 2)
    yield 'Llama', Llama(50, T, 16, 4, 2, 2, 32)
    yield 'Gemma', Gemma(50, T, 16, 4, 2, 2, 32, 8, window=6, layer_types=['sliding_attention', 'full_attention'],
                         query_scale=0.3, softcap=20.0, final_softcap=30.0)
    yield 'DeepSeekV3', DeepSeekV3(50, T, 16, 4, 2, 32, kv_rank=8, rope_dim=4, nope_dim=4, v_dim=4)


@pytest.mark.parametrize('name', ['TinyGPT', 'GPT2', 'Llama', 'Gemma', 'DeepSeekV3'])
def test_models_hand_the_functions_to_every_block(name):
    model = dict(_models())[name].double().eval()
    ids = torch.randint(0, 50, (B, T))
    with torch.no_grad():
        plain = model(ids)
        causal_only = (model(ids, mask_mod=causal) - plain).abs().max()
        if name == 'Gemma': assert causal_only > 1e-6      # causal in place of its sliding block's window of 6
        else: assert causal_only < 1e-12                    # causal is every other model's own mask
        assert (model(ids, score_mod=identity) - plain).abs().max() < 1e-12
        prefixed = model(ids, mask_mod=prefix_lm)
        assert (prefixed[:, :5] - plain[:, :5]).abs().max() > 1e-6          # the prefix sees its future
        with attention_kernel('explicit'): explicit = model(ids, mask_mod=prefix_lm, score_mod=ALIBI)
        with attention_kernel('block'): tiled = model(ids, mask_mod=prefix_lm, score_mod=ALIBI)
        assert (explicit - tiled).abs().max() < 1e-12


def test_a_model_trains_through_a_callers_functions():
    "Gradients of a whole model (Llama) under prefix-LM with ALiBi: the tiled path equals the explicit one."
    model = dict(_models())['Llama'].double()
    ids = torch.randint(0, 50, (B, T))
    def grads(kernel):
        with attention_kernel(kernel): loss = model(ids, mask_mod=prefix_lm, score_mod=ALIBI).logsumexp(-1).sum()
        return torch.autograd.grad(loss, list(model.parameters()))
    assert max((a - b).abs().max().item() for a, b in zip(grads('block'), grads('explicit'))) < 1e-12


def test_latent_attention_takes_the_three():
    "MLA: a score function goes tiled, a mask_mod densely, scale in place of its own; all equal where they meet."
    from selfattn_nbdev.deepseek_v3 import LatentAttention
    torch.manual_seed(0)
    m = LatentAttention(16, T, 4, kv_rank=8, rope_dim=4, nope_dim=4, v_dim=4).double()
    x = torch.randn(B, T, 16, dtype=torch.float64)
    with torch.no_grad():
        plain = m(x)
        for kw in (dict(mask_mod=causal), dict(score_mod=identity), dict(scale=m.scale)):
            assert (m(x, **kw) - plain).abs().max() < 1e-12, kw
        assert (m(x, mask_mod=prefix_lm, score_mod=identity) - m(x, mask_mod=prefix_lm)).abs().max() < 1e-12
        assert (m(x, scale=2 * m.scale) - plain).abs().max() > 1e-6
    from selfattn_nbdev.generation import KVCache
    with pytest.raises(ValueError, match='mask_mod and score_mod'):
        m(x, cache=KVCache(), score_mod=identity)
    m.dropout = 0.1
    with pytest.raises(ValueError, match="attention_kernel\\('block'\\).*drops no weights"):
        m.train()(x, score_mod=identity)


def test_qwen35_takes_scores_not_masks():
    from selfattn_nbdev.hybrid import Qwen35
    torch.manual_seed(0)
    model = Qwen35(50, T, 16, 2, 4, 1, 32, 8, linear_num_key_heads=2, linear_num_value_heads=2,
                   linear_key_head_dim=8, linear_value_head_dim=8).double().eval()
    ids = torch.randint(0, 50, (1, T))
    with torch.no_grad():
        assert (model(ids, score_mod=identity) - model(ids)).abs().max() < 1e-12
        assert (model(ids, scale=0.05) - model(ids)).abs().max() > 1e-9
    with pytest.raises(ValueError, match='Qwen35 takes no mask_mod'):
        model(ids, mask_mod=prefix_lm)


@pytest.mark.slow  # compiles FlexAttention for a predicate and a score function (about 40 s on 2 cores)
def test_compiled_flex_takes_a_callers_functions_and_compiles_them_once():
    """Compiled FlexAttention (flex_mode('compiled'), on a CPU from FLEX_SHORTEST tokens) with a caller's predicate
    that reads a tensor and a score function: equal to the explicit path in float32, and a new predicate of the same
    form (a fresh closure over another tensor) reuses the compiled kernel rather than compiling again."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 32, 256, num_heads=4, num_kv_heads=2).eval()
    x = torch.randn(2, 256, 32)
    def prefix_lm_of(lengths):
        def prefix_lm(b, h, q_idx, kv_idx): return (kv_idx <= q_idx) | (kv_idx < lengths[b])
        return prefix_lm
    counters = torch._dynamo.utils.counters['stats']
    with torch.no_grad(), kernels.flex_mode('compiled'):
        for i, lengths in enumerate([torch.tensor([9, 40]), torch.tensor([100, 3]), torch.tensor([0, 256])]):
            kw = dict(mask_mod=prefix_lm_of(lengths), score_mod=ALIBI)
            out, ref = m(x, **kw), m(x, return_attn_weights=True, **kw)[0]
            assert (out - ref).abs().max() < 1e-5, i
            if i == 0: graphs = counters['unique_graphs']
    assert counters['unique_graphs'] == graphs       # the second and third predicates compiled nothing new


def per_head(b, h, q_idx, kv_idx): return (kv_idx <= q_idx) & (q_idx - kv_idx <= h + 1)   # head h: h + 2 tokens


def test_a_predicate_may_read_the_head():
    """Head h sees its h + 2 latest tokens: every path asks a caller's predicate about each query head (a predicate
    that ignores h costs nothing more: its answer broadcasts). The explicit path's weights are zero exactly where the
    predicate says so, head by head, and every other path equals it."""
    allowed = per_head(0, torch.arange(H)[:, None, None], torch.arange(T)[:, None], torch.arange(T))  # (H, T, T)
    for kind in ('mha', 'gemma'):
        m = module(kind)
        x = torch.randn(B, T, D, dtype=torch.float64)
        with torch.no_grad():
            _, w = m(x, mask_mod=per_head, return_attn_weights=True)
            assert ((w > 0) == allowed).all()
        kw = dict(mask_mod=per_head)
        for path in ('dense', 'block', 'flex_eager') if kind == 'mha' else ('block', 'flex_eager'):
            ours, ref = run(m, kw, path, path != 'flex_eager'), run(m, kw, None, path != 'flex_eager')
            assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-12, (kind, path)
    torch.manual_seed(0)
    sunk = LlamaAttention(D, T, H, KV, sinks=True).double()                # the sinks' tiled path
    with torch.no_grad(): sunk.sinks.normal_()
    assert max((a - b).abs().max().item() for a, b in zip(run(sunk, kw), run(sunk, kw, None))) < 1e-12
    from selfattn_nbdev.deepseek_v3 import LatentAttention
    mla = LatentAttention(16, T, H, kv_rank=8, rope_dim=4, nope_dim=4, v_dim=4).double()
    with torch.no_grad():
        x = torch.randn(B, T, 16, dtype=torch.float64)
        dense, tiled = mla(x, mask_mod=per_head), mla(x, mask_mod=per_head, score_mod=identity)
        assert (dense - tiled).abs().max() < 1e-12 and (dense - mla(x)).abs().max() > 1e-6


# ---- a caller's predicate joined to each layer's own mask (and_layer_mask, or_layer_mask) ----

def image_block(b, h, q_idx, kv_idx): return (q_idx < PREFIX[b]) & (kv_idx < PREFIX[b])     # seen both ways
def keeps_keys(b, h, q_idx, kv_idx): return SEEN[b, kv_idx] | (q_idx == kv_idx)                # hides some keys


@pytest.mark.parametrize('path', ['explicit', 'dense', 'block', 'flex_eager', None])
@pytest.mark.parametrize('join', ['and', 'or'])
def test_a_layer_mask_is_the_modules_own_mask_joined_to_yours(join, path):
    """and_layer_mask(f) is and_masks(this module's own mask, f), or_layer_mask(f) or_masks(...), on every kernel
    that takes a predicate: a windowed module keeps its window, a causal one its causality, a Gemma module with
    padding too; a module that hides nothing takes f alone ('and') or every pair ('or')."""
    from selfattn_nbdev.masks import and_layer_mask, or_layer_mask, or_masks, sliding_window
    joined, f = ((and_layer_mask, keeps_keys), (or_layer_mask, image_block))[join == 'or']
    combine = and_masks if join == 'and' else or_masks
    torch.manual_seed(0)
    windowed = MultiHeadAttention(D, D, T, num_heads=H, num_kv_heads=KV, window=6).double()
    gemma = LlamaAttention(D, T, H, KV, query_scale=0.4, softcap=3.0, window=5).double()
    cases = [(windowed, sliding_window(6), {}), (module('mha'), causal, {}),
             (gemma, sliding_window(5), dict(key_padding_mask=PAD))]
    if path in ('dense', None): cases = cases[:2]               # Gemma: its own cap, never SDPA's
    for m, own, kw in cases:
        grad = path != 'flex_eager'
        ours = run(m, dict(kw, mask_mod=joined(f)), path, grad)
        ref = run(m, dict(kw, mask_mod=combine(own, f)), None, grad)
        assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-12, (m, path)
        replaced = run(m, dict(kw, mask_mod=f), None, grad)[0]
        assert (replaced - ref[0]).abs().max() > 1e-6                  # the module's own mask mattered
    m = MultiHeadAttention(D, D, T, num_heads=H, causal=False).double()
    everything = lambda b, h, q, kv: kv >= 0
    expected = f if join == 'and' else everything
    ours, ref = run(m, dict(mask_mod=joined(f)), path, path != 'flex_eager'), run(m, dict(mask_mod=expected), None)
    assert (ours[0] - ref[0]).abs().max() < 1e-12


def test_a_layer_mask_is_made_once_per_kind_of_layer_and_says_how_to_use_it():
    from selfattn_nbdev.masks import LayerMask, and_layer_mask, or_layer_mask
    joined = or_layer_mask(image_block)
    assert joined.for_layer(window=4) is joined.for_layer(window=4)        # blocks of one kind share masks
    assert joined.for_layer(window=4) is not joined.for_layer()
    assert repr(joined) == 'or_layer_mask(image_block)'
    with pytest.raises(TypeError, match=r"or_layer_mask\(image_block\) joins each layer's own mask.*for_layer"):
        joined(0, 0, 1, 1)
    with pytest.raises(TypeError, match='and_layer_mask needs predicates'):
        and_layer_mask(torch.ones(3))
    with pytest.raises(ValueError, match="join must be 'and' or 'or'; got 'xor'"):
        LayerMask(image_block, 'xor')
    from selfattn_nbdev.generation import KVCache
    with pytest.raises(ValueError, match='mask_mod and score_mod apply to whole sequences'):
        module('mha')(torch.randn(1, 4, D, dtype=torch.float64), cache=KVCache(), mask_mod=joined)


def test_a_layer_mask_on_latent_attention_and_a_model():
    "MLA's own mask is causal; a model whose blocks differ (Gemma: a window of 6, then global) keeps each."
    from selfattn_nbdev.deepseek_v3 import LatentAttention
    from selfattn_nbdev.masks import and_layer_mask, or_layer_mask, or_masks, sliding_window
    torch.manual_seed(0)
    mla = LatentAttention(16, T, H, kv_rank=8, rope_dim=4, nope_dim=4, v_dim=4).double()
    x = torch.randn(B, T, 16, dtype=torch.float64)
    with torch.no_grad():
        assert (mla(x, mask_mod=and_layer_mask(keeps_keys)) - mla(x, mask_mod=and_masks(causal, keeps_keys))
                ).abs().max() < 1e-12
        assert (mla(x, mask_mod=or_layer_mask(image_block)) - mla(x, mask_mod=or_masks(causal, image_block))
                ).abs().max() < 1e-12
        gemma = dict(_models())['Gemma'].double().eval()
        ids = torch.randint(0, 50, (B, T))
        plain = gemma(ids)
        # keys every query sees anyway: joined to each block's own mask, nothing changes; in place of it, a lot
        assert (gemma(ids, mask_mod=and_layer_mask(causal)) - plain).abs().max() < 1e-12
        assert (gemma(ids, mask_mod=causal) - plain).abs().max() > 1e-6


LAYERED = {  # families whose layers differ (a window, then the whole past), small; every other setting: theirs
    'gemma2': dict(head_dim=8, sliding_window=8, query_pre_attn_scalar=8),
    'gemma3_text': dict(num_hidden_layers=3, head_dim=8, sliding_window=8, layer_types=[
        'sliding_attention', 'sliding_attention', 'full_attention']),
    'olmo3': dict(num_hidden_layers=4, sliding_window=8),
    'qwen2': dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1),
}


@pytest.mark.parametrize('model_type', list(LAYERED))
@pytest.mark.parametrize('join', ['and', 'or'])
def test_a_layer_mask_equals_transformers_masks_per_layer_type(join, model_type):
    """A family whose layers differ, in float64, against transformers' eager model given one mask per layer type,
    as its forward takes them ({'full_attention': ..., 'sliding_attention': ...}): or_layer_mask(image) is
    transformers' or_mask_function, and_layer_mask(keep) its and_mask_function. In place of each layer's own mask
    (mask_mod=...), the same predicate is another model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from selfattn_nbdev.masks import and_layer_mask, dense_mask, or_layer_mask, or_masks, sliding_window
    from selfattn_nbdev.pretrained import from_hf
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **(dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation='eager') | LAYERED[model_type]))
    theirs = AutoModelForCausalLM.from_config(config).double().eval()
    ours = from_hf(theirs.state_dict(), theirs.config.to_dict()).double().eval()
    assert {'sliding_attention', 'full_attention'} <= set(theirs.config.layer_types)   # both kinds, or no test
    f, joined, combine = ((keeps_keys, and_layer_mask, and_masks), (image_block, or_layer_mask, or_masks))[join == 'or']
    def additive(mask_mod):  # (B, 1, T, T): 0 where attended, the dtype's lowest elsewhere
        allowed = dense_mask(mask_mod, T, batch=B)
        return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    per_type = {'full_attention': additive(combine(causal, f)),
                'sliding_attention': additive(combine(sliding_window(8), f))}
    ids = torch.randint(0, 64, (B, T))
    with torch.no_grad():
        reference = theirs(ids, attention_mask=per_type).logits
        gap = lambda logits: ((logits - reference).abs().max() / reference.abs().max()).item()
        assert gap(ours(ids, mask_mod=joined(f))) < 1e-5                  # transformers' RoPE: float32
        assert gap(ours(ids, mask_mod=combine(causal, f))) > 1e-3


def test_a_callers_predicate_held_densely_says_so_once(monkeypatch):
    """Training on a CPU, a mask_mod goes to SDPA with its dense mask (FlexAttention has no CPU backward): from
    BLOCK_MIN_PAIRS pairs, one warning per process names the path, the reason and the mask's shape and size;
    shorter calls, and a path the caller forced, say nothing."""
    monkeypatch.setattr(kernels, '_said', set())
    m = MultiHeadAttention(4, 4, 2048, num_heads=2).train()
    chosen = []
    real = kernels._opened_once
    monkeypatch.setattr(kernels, '_opened_once', lambda *a, **k: chosen.append(1) or real(*a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        m(torch.randn(2, 2047, 4, requires_grad=True), mask_mod=prefix_lm)   # below the size: quiet
        for _ in range(3): m(torch.randn(2, 2048, 4, requires_grad=True), mask_mod=prefix_lm)
    said = [str(w.message) for w in caught if 'attention took' in str(w.message)]
    assert chosen and len(said) == 1, said
    assert ("'dense' path: FlexAttention has no backward pass on a CPU" in said[0]
            and 'shape (2, 1, 2048, 2048) (8 MiB)' in said[0]), said[0]       # prefix_lm reads b, not h
    monkeypatch.setattr(kernels, '_said', set())
    with warnings.catch_warnings(), attention_kernel('dense'):
        warnings.simplefilter('error')
        m(torch.randn(2, 2048, 4, requires_grad=True), mask_mod=prefix_lm)  # forced: the caller knows
