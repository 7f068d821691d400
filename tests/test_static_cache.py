"""Issue 20: the fixed-shape cache, prompts of different lengths, sampling, stop ids, streaming and a decode step that
compiles once. Every comparison is against the model without any cache, one row at a time where rows matter."""
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from selfattn_nbdev.generation import TinyGPT
from selfattn_nbdev.decoding import sample_next
from selfattn_nbdev.decoding import StaticKVCache, generate, generate_stream
from selfattn_nbdev.multihead import MultiHeadAttention
from selfattn_nbdev.generation import KVCache

CONFIGS = {'plain': {}, 'gqa': dict(num_kv_heads=1), 'rope': dict(rope=True),
           'window': dict(window=5), 'gqa-window-rope': dict(num_kv_heads=2, window=4, rope=True)}


def _model(options, context=64, seed=0):
    torch.manual_seed(seed)
    return TinyGPT(37, context, d_model=32, num_heads=4, num_layers=2, **options).eval()


@pytest.mark.parametrize('name', list(CONFIGS))
def test_static_cache_logits_equal_the_uncached_forward(name):
    "Prompt of 7, then one token at a time: every step's logits within 1e-5 of one forward on everything."
    model, ids = _model(CONFIGS[name]), torch.randint(0, 37, (3, 20))
    with torch.no_grad():
        full = model(ids)                                           # (3, 20, 37)
        caches = model.new_caches(capacity=20)
        steps = [model(ids[:, :7], caches)] + [model(ids[:, t:t + 1], caches) for t in range(7, 20)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


@pytest.mark.parametrize('name', list(CONFIGS))
@pytest.mark.parametrize('explicit', [False, True], ids=['fused', 'explicit'])
def test_static_cache_in_multihead_attention_on_both_paths(name, explicit):
    torch.manual_seed(1)
    attn = MultiHeadAttention(16, 16, 32, num_heads=4, **CONFIGS[name]).eval()
    x = torch.randn(2, 15, 16)
    with torch.no_grad():
        full = attn(x)
        cache = StaticKVCache(capacity=15)
        outs = [attn(x[:, :6], cache=cache, return_attn_weights=explicit)]
        outs += [attn(x[:, t:t + 1], cache=cache, return_attn_weights=explicit) for t in range(6, 15)]
    outs = [o[0] if explicit else o for o in outs]
    assert (torch.cat(outs, 1) - full).abs().max() < 1e-5
    if 'window' in name: assert cache._keys.shape[2] == CONFIGS[name]['window']   # a ring of window slots


def test_chunks_of_any_size_without_a_window():
    attn = MultiHeadAttention(8, 8, 16, num_heads=2, rope=True).eval()
    x, cache = torch.randn(1, 12, 8), StaticKVCache(12)
    with torch.no_grad():
        outs = [attn(x[:, a:b], cache=cache) for a, b in [(0, 1), (1, 4), (4, 9), (9, 12)]]
        assert (torch.cat(outs, 1) - attn(x)).abs().max() < 1e-5


@pytest.mark.parametrize('name', list(CONFIGS))
def test_prompts_of_different_lengths_give_each_row_what_it_gets_alone(name):
    model = _model(CONFIGS[name])
    prompts = [torch.randint(0, 37, (n,)) for n in (3, 11, 1, 7)]       # longer and shorter than the window
    together = generate(model, prompts, 25)
    for row, prompt in zip(together, prompts):
        assert torch.equal(row, generate(model, [prompt], 25)[0])
        assert torch.equal(row, generate(model, prompt[None], 25)[0])   # a tensor prompt: no padding at all
    assert all(torch.equal(a, b) for a, b in zip(together, generate(model, prompts, 25, use_cache=False)))


def test_padded_rows_logits_match_alone():
    "Not only the argmax: the logits of every generated position of a padded row, within 1e-5."
    model = _model(dict(rope=True))
    short, long = torch.randint(0, 37, (4,)), torch.randint(0, 37, (9,))
    pads = torch.tensor([5, 0])
    ids = torch.stack([torch.cat([torch.zeros(5, dtype=torch.long), short]), long])
    with torch.no_grad():
        got = model(ids, model.new_caches(capacity=9, pads=pads))[0, 5:]
        assert (got - model(short[None])[0]).abs().max() < 1e-5


def test_compile_once_for_a_whole_generation():
    "fullgraph=True, one graph for 50 decode steps (backend 'eager': dynamo's tracing without inductor's time)."
    model, prompts = _model(CONFIGS['gqa-window-rope']), [torch.randint(0, 37, (n,)) for n in (3, 9)]
    torch._dynamo.reset(); counters.clear()
    out = generate(model, prompts, 50, compile=dict(backend='eager', fullgraph=True))
    assert counters['stats']['unique_graphs'] == 1
    assert all(torch.equal(a, b) for a, b in zip(out, generate(model, prompts, 50)))


def test_a_compile_reports_its_seconds_once(caplog):
    """The first compiled step compiles, and generate says at INFO how long it took (logger selfattn_nbdev.decoding);
    a second generate of the same model and capacity reuses Dynamo's graph and says nothing; on a CPU one graph reads
    any number of cached positions, a longer generation's larger storage compiles one graph more, which reads storage
    of any capacity, and a third capacity compiles nothing."""
    import logging, re
    model, prompt = _model({}, context=600), torch.randint(0, 37, (1, 5))
    options = dict(backend='eager', fullgraph=True, dynamic=False)  # compile=True's: no automatic dynamic
    torch._dynamo.reset()
    said = lambda: [r.getMessage() for r in caplog.records if r.name == 'selfattn_nbdev.decoding'
                    and r.getMessage().startswith('generate(compile')]  # (rows_kernel's: its own)
    with caplog.at_level(logging.INFO, logger='selfattn_nbdev.decoding'):
        generate(model, prompt, 3, compile=options)          # 8 positions: a capacity of 256
        first = said()
        generate(model, prompt, 3, compile=options)          # the same capacity: Dynamo's graph
        again = said()
        generate(model, prompt, 300, compile=options)        # 305 positions: a capacity of 512
        longer = said()
        generate(model, prompt, 550, compile=options)        # 555 positions: a capacity of 600, the context
        longest = said()
    assert len(first) == 1 and 'reading any number of cached positions' in first[0], first
    assert 0 < float(re.search(r'in ([0-9.]+) s at', first[0]).group(1)) < 60
    assert again == first
    assert len(longer) == 2 and longest == longer, longest  # a graph for 256, then one for any capacity


def test_a_new_thread_count_compiles_again_and_says_so():
    "Dynamo guards on torch's thread count: the step compiles again at a new count, once, with a warning naming both."
    import warnings
    model, prompt = _model({}), torch.randint(0, 37, (1, 5))
    options, before = dict(backend='eager', fullgraph=True), torch.get_num_threads()
    def graphs_after(threads):  # the step's graphs once generate ran at `threads`
        torch.set_num_threads(threads)
        generate(model, prompt, 3, compile=options)
        return counters['stats']['unique_graphs']
    torch._dynamo.reset(); counters.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('error')                      # the first count: no warning
            assert graphs_after(1) == 1
        with pytest.warns(UserWarning, match=r"compiled with torch on \[1\] thread\(s\) and now runs 2"):
            assert graphs_after(2) == 2                         # compiled again: the warning is true
        with warnings.catch_warnings():
            warnings.simplefilter('error')                      # counts already compiled: silent, no graph
            assert graphs_after(2) == 2 and graphs_after(1) == 2
    finally: torch.set_num_threads(before)


@pytest.mark.slow
def test_compile_once_over_512_tokens_with_inductor():
    """Inductor, as generate(compile=True) runs it on a CPU: one graph for 512 tokens (33 to 544 cached positions),
    where a graph per bound (decode_bound: 256, 512, 544) made three; the tokens are the eager ones."""
    from selfattn_nbdev.decoding import compiled_gemv_kernel, stacked
    model, prompt = _model({}, context=600), torch.randint(0, 37, (2, 32))
    with stacked(model): compiled_gemv_kernel(model, rows=2)   # its probe's graph (generate's matrices, the batch)
    torch._dynamo.reset(); counters.clear()
    out = generate(model, prompt, 512, compile=True)
    assert counters['stats']['unique_graphs'] == 1
    assert torch.equal(out, generate(model, prompt, 512))


def test_sampling_truncations():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).expand(4000, 5)
    draw = lambda **kw: sample_next(logits, generator=torch.Generator().manual_seed(0), **kw).bincount(minlength=5)
    assert (draw(temperature=1.0) > 0).all()
    assert (draw(temperature=1.0, top_k=3)[3:] == 0).all() and (draw(temperature=1.0, top_k=3)[:3] > 0).all()
    probs = logits[0].softmax(-1)                           # 0.636, 0.234, 0.086, ...: p = 0.8 keeps two
    kept = draw(temperature=1.0, top_p=0.8)
    assert (kept[2:] == 0).all() and (kept[:2] > 0).all() and probs[:1].sum() < 0.8 <= probs[:2].sum()
    assert torch.equal(sample_next(logits, 1.0, top_k=1), logits.argmax(-1))
    assert torch.equal(sample_next(logits, 1.0, top_p=1e-6), logits.argmax(-1))
    share = draw(temperature=1.0)[0] / 4000                 # the sampler follows the softmax
    assert abs(share - probs[0]) < 0.03


def test_seeded_sampling_is_reproducible_and_the_seed_matters():
    model, prompts = _model({}), [torch.randint(0, 37, (n,)) for n in (2, 6)]
    run = lambda seed: generate(model, prompts, 30, temperature=1.0, top_k=10, top_p=0.95,
                                generator=torch.Generator().manual_seed(seed))
    first, again, other = run(3), run(3), run(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_stop_ids_end_each_row_on_its_own():
    model, prompts = _model({}), [torch.randint(0, 37, (n,)) for n in (2, 5, 3)]
    free = generate(model, prompts, 30)
    stop = int(free[0][2 + 4])                      # the 5th token of row 0: row 0 stops there at the latest
    rows = generate(model, prompts, 30, stop_ids=[stop, 36])
    for row, whole, prompt in zip(rows, free, prompts):
        new = whole[len(prompt):]
        hits = torch.isin(new, torch.tensor([stop, 36])).nonzero()
        end = int(hits[0, 0]) + 1 if len(hits) else len(new)
        assert torch.equal(row, whole[:len(prompt) + end])     # cut after the first stop id, else all
    first = int((free[0][2:] == stop).nonzero()[0, 0]) + 1           # row 0 writes `stop` as its token `first`
    as_tensor = generate(model, free[0][:2][None].repeat(2, 1), 30, stop_ids=stop, pad_id=0)
    assert as_tensor.shape == (2, 2 + first) and (as_tensor[:, -1] == stop).all()   # all stopped: no more steps


def test_streaming_yields_each_step_as_it_is_made():
    model, prompt = _model({}), torch.randint(0, 37, (2, 4))
    stream = generate_stream(model, prompt, 12)
    first = next(stream)                         # a token exists before the rest are computed
    assert first.shape == (2,)
    rest = list(stream)
    assert len(rest) == 11
    assert torch.equal(torch.stack([first, *rest], 1), generate(model, prompt, 12)[:, 4:])


class OneLayerLM(nn.Module):
    "Not a TinyGPT: the protocol only (vocab_size, context_length, new_caches, forward(token_ids, caches))."
    def __init__(self):
        super().__init__()
        self.vocab_size, self.context_length = 11, 40
        self.emb = nn.Embedding(11, 16)
        self.attn = MultiHeadAttention(16, 16, 40, num_heads=2, rope=True)
        self.out = nn.Linear(16, 11)

    def new_caches(self, capacity=None, pads=None):
        return [KVCache() if capacity is None else StaticKVCache(capacity, pads)]

    def forward(self, token_ids, caches=None):
        return self.out(self.attn(self.emb(token_ids), cache=None if caches is None else caches[0]))


def test_any_model_with_the_protocol():
    torch.manual_seed(0)
    model, prompts = OneLayerLM().eval(), [torch.randint(0, 11, (n,)) for n in (4, 2)]
    together = generate(model, prompts, 10)
    for row, prompt in zip(together, prompts):
        assert torch.equal(row, generate(model, [prompt], 10, use_cache=False)[0])


def test_one_cache_one_module():
    "Issue 23: a cache given to a second module of the same shape raises instead of mixing keys (was off by 0.41)."
    a, b = (MultiHeadAttention(8, 8, 16, num_heads=2) for _ in range(2))
    x = torch.randn(1, 3, 8)
    for cache in (KVCache(), StaticKVCache(16)):
        a(x, cache=cache)
        with pytest.raises(ValueError, match='another module'):
            b(x, cache=cache)
        cache.reset()
        b(x, cache=cache)                        # after a reset it may serve another module


def test_the_cuda_decode_step_is_a_cuda_graph(monkeypatch):
    "The GPU path's logic on CPU: on a CUDA model, compile=True means mode='reduce-overhead', each step marked; on a CPU, a C++ wrapper."
    import selfattn_nbdev.decoding as gen
    seen, marks = {}, []
    monkeypatch.setattr(torch, 'compile', lambda model, **options: seen.update(options) or model)
    monkeypatch.setattr(torch.compiler, 'cudagraph_mark_step_begin', lambda: marks.append(1))

    class OnCuda:
        "Stands for a model whose weights are on a CUDA device."
        def parameters(self): return iter([type('P', (), {'device': torch.device('cuda')})()])
        def modules(self): return iter([self])               # no linears to stack
        def __call__(self, token_ids, caches): return 'logits'

    step = gen._decode_step(OnCuda(), True)
    assert seen == {'fullgraph': True, 'dynamic': False, 'mode': 'reduce-overhead'}
    assert step(None, None) == 'logits' and step(None, None) == 'logits' and len(marks) == 2
    seen.clear()
    gen._decode_step(_model({}), True)            # on CPU: no CUDA graphs; a C++ wrapper
    assert seen == {'fullgraph': True, 'dynamic': False, 'options': {'cpp_wrapper': True}}
    seen.clear()
    assert gen._decode_step(OnCuda(), dict(backend='eager'))(None, None) == 'logits'
    assert seen == {'backend': 'eager'} and len(marks) == 2   # given options are used as they are


@pytest.mark.parametrize('cache', [KVCache, lambda: StaticKVCache(capacity=8)], ids=['KVCache', 'StaticKVCache'])
def test_both_caches_refuse_a_key_padding_mask(cache):
    "Padding with a cache goes through pads= (generate's list of prompts); both caches say so, with one message."
    attn = MultiHeadAttention(16, 16, 32, num_heads=4).eval()
    with pytest.raises(ValueError, match='give generate a list of prompts'):
        attn(torch.randn(2, 4, 16), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool), cache=cache())


@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer slows torch.compile; the eager tests cover the same lines
def test_a_compiled_decode_step_writes_the_eager_tokens_in_every_family(tmp_path):
    """generate(compile=True) on a CPU (a C++ wrapper around Inductor's kernels) writes the eager tokens for every
    native family read from transformers' tiny random models, and says nothing on the way: Gemma 2's soft cap once
    made Dynamo warn about a cached function it traced through. One graph serves every length of the text: 300
    tokens in storage of 512 columns compile one graph, for that storage."""
    import warnings
    pytest.importorskip('transformers')
    from bench.families import families
    from selfattn_nbdev.pretrained import from_hf
    from transformers import AutoConfig, AutoModelForCausalLM
    olmo3 = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=512, sliding_window=8,
                 layer_types=['sliding_attention', 'full_attention'], bos_token_id=None, eos_token_id=None,
                 pad_token_id=None)
    more = {'OLMo 3 (norms after)': lambda: AutoModelForCausalLM.from_config(AutoConfig.for_model('olmo3', **olmo3))}
    for name, make in (families(128, 2, 256, 512) | more).items():
        torch.manual_seed(0)
        make().eval().save_pretrained(tmp_path / str(len(name)) / name.split()[0])
        model = from_hf(tmp_path / str(len(name)) / name.split()[0]).eval()
        ids = torch.randint(0, 256, (2, 9))
        eager = generate(model, ids, 10)
        with warnings.catch_warnings():
            warnings.simplefilter('error', UserWarning)  # (torch's own DeprecationWarnings pass)
            compiled = generate(model, ids, 10, compile=True)
        assert torch.equal(compiled, eager), name
        graphs = counters['stats']['unique_graphs']           # 10 to 309 positions in storage of 512: a graph
        longer = generate(model, ids, 300, compile=True)       # of any capacity (per bound: two)
        assert counters['stats']['unique_graphs'] == graphs + 1, name
        windows = {getattr(m, 'window', None) for m in model.modules()}  # 256 again: no graph, unless 512
        ring = any(isinstance(w, int) and 256 <= w < 512 for w in windows)  # made the window a ring: then the
        assert torch.equal(generate(model, ids, 10, compile=True), compiled), name  # graph of any capacity is
        assert counters['stats']['unique_graphs'] == graphs + 1 + ring, name       # this one
        assert torch.equal(longer, generate(model, ids, 300)), name
