"""Decoding whose cost follows the text, not the cache's capacity: `StaticKVCache` hands attention only the columns
written (eagerly) or a bound the host sets (`decode_bound`, for a compiled step); and FlashDecoding
(`split_kv_attention`), the keys split into chunks merged by the online-softmax rule, against SDPA in float64.
The GPU's figures are bench/gpu_decode.py's; these are the logic's checks, on the CPU."""
import pytest
import torch
import torch.nn.functional as F

from selfattn_nbdev.decoding import (DECODE_MIN_BOUND, StaticKVCache, _decode_step, decode_bound, generate,
                                     generate_stream)
from selfattn_nbdev.generation import TinyGPT
from selfattn_nbdev.multihead import MultiHeadAttention
from selfattn_nbdev.ring import split_kv_attention


def test_decode_bound_doubles_from_256_and_stops_at_the_capacity():
    assert DECODE_MIN_BOUND == 256
    assert [decode_bound(n, 32768) for n in (1, 256, 257, 1025, 20000, 32768)] == [256, 256, 512, 2048, 32768, 32768]
    assert decode_bound(100, 128) == 128 and decode_bound(1025, 1088) == 1088
    bounds = {decode_bound(n, 32768) for n in range(1, 32769)}
    assert len(bounds) == 8                              # so at most 8 compiled graphs for any text


@pytest.mark.parametrize('window', [None, 3])
def test_static_cache_gives_attention_only_the_written_columns(window):
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, 8, 4096, num_heads=2, window=window).double().eval()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    seen = []
    real = attn._attend_fused
    attn._attend_fused = lambda q, k, v, allowed=None, **kw: seen.append(k.shape[2]) or real(q, k, v, allowed, **kw)
    cache = StaticKVCache(capacity=4096)
    with torch.no_grad():
        steps = torch.cat([attn(x[:, :5], cache=cache)] + [attn(x[:, i:i + 1], cache=cache) for i in range(5, 12)], 1)
        whole = attn(x)
    assert (steps - whole).abs().max() < 1e-12
    assert cache._keys.shape[2] == (4096 if window is None else 3)     # the storage: the capacity (or the ring)
    if window is None: assert seen[1:8] == list(range(6, 13))      # each step: the columns written, not 4,096


def test_a_step_costs_the_same_work_at_any_capacity():
    "The same logits from a cache of 128 columns and one of 8,192: and attention reads the same columns."
    torch.manual_seed(0)
    gpt = TinyGPT(50, context_length=8192, d_model=32, num_layers=2, num_heads=2).double().eval()
    prompt = torch.randint(0, 50, (1, 40))
    logits = []
    for capacity in (128, 8192):
        caches = gpt.new_caches(capacity)
        with torch.no_grad():
            gpt(prompt, caches)
            logits.append(gpt(torch.tensor([[7]]), caches))
        assert len(caches[0]) == 41 and caches[0]._keys.shape[2] == capacity
    assert (logits[0] - logits[1]).abs().max() < 1e-12


@pytest.mark.heavy
def test_compiled_step_counts_on_the_host_and_reads_the_columns_seen():
    """A compiled step (a counting backend here: the logic, not the speed). On a CPU every cache reads exactly the
    columns seen, a length Dynamo was told varies, so one graph serves a whole text (251 to 270 columns of 512); a
    second capacity (501 to 520 of 1,024) compiles one more graph, which reads storage of any capacity (generate sets
    the caches' any_capacity from then on), so a third (81 to 100 of 256) compiles none; storage on a GPU, whose CUDA
    graphs replay fixed shapes, reads decode_bound's columns."""
    from types import SimpleNamespace
    torch.manual_seed(0)
    gpt = TinyGPT(50, context_length=1024, d_model=32, num_layers=2, num_heads=2).eval()
    graphs = []
    def count(gm, example_inputs): graphs.append(gm); return gm.forward
    for n in (250, 500, 80):                              # capacities decode_bound(270), (520), (100)
        prompt = torch.randint(0, 50, (1, n))
        compiled = generate(gpt, prompt, 20, compile=dict(backend=count, fullgraph=True, dynamic=False))
        assert torch.equal(compiled, generate(gpt, prompt, 20))
    assert len(graphs) == 2                               # 512, then any: a graph each made 3, bounds 5
    caches, prompt = gpt.new_caches(1024), torch.randint(0, 50, (1, 250))
    step = _decode_step(gpt, dict(backend=count, fullgraph=True, dynamic=False))
    with torch.no_grad():
        gpt(prompt, caches)
        step(torch.tensor([[3]]), caches)
    assert all(c.num_seen == 251 and c.bound is None for c in caches)
    assert all(torch.equal(c.columns_read, torch.arange(251)) for c in caches)
    cache = caches[0]
    cache._keys = SimpleNamespace(is_cuda=True)           # the GPU's rule, on this CPU: a power of two
    assert cache.begin_step(1) == 256 and cache.bound == 256 and cache.columns_read is None
    assert cache.begin_step(5) == 512 and cache.num_seen == 257


def test_a_text_that_fills_the_storage_compiles_one_graph():
    """generate's last step reads one column less than its storage holds (the last token needs no step), so a text
    of exactly the capacity (200 + 56 = 256) runs one graph: AOT's decompositions (aot_eager) guard a symbolic
    length against the storage's, which only a full cache would cross. Grouped heads take the one-query sums."""
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    model = Llama(50, 256, 32, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=48).eval()
    graphs = []
    def count(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)
    prompt = torch.randint(0, 50, (1, 200))
    compiled = generate(model, prompt, 56, compile=dict(backend=count, fullgraph=True, dynamic=False))
    assert torch.equal(compiled, generate(model, prompt, 56)) and len(graphs) == 1


def _traced_step(model, prompt):
    "The ATen graph of one compiled decode step (backend aot_eager: the graph, no kernels)."
    from torch._dynamo.backends.common import aot_autograd
    graphs = []
    def keep(gm, example_inputs): graphs.append(gm); return gm.forward
    step = _decode_step(model, dict(backend=aot_autograd(fw_compiler=keep), fullgraph=True, dynamic=False))
    caches = model.new_caches(prompt.shape[1] + 4)
    with torch.no_grad():
        ids = model(prompt, caches)[:, -1].argmax(-1, keepdim=True)
        logits = step(ids, caches)
    return graphs[-1].graph, logits, caches


@pytest.mark.parametrize('window', [None, 3])
def test_a_cached_step_attends_without_looking_for_empty_rows(window):
    """A cache's mask leaves every query a key (a padding query sees itself), so the decode step skips the search
    for queries with no key: no `any` over the keys and no `masked_fill` after SDPA, in any block."""
    torch.manual_seed(0)
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=3, window=window).double().eval()
    prompt = torch.randint(0, 37, (2, 5))
    graph, logits, caches = _traced_step(model, prompt)
    ops = [str(n.target) for n in graph.nodes if n.op == 'call_function']
    assert sum('sdpa' in o or 'scaled_dot_product' in o for o in ops) == 3    # one attention per block, traced
    assert not [o for o in ops if o.startswith('aten.any') or o.startswith('aten.masked_fill')]
    reference = model.new_caches(prompt.shape[1] + 4)
    with torch.no_grad():
        ids = model(prompt, reference)[:, -1].argmax(-1, keepdim=True)
        assert (logits - model(ids, reference)).abs().max() < 1e-12   # the same logits as eager's


def _unshared(model, capacity, pads):
    "One StaticKVCache per block, each building its own mask: the reference."
    return [StaticKVCache(capacity, pads) for _ in model.blocks]


@pytest.mark.parametrize('kind', ['plain', 'window', 'mixed windows'])
def test_a_step_builds_its_mask_once_and_every_block_reads_it(monkeypatch, kind):
    """The caches of one new_caches share a dict of masks: eagerly, the first block of a step builds the mask and the
    others read it (one build per kind of block: a sliding and a global block differ), and the logits are exactly
    those of caches that each build their own."""
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    model = (TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=3, window=3 if kind == 'window' else None)
             if kind != 'mixed windows' else
             Llama(37, 64, d_model=32, num_heads=4, num_layers=4, num_kv_heads=2, d_hidden=48, window=3,
                   layer_types=['sliding_attention', 'full_attention'] * 2)).double().eval()
    built = []
    allowed = StaticKVCache._allowed
    monkeypatch.setattr(StaticKVCache, '_allowed', lambda self, *a: built.append(1) or allowed(self, *a))
    pads, prompt = torch.tensor([0, 2]), torch.randint(0, 37, (2, 5))
    shared, alone = model.new_caches(12, pads), _unshared(model, 12, pads)
    with torch.no_grad():
        assert torch.equal(model(prompt, shared), model(prompt, alone))
        for token in range(4):
            ids = torch.full((2, 1), token)
            built.clear(); ours = model(ids, shared)
            assert len(built) == (2 if kind == 'mixed windows' else 1)       # once a step (a kind)
            built.clear(); theirs = model(ids, alone)
            assert len(built) == len(model.blocks)                           # once a block
            assert torch.equal(ours, theirs)


@pytest.mark.heavy
@pytest.mark.parametrize('window', [None, 3])
def test_a_compiled_step_builds_its_mask_once(window):
    """In the traced graph of a compiled step the mask's comparisons appear once, not once per block, and the
    logits are the eager ones; the host empties the shared masks before every step, so no step reads another's."""
    torch.manual_seed(0)
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=3, window=window).double().eval()
    prompt = torch.randint(0, 37, (2, 5))
    graph, logits, caches = _traced_step(model, prompt)
    ops = [str(n.target) for n in graph.nodes if n.op == 'call_function']
    assert ops.count('aten.eq.Tensor') == 1 and ops.count('aten.bitwise_or.Tensor') == 1   # 3 before
    step = _decode_step(model, dict(backend='aot_eager', fullgraph=True, dynamic=False))
    caches, reference = model.new_caches(prompt.shape[1] + 6), _unshared(model, prompt.shape[1] + 6, None)
    with torch.no_grad():
        model(prompt, caches); model(prompt, reference)
        for token in range(5):                                               # every step its own mask
            ids = torch.full((2, 1), token)
            assert (step(ids, caches) - model(ids, reference)).abs().max() < 1e-12


def _graphs_per_call(model, calls) -> list:
    """compile=True's options with a backend that counts Dynamo's graphs (and runs each as traced): the graphs each
    generate call made, for prompts of (rows, tokens); each call writes the eager tokens."""
    graphs = []
    def count(gm, example_inputs): graphs.append(gm); return gm.forward
    options, made = dict(backend=count, fullgraph=True, dynamic=False), []
    for rows, n in calls:
        prompt, before = torch.randint(0, 37, (rows, n)), len(graphs)
        assert torch.equal(generate(model, prompt, 8, compile=options), generate(model, prompt, 8))
        made.append(len(graphs) - before)
    return made


@pytest.mark.heavy
def test_prompts_of_other_lengths_reuse_the_compiled_step():
    """Compiling, generate gives its caches decode_bound(prompt + new tokens) columns, so a prompt of another length
    finds the step it compiled (a cache of exactly prompt + new tokens columns recompiled for every length, and
    failed at Dynamo's limit after about 115 lengths); the tokens are the eager ones."""
    torch.manual_seed(0)
    model = TinyGPT(37, 512, d_model=16, num_heads=2, num_layers=1).eval()
    made = _graphs_per_call(model, [(1, n) for n in (5, 6, 7, 40, 5, 300)])  # 308 tokens: the bucket of 512
    assert made == [1, 0, 0, 0, 0, 1]


@pytest.mark.heavy
def test_a_second_capacity_makes_a_graph_of_any_capacity_for_its_batch_only():
    """generate counts the capacities each batch shape (thread count, rows, padded) has met: a second one at 2 rows
    compiles that batch's graph of any capacity, and leaves 1 row's graph, traced for its one capacity, as it was."""
    torch.manual_seed(0)
    model = TinyGPT(37, 1024, d_model=16, num_heads=2, num_layers=1).eval()
    calls = [(1, 5), (2, 5), (2, 300), (1, 5), (2, 600), (2, 5)]  # capacities 256, 256, 512, 256, 1024, 256
    assert _graphs_per_call(model, calls) == [1, 1, 1, 0, 0, 0]


def test_a_module_without_a_cache_still_zeros_a_query_with_no_key():
    "Without a cache, a padding query sees no key: the check stays there, and its context is 0, not NaN."
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, 8, 16, num_heads=2).double().eval()
    x, pad = torch.randn(1, 1, 8, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    with torch.no_grad(): context = attn._attend_fused(*attn._project(x), attn._allowed(1, 1, pad))
    assert torch.equal(context, torch.zeros_like(context))

@pytest.mark.parametrize('num_splits', [1, 2, 7, 64, 5000])
@pytest.mark.parametrize('T', [1, 3])
def test_split_kv_attention_is_sdpa(num_splits, T):
    torch.manual_seed(num_splits)
    q = torch.randn(2, 8, T, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 777, 16, dtype=torch.float64).unbind(0)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert (split_kv_attention(q, k, v, num_splits) - ref).abs().max() < 1e-12
    allowed = torch.rand(2, 1, T, 777) > 0.3
    ref = F.scaled_dot_product_attention(q, k, v, allowed, enable_gqa=True)
    assert (split_kv_attention(q, k, v, num_splits, allowed) - ref).abs().max() < 1e-12


def test_split_kv_attention_in_bfloat16_sums_in_float32():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 4, 4096, 64), torch.randn(1, 4, 4096, 64)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    out = split_kv_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 16)
    assert out.dtype == torch.bfloat16 and (out.double() - ref).abs().max() < 2e-2


def test_split_kv_attention_refuses_bad_shapes_by_name():
    q, k = torch.randn(1, 6, 1, 8), torch.randn(1, 4, 10, 8)
    with pytest.raises(ValueError, match='heads a multiple of kv_heads'): split_kv_attention(q, k, k)
    with pytest.raises(ValueError, match='num_splits'): split_kv_attention(torch.randn(1, 4, 1, 8), k, k, 0)


def _stand_in_for_compile(monkeypatch, on_call=lambda: None):
    "torch.compile stood in for: a model runs as if compiled (on_call() first); a function (the products' loop) eager."
    def stand_in(model, **options):
        if not isinstance(model, torch.nn.Module): return model
        def run(*args):
            on_call()
            with monkeypatch.context() as m:
                m.setattr(torch.compiler, 'is_compiling', lambda: True); return model(*args)
        return run
    monkeypatch.setattr(torch, 'compile', stand_in)


@pytest.mark.parametrize('compile, marked', [
    (dict(mode='reduce-overhead'), True), (dict(mode='max-autotune'), True),
    (dict(options={'triton.cudagraphs': True, 'coordinate_descent_tuning': True}), True),
    (dict(backend='cudagraphs'), True), (dict(mode='max-autotune-no-cudagraphs'), False), (dict(), False)])
def test_every_mode_with_cuda_graphs_marks_each_step(monkeypatch, compile, marked):
    """CUDA graphs come with mode 'reduce-overhead', 'max-autotune', the inductor option triton.cudagraphs, or the
    cudagraphs backend: with any of them each step is marked as a new one (so a step's graph may reuse the last one's
    memory); without, none is. torch.compile is stood in for here (the model run as if compiled): this checks what
    the host does."""
    marks = []
    _stand_in_for_compile(monkeypatch)
    monkeypatch.setattr(torch.compiler, 'cudagraph_mark_step_begin', lambda: marks.append(1))
    model = TinyGPT(37, 64, d_model=16, num_heads=2, num_layers=1).eval()
    generate(model, torch.randint(0, 37, (1, 4)), 5, compile=compile)
    assert len(marks) == (4 if marked else 0)     # 4 decode steps after the prompt


def test_caches_of_other_padding_that_share_one_dict_of_masks_keep_their_own():
    "A masks dict shared by hand between caches of different padding: each still gets its own padding's mask."
    torch.manual_seed(0)
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2).double().eval()
    masks, prompt = {}, torch.randint(0, 37, (2, 5))
    a = [StaticKVCache(12, torch.tensor([0, 2]), masks) for _ in model.blocks]
    b = [StaticKVCache(12, torch.tensor([3, 0]), masks) for _ in model.blocks]
    with torch.no_grad():
        for caches, pads in ((a, [0, 2]), (b, [3, 0])):
            alone = _unshared(model, 12, torch.tensor(pads))
            assert torch.equal(model(prompt, caches), model(prompt, alone))
        for token in range(3):
            ids = torch.full((2, 1), token)
            for caches, pads in ((a, [0, 2]), (b, [3, 0])):
                alone = _unshared(model, 12, torch.tensor(pads))
                model(prompt, alone)
                for t in range(token): model(torch.full((2, 1), t), alone)
                assert torch.equal(model(ids, caches), model(ids, alone))


def test_generate_checks_the_guards_once_and_a_stream_at_every_step(monkeypatch):
    """Between two steps of `generate` only the package's code runs, so after the first step of a call (every guard
    checked) Dynamo checks only what tells its graphs apart (skip_guard_eval_unsafe) while the host's own state is
    unchanged. generate_stream hands each token to the caller, whose code may change the model: every guard, every
    step. A stance the caller set (here force_eager) is left alone. torch.compile is stood in for: the host's logic."""
    stance = torch._dynamo.eval_frame._stance
    _stand_in_for_compile(monkeypatch, lambda: skipped.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe))
    model, prompt = TinyGPT(37, 64, d_model=16, num_heads=2, num_layers=1).eval(), torch.randint(0, 37, (1, 4))
    skipped = []; generate(model, prompt, 5, compile=True)
    assert skipped == [False, True, True, True]           # 4 steps: the first checks everything
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe   # the stance comes back
    skipped = []; list(generate_stream(model, prompt, 5, compile=True))
    assert skipped == [False] * 4
    skipped = []
    with torch.compiler.set_stance('force_eager'): generate(model, prompt, 5, compile=True)
    assert skipped == [False] * 4 and torch._dynamo.eval_frame._stance is stance


def test_a_stream_sees_a_change_the_caller_makes_between_tokens():
    """The caller of generate_stream changes the model between two tokens (the final norm's eps, which Dynamo guards
    as a constant): the next steps compile again and give what eager steps give. Were the guards skipped, the old
    graph would run with the old eps."""
    def tokens(compile):
        torch.manual_seed(0)
        model = TinyGPT(37, 64, d_model=16, num_heads=2, num_layers=2).eval()
        out = []
        for i, t in enumerate(generate_stream(model, torch.randint(0, 37, (1, 6)), 12, compile=compile)):
            out.append(t)
            if i == 3: model.norm.eps = 1e3
        return torch.stack(out)
    assert torch.equal(tokens(dict(backend='aot_eager', fullgraph=True, dynamic=False)), tokens(False))


def test_a_step_that_reads_a_whole_storage_has_its_guards_checked():
    """Dynamo's symbolic length excludes the storage's own: a step that fills it needs a graph of its own. Between
    generate's steps the guards that tell graphs apart find none for it; Dynamo says so (it will not compile with
    guards skipped), and the step runs again with every guard checked, which compiles that graph."""
    from selfattn_nbdev.decoding import _STEPS_ALONE
    torch.manual_seed(0)
    model = TinyGPT(50, 64, d_model=32, num_layers=2, num_heads=2).eval()
    graphs = []
    def count(gm, example_inputs): graphs.append(gm); return gm.forward
    caches, prompt = model.new_caches(16), torch.randint(0, 50, (1, 12))
    step = _decode_step(model, dict(backend=count, fullgraph=True, dynamic=False))
    alone = _STEPS_ALONE.set(True)
    try:
        with torch.no_grad():
            model(prompt, caches)
            ids = prompt
            for t in (7, 8, 9, 10):                       # 13 to 16 columns: the last fills the storage
                ids = torch.cat([ids, torch.tensor([[t]])], 1)
                logits = step(torch.tensor([[t]]), caches)
    finally: _STEPS_ALONE.reset(alone)
    assert caches[0].num_seen == 16 and len(graphs) == 2   # the symbolic length, then the full storage
    with torch.no_grad(): expected = model(ids)[:, -1:]
    assert torch.allclose(logits, expected, atol=1e-5)


def test_steps_that_cross_a_bound_compile_it_with_the_guards_left_to_the_host(monkeypatch):
    """A GPU's rule on this CPU (every step reads decode_bound's columns): a text crossing 256 columns needs the
    graph of bound 512 in the middle of a generate call, where the host leaves the guards to itself. The bound is
    part of the host's state, so that step checks every guard and compiles; the tokens are eager's."""
    torch.manual_seed(0)
    gpt = TinyGPT(50, context_length=1024, d_model=32, num_layers=2, num_heads=2).eval()
    prompt = torch.randint(0, 50, (1, 250))
    eager = generate(gpt, prompt, 20)
    graphs, skipped = [], []
    def count(gm, example_inputs): graphs.append(gm); return gm.forward
    monkeypatch.setattr(StaticKVCache, '_reads_a_bound', lambda self: True)
    real = torch.compiler.set_stance
    def noted(*args, **kwargs): skipped.append(kwargs.get('skip_guard_eval_unsafe')); return real(*args, **kwargs)
    monkeypatch.setattr(torch.compiler, 'set_stance', noted)
    compiled = generate(gpt, prompt, 20, compile=dict(backend=count, fullgraph=True, dynamic=False))
    assert torch.equal(compiled, eager) and len(graphs) == 2   # bounds 256 and 512
    assert skipped.count(True) == 19 - 2                      # every step but each bound's first
