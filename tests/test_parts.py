"""Add, never replace: later pages add *parts* that the one forward of each class already calls.

Each class of the story is defined once; a page that refines it adds an entry to a dict on the class
(`MultiHeadAttention._options`, `_mask_rules`, `_score_rules`, `_call_parts`, `_kernel_choices`, `_products`,
`_position_rules`, `_shown`, `_model_parts`, which is `TinyGPT._call_parts`; `KVCache._forget`; `StaticKVCache._kinds`). These tests hold
the protocol: every method and function is defined once, a part that is there is used, a name no part takes is
refused by name, and the kinds a cache becomes are the right ones."""
import ast
from pathlib import Path

import pytest
import torch

import selfattn_nbdev  # noqa: F401  (every module: every part in place)
from selfattn_nbdev import generation
from selfattn_nbdev.decoding import StaticKVCache, generate
from selfattn_nbdev.generation import KVCache, TinyGPT
from selfattn_nbdev.masks import sliding_window
from selfattn_nbdev.gqa_window_rope import RingKVCache
from selfattn_nbdev.multihead import MultiHeadAttention

PACKAGE = Path(selfattn_nbdev.__file__).parent


def _definitions() -> dict:
    "(class or module, name) -> the places that define it: a class body, @patch, or a module's function."
    defs = {}
    for path in sorted(PACKAGE.glob('*.py')):
        if path.name == '_modidx.py': continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef): defs.setdefault((node.name, f.name), []).append(path.stem)
            elif isinstance(node, ast.FunctionDef):
                patched = any(ast.unparse(d) == 'patch' for d in node.decorator_list)
                owner = ast.unparse(node.args.args[0].annotation) if patched and node.args.args[0].annotation else None
                if node.name == '__getattr__': continue  # PEP 562: a module's own, one per module
                defs.setdefault((owner or path.stem, node.name), []).append(path.stem)
    return defs


def test_every_method_and_function_is_defined_once():
    twice = {k: v for k, v in _definitions().items() if len(v) > 1}
    assert not twice, twice


def test_nothing_in_the_package_replaces_a_function_of_an_earlier_module():
    for path in PACKAGE.glob('*.py'):
        assert '@replaces' not in path.read_text(), path.name
    assert not hasattr(selfattn_nbdev.core, 'replaces')


def test_the_names_generation_held_say_where_they_are():
    with pytest.raises(AttributeError, match=r"generate: the package's is written on the Batches page"):
        generation.generate
    assert selfattn_nbdev.generate is generate
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        generation.nothing


def test_an_option_no_part_takes_is_refused_by_name():
    with pytest.raises(TypeError, match="unexpected options: num_kv_head"):
        MultiHeadAttention(8, 8, 16, num_heads=2, num_kv_head=1)          # a typo of num_kv_heads
    m = MultiHeadAttention(8, 8, 16, num_heads=2)
    with pytest.raises(TypeError, match="unexpected keyword arguments: document_id"):
        m(torch.randn(1, 4, 8), document_id=torch.zeros(1, 4, dtype=torch.long))


def test_another_librarys_argument_is_refused_with_what_to_give_instead():
    "transformers' attention_mask (1 = a real token) and FlexAttention's block_mask, enable_gqa and a built BlockMask."
    from torch.nn.attention.flex_attention import create_block_mask
    model, ids = _llama(), torch.randint(0, 64, (2, 6))
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    attention_mask[0, :2] = 0
    with pytest.raises(TypeError, match=r"attention_mask, give key_padding_mask=\(attention_mask == 0\)"):
        model(ids, attention_mask=attention_mask)
    with torch.no_grad():  # and what it says to give runs: the padded row's real tokens as alone
        padded = model(ids, key_padding_mask=attention_mask == 0)
        alone = model(ids[:1, 2:])
    assert torch.allclose(padded[0, 2:], alone[0], atol=1e-5)
    with pytest.raises(TypeError, match=r"block_mask, give mask_mod=block_mask.mask_mod.*enable_gqa, give nothing"
                                        r".*return_lse, give nothing: forward returns the context alone"):
        model(ids, block_mask=None, enable_gqa=True, return_lse=True)
    built = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 6, 6, device='cpu')
    with pytest.raises(TypeError, match=r"got BlockMask \(its predicate: mask_mod=block_mask.mask_mod\)"):
        model(ids, mask_mod=built)


def test_the_options_part_sets_gqa_window_rope_before_the_layers_are_built():
    m = MultiHeadAttention(8, 8, 16, num_heads=2, num_kv_heads=1, window=3, rope=True)
    assert (m.num_kv_heads, m.window, m.rope) == (1, 3, True)
    assert m.W_key.out_features == m.W_value.out_features == 4             # one key head of 4
    plain = MultiHeadAttention(8, 8, 16, num_heads=2)
    assert plain.num_kv_heads == 2 and plain.window is None and not plain.rope


def test_the_window_rule_adds_nothing_while_every_key_is_within_reach():
    m = MultiHeadAttention(8, 8, 16, num_heads=2, window=4)
    assert m._mask_parts(1, 4) == [] and m._mask_parts(4, 4) == []
    assert len(m._mask_parts(6, 6)) == 1
    allowed = m._allowed(6, 6)                                         # (T, S) or (1, 1, T, S)
    assert allowed.reshape(6, 6)[-1].tolist() == [False, False, True, True, True, True]  # the last: keys 2..5


@pytest.mark.parametrize('path', ['fused', 'explicit'])
def test_a_mask_mod_takes_the_place_of_causal_and_documents_join_it(path):
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 16, num_heads=2, causal=True).double().eval()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    everything = lambda b, h, q, kv: q >= 0                              # not causal: every key
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    weights = path == 'explicit'
    out = m(x, mask_mod=everything, document_ids=docs, return_attn_weights=weights)
    out = out[0] if weights else out
    bidirectional = MultiHeadAttention(8, 8, 16, num_heads=2, causal=False).double().eval()
    bidirectional.load_state_dict(m.state_dict())
    for span in (slice(0, 3), slice(3, 6)):                              # each document alone, both ways
        assert (out[:, span] - bidirectional(x[:, span])).abs().max() < 1e-12


def test_a_static_cache_becomes_a_ring_for_a_window_and_back_after_a_reset():
    torch.manual_seed(0)
    windowed = MultiHeadAttention(8, 8, 16, num_heads=2, window=4).eval()
    plain = MultiHeadAttention(8, 8, 16, num_heads=2).eval()
    x = torch.randn(1, 7, 8)
    cache = StaticKVCache(16)
    with torch.no_grad():
        steps = [windowed(x[:, :5], cache=cache)] + [windowed(x[:, t:t + 1], cache=cache) for t in range(5, 7)]
        assert type(cache) is RingKVCache and cache._keys.shape[2] == 4
        assert (torch.cat(steps, 1) - windowed(x)).abs().max() < 1e-5
        cache.reset()
        wide = StaticKVCache(3)                       # a window no shorter than the capacity: no ring
        windowed(x[:, :2], cache=wide)
        assert type(wide) is StaticKVCache
        fresh = StaticKVCache(16)
        plain(x[:, :3], cache=fresh)
        assert type(fresh) is StaticKVCache and fresh._keys.shape[2] == 16
    assert type(cache) is RingKVCache                  # until its next first update: then the module decides
    with torch.no_grad(): plain(x[:, :3], cache=cache)
    assert type(cache) is StaticKVCache


def test_a_growing_cache_forgets_beyond_the_window_through_its_part():
    assert 'window' in KVCache._forget
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 8, 32, num_heads=2, window=3).eval()
    cache = KVCache()
    with torch.no_grad():
        for t in range(10): m(torch.randn(1, 1, 8), cache=cache)
    assert len(cache) == 2 and cache.num_seen == 10                    # window - 1 kept for the next token


def test_a_model_with_documents_restarts_positions_through_its_call_part():
    assert 'documents' in TinyGPT._call_parts
    torch.manual_seed(0)
    model = TinyGPT(20, 16, d_model=16, num_heads=2).eval()
    ids = torch.randint(0, 20, (1, 10))
    docs = torch.tensor([[0] * 4 + [1] * 6])
    with torch.no_grad():
        packed = model(ids, document_ids=docs)
        assert (packed[:, 4:] - model(ids[:, 4:])).abs().max() < 1e-5
    with pytest.raises(ValueError, match="document_ids cannot be combined with caches"):
        model(ids, model.new_caches(), document_ids=docs)


def test_generate_with_the_stacked_product_part_equals_one_product_each():
    assert 'stacked' in MultiHeadAttention._products
    torch.manual_seed(0)
    model = TinyGPT(20, 32, d_model=16, num_heads=2).eval()
    prompt = torch.randint(0, 20, (2, 5))
    saved = dict(MultiHeadAttention._products)
    try:
        with_part = generate(model, prompt, 6)
        MultiHeadAttention._products.clear()
        assert torch.equal(generate(model, prompt, 6), with_part)
    finally: MultiHeadAttention._products.update(saved)


def test_the_traced_forward_keeps_sliding_window_exact():
    "The mask_mod path of the structure benchmark (bench/structure.py) gives the window's own answer."
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    model = Llama(vocab_size=64, context_length=32, d_model=32, num_heads=4, num_layers=1).eval()
    ids = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        yours = model(ids, mask_mod=sliding_window(4))
        windowed = Llama(vocab_size=64, context_length=32, d_model=32, num_heads=4, num_layers=1, window=4).eval()
        windowed.load_state_dict(model.state_dict())
        assert (yours - windowed(ids)).abs().max() < 1e-5


# the calls one forward makes, measured when the budget was set; a change that adds to a path must say why here.
# Llama's two: RoPE turns queries and keys through _turn_first, the one place that knows partial RoPE from full;
# a masked call's one: choose_kernel, the one choice that the module and the transformers route both ask
CALL_BUDGET = {'MultiHeadAttention, whole sequence': 13, 'Llama, 1 layer, mask_mod': 35, 'Llama, 1 layer, decode step': 37}


@pytest.mark.parametrize('path', list(CALL_BUDGET))
def test_a_forward_keeps_to_its_call_budget(path):
    """The path of a forward is a budget (issue "Add, never replace"): a plain multi-head forward, the traced
    forward of bench/structure.py, and one decode step of the same model make no more package calls than
    CALL_BUDGET says, counted as bench/structure.py counts them (checks and comprehensions out)."""
    from bench import structure
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    named = lambda f: [f'{module}.{name}' for module, name in structure.package_calls(f)]
    if path.startswith('MultiHeadAttention'):
        m, x = MultiHeadAttention(32, 32, 64, num_heads=4).eval(), torch.randn(2, 16, 32)
        sequence = named(lambda: m(x))
    elif 'decode' in path:
        model = Llama(vocab_size=64, context_length=32, d_model=32, num_heads=4, num_layers=1).eval()
        ids, caches = torch.randint(0, 64, (1, 16)), model.new_caches()
        with torch.no_grad(): model(ids, caches); model(ids[:, :1], caches)
        sequence = named(lambda: model(ids[:, :1], caches))
    else: sequence = structure.traced_forward()['sequence']
    kept = structure.without_checks(sequence)['calls_without_checks']
    assert 0 < kept <= CALL_BUDGET[path], (kept, sequence)


def _package_imports(module:str) -> set:
    "The package modules a module imports (relative imports of the generated file)."
    tree = ast.parse((PACKAGE / f'{module}.py').read_text())
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}


def test_masks_import_no_model_and_no_decoding():
    """A mask is a function of four indices: its module imports only the foundation. The kernels that run masks
    are told about models through parts on the attention: their module imports attention, never a model."""
    assert _package_imports('masks') <= {'core'}, _package_imports('masks')
    assert _package_imports('kernels') <= {'core', 'causal', 'multihead', 'masks'}, _package_imports('kernels')
    assert TinyGPT._call_parts is MultiHeadAttention._model_parts
    assert 'documents' in MultiHeadAttention._model_parts


def _import_module_calls(source:str) -> int:
    "How many importlib.import_module(...) calls a module's source makes."
    return sum(1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
               and getattr(node.func, 'attr', getattr(node.func, 'id', '')) == 'import_module')


def test_no_module_reaches_another_through_import_module():
    "Every module that registers a family is imported with the package; none is fetched by name at run time."
    assert _import_module_calls("importlib.import_module(f'selfattn_nbdev.{later}')") == 1  # the test can fail
    for path in PACKAGE.glob('*.py'):
        if path.stem == 'distributed': continue  # it re-imports a user's function in each spawned rank
        assert _import_module_calls(path.read_text()) == 0, path.name
    from selfattn_nbdev.pretrained import FAMILIES
    assert {'qwen3_5_text', 'gemma4_text', 'smollm3'} <= set(FAMILIES)
    with pytest.raises(AttributeError, match='FAMILIES once the package is imported'):
        from selfattn_nbdev import pretrained
        pretrained.LATER_FAMILIES


def test_modules_are_named_for_what_they_hold_and_old_names_still_import():
    "modern and recent were named for when they appeared; they import as gqa_window_rope and llama_attention."
    import subprocess, sys
    names = sorted(p.stem for p in PACKAGE.glob('*.py'))
    assert 'modern' not in names and 'recent' not in names and {'gqa_window_rope', 'llama_attention'} <= set(names)
    code = ("import selfattn_nbdev.modern as m, selfattn_nbdev.recent as r\n"
            "from selfattn_nbdev.modern import RingKVCache\nfrom selfattn_nbdev.recent import LlamaAttention\n"
            "print(m.__name__, r.__name__, RingKVCache.__module__, LlamaAttention.__module__)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ['selfattn_nbdev.gqa_window_rope', 'selfattn_nbdev.llama_attention',
                                  'selfattn_nbdev.caches', 'selfattn_nbdev.llama_attention'], out.stderr


def test_the_kernels_of_masks_still_import_from_masks():
    "pick_kernel, flex_mode, unpad ... moved from masks to kernels, their own module; the old import path still works."
    import subprocess, sys
    code = ("from selfattn_nbdev.masks import pick_kernel, flex_mode, attention_kernel, unpad, varlen_attend\n"
            "import selfattn_nbdev.masks as m, selfattn_nbdev.kernels as k\n"
            "assert all(getattr(m, n) is getattr(k, n) for n in k.__all__)\n"
            "names = {}; exec('from selfattn_nbdev.masks import *', names)\n"
            "assert set(k.__all__) <= set(names), set(k.__all__) - set(names)  # import * too\n"
            "print(pick_kernel.__module__, unpad.__module__)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ['selfattn_nbdev.kernels'] * 2, out.stderr
    assert 'pick_kernel' not in (PACKAGE / 'masks.py').read_text()  # written once, in kernels


def _llama(num_layers=4):
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    return Llama(vocab_size=64, context_length=64, d_model=32, num_heads=4, num_layers=num_layers).eval()


def _count_calls(monkeypatch, owner, name:str, sizes) -> list:
    "Replace owner.name by a wrapper that records the sizes of each call's arguments (a slice of them, or a function)."
    built, real = [], getattr(owner, name)
    pick = sizes if callable(sizes) else (lambda a: a[sizes])
    monkeypatch.setattr(owner, name, lambda *a, **k: built.append(pick(a)) or real(*a, **k))
    return built


def _dense_masks_built(monkeypatch) -> list:
    "(T, S) of each dense mask a mask_mod is asked for: masks._ask, which dense_mask and a forward's scope call."
    from selfattn_nbdev import kernels, masks
    return _count_calls(monkeypatch, masks, '_ask', lambda a: (len(a[1]), len(a[2])))


def test_a_models_forward_builds_a_mask_mods_dense_mask_once(monkeypatch):
    """The model builds the mask once a forward, its first included, and its blocks read it: one dense mask for four
    blocks, same logits; the model holds no hook, and nothing stays set after the forward."""
    from selfattn_nbdev import kernels, masks
    model, ids, window = _llama(), torch.randint(0, 64, (2, 24)), sliding_window(5)
    built = _dense_masks_built(monkeypatch)
    with torch.no_grad(): shared = model(ids, mask_mod=window)   # the model's first forward
    assert built == [(24, 24)], built
    assert kernels._switches.masks is None and not model._forward_hooks
    monkeypatch.delitem(MultiHeadAttention._model_parts, 'forward_masks')  # every block its own
    built.clear()
    with torch.no_grad(): alone = model(ids, mask_mod=window)
    assert len(built) == 4 and torch.equal(shared, alone)


def test_a_mask_mod_alone_builds_no_causal_mask_and_opens_empty_rows_once(monkeypatch):
    """Your mask_mod takes the place of causal and window: no causal mask is built, and SDPA's mask (each query
    with no key opened, zeroed after) is made once a forward for four blocks; such a query gives 0, as explicit."""
    from selfattn_nbdev import kernels, masks, multihead
    from selfattn_nbdev.kernels import attention_kernel
    model, ids = _llama(), torch.randint(0, 64, (2, 24))
    def late(b, h, q_idx, kv_idx): return (kv_idx <= q_idx) & (q_idx >= 3)  # queries 0-2: no key
    with torch.no_grad(), attention_kernel('explicit'): explicit = model(ids, mask_mod=late)
    causal_built = _count_calls(monkeypatch, multihead, 'causal_allowed', slice(0, 1))
    dense_built = _count_calls(monkeypatch, kernels, '_dense', slice(1, 3))
    with torch.no_grad(): fused = model(ids, mask_mod=late)
    assert causal_built == [] and dense_built == [(24, 24)], (causal_built, dense_built)
    assert torch.allclose(fused, explicit, atol=1e-5)



@pytest.mark.parametrize('given', ['padding', 'documents'])
def test_a_mask_mod_with_padding_or_documents_builds_its_mask_once_a_forward(monkeypatch, given):
    """With padding or packed documents beside your mask_mod, SDPA's mask is still made once a forward for four
    blocks, with no causal mask built; it equals the explicit path's, rows with no key included."""
    from selfattn_nbdev import kernels, masks, multihead
    from selfattn_nbdev.kernels import attention_kernel
    model, ids = _llama(), torch.randint(0, 64, (2, 24))
    def late(b, h, q_idx, kv_idx): return (kv_idx <= q_idx) & (q_idx >= 3)  # queries 0-2: no key
    padding = torch.zeros(2, 24, dtype=torch.bool); padding[1, :5] = True   # row 1: 5 pads on the left
    inputs = (dict(key_padding_mask=padding) if given == 'padding' else
              dict(document_ids=torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [1] * 4])))
    with torch.no_grad(), attention_kernel('explicit'): explicit = model(ids, mask_mod=late, **inputs)
    causal_built = _count_calls(monkeypatch, multihead, 'causal_allowed', slice(0, 1))
    opened = _count_calls(monkeypatch, kernels, '_dense',  # your mask_mod's, not the documents'
                          lambda a: a[1:3] if a[0] is late else None)
    with torch.no_grad(): fused = model(ids, mask_mod=late, **inputs)
    opened = [sizes for sizes in opened if sizes is not None]
    assert causal_built == [] and opened == [(24, 24)], (causal_built, opened)
    real = ~padding[..., None] if given == 'padding' else torch.ones(2, 24, 1, dtype=torch.bool)
    assert torch.allclose(fused * real, explicit * real, atol=1e-5)



@pytest.mark.parametrize('given', ['padding', 'documents', 'window and padding'])
def test_a_padded_or_packed_batch_gets_its_dense_mask_once_a_forward(monkeypatch, given):
    """Padding or documents on the dense SDPA path (a CPU, under 1,024 tokens): one mask for four blocks, built
    from the causal mask (or the window) once, and the logits of the explicit path."""
    from selfattn_nbdev import multihead
    from selfattn_nbdev.kernels import attention_kernel
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    model = Llama(vocab_size=64, context_length=64, d_model=32, num_heads=4, num_layers=4,
                  window=6 if 'window' in given else None).eval()
    ids = torch.randint(0, 64, (2, 24))
    padding = torch.zeros(2, 24, dtype=torch.bool); padding[1, :5] = True     # row 1: 5 pads on the left
    inputs = (dict(document_ids=torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [1] * 4]))
              if given == 'documents' else dict(key_padding_mask=padding))
    with torch.no_grad(), attention_kernel('explicit'): explicit = model(ids, **inputs)
    allowed = _count_calls(monkeypatch, multihead.MultiHeadAttention, '_allowed', slice(1, 3))
    with torch.no_grad(): fused = model(ids, **inputs)
    assert allowed == [(24, 24)], allowed
    real = ~padding[..., None] if 'documents' != given else torch.ones(2, 24, 1, dtype=torch.bool)
    assert torch.allclose(fused * real, explicit * real, atol=1e-5)
    allowed.clear()
    with torch.no_grad(), attention_kernel('explicit'): again = model(ids, **inputs)
    assert allowed == [(24, 24)] and torch.equal(again, explicit), allowed  # the explicit path: once too
    allowed.clear()
    with torch.no_grad(): model.blocks[0].attn(torch.randn(2, 24, 32), **inputs)  # a module alone: its own
    assert allowed == [(24, 24)]

def test_a_callers_own_padding_is_read_again_at_every_call_in_a_shared_scope():
    "shared_masks(): a padding mask the caller changes in place between two calls is read anew (not kept)."
    from selfattn_nbdev.kernels import shared_masks
    attn = _llama(1).blocks[0].attn
    x, padding = torch.randn(1, 6, 32), torch.zeros(1, 6, dtype=torch.bool)
    def anything(b, h, q_idx, kv_idx): return kv_idx <= q_idx
    with torch.no_grad(), shared_masks():
        first = attn(x, key_padding_mask=padding, mask_mod=anything)
        padding[0, :2] = True
        second = attn(x, key_padding_mask=padding, mask_mod=anything)
        alone = attn(x[:, 2:], mask_mod=anything)
    assert not torch.allclose(first[:, 2:], second[:, 2:])
    assert torch.allclose(second[:, 2:], alone, atol=1e-5)

def test_a_call_whose_later_inputs_are_all_none_asks_no_part(monkeypatch):
    "A block passes document_ids=None when it has none: the call's parts are not asked; one given is, per block."
    model, ids = _llama(), torch.randint(0, 64, (1, 12))
    asked, (names, part) = [], MultiHeadAttention._call_parts['masks']
    monkeypatch.setitem(MultiHeadAttention._call_parts, 'masks',
                        (names, lambda *a: asked.append(a[4]) or part(*a)))
    with torch.no_grad(): plain = model(ids)
    assert asked == []
    with torch.no_grad(): windowed = model(ids, mask_mod=sliding_window(3))
    assert len(asked) == 4 and not torch.allclose(plain, windowed)
    with pytest.raises(TypeError, match='unexpected keyword arguments: colour'):
        model.blocks[0].attn(torch.randn(1, 3, 32), colour=None)  # None, yet unknown


def test_nothing_is_kept_from_one_forward_to_the_next():
    "A mask_mod that reads a tensor: changed between two calls, the second call sees the change."
    from selfattn_nbdev import kernels, masks
    model, ids = _llama(2), torch.randint(0, 64, (1, 12))
    reach = torch.tensor(3)
    def near(b, h, q_idx, kv_idx): return (q_idx >= kv_idx) & (q_idx - kv_idx < reach)
    with torch.no_grad():
        first = model(ids, mask_mod=near)
        reach.fill_(12)
        second, causal_only = model(ids, mask_mod=near), model(ids)
    assert not torch.allclose(first, second) and torch.allclose(second, causal_only, atol=1e-5)
    with pytest.raises(ValueError), torch.no_grad():
        model(torch.randint(0, 64, (1, 80)), mask_mod=near)  # longer than the context: refused
    assert kernels._switches.masks is None and not model._forward_hooks  # no scope, no hook


def test_a_models_forward_builds_a_mask_mods_block_mask_once(monkeypatch):
    "FlexAttention too: one block mask of your mask_mod for the four blocks of a forward, rebuilt the next forward."
    import torch.nn.attention.flex_attention as flex
    from selfattn_nbdev.kernels import attention_kernel
    model, ids, window = _llama(), torch.randint(0, 64, (1, 24)), sliding_window(5)
    with torch.no_grad(): dense = model(ids, mask_mod=window)
    built = _count_calls(monkeypatch, flex, 'create_block_mask', slice(3, 5))
    with torch.no_grad(), attention_kernel('flex_eager'):
        first, second = model(ids, mask_mod=window), model(ids, mask_mod=window)
    assert built == [(24, 24), (24, 24)], built   # one a forward
    assert torch.allclose(first, dense, atol=1e-5) and torch.equal(first, second)


def test_shared_masks_for_a_model_of_your_own(monkeypatch):
    "shared_masks: four MultiHeadAttention layers of your own build one dense mask; outside it, one each."
    from selfattn_nbdev import kernels, masks
    torch.manual_seed(0)
    stack = [MultiHeadAttention(16, 16, 32, num_heads=4).eval() for _ in range(4)]
    x, window = torch.randn(2, 12, 16), sliding_window(3)
    def run():
        h = x
        for layer in stack: h = h + layer(h, mask_mod=window)
        return h
    built = _dense_masks_built(monkeypatch)
    with torch.no_grad():
        with kernels.shared_masks(): inside = run()
        assert len(built) == 1 and kernels._switches.masks is None
        outside = run()
    assert len(built) == 5 and torch.equal(inside, outside)


def _every_kind_of_model():
    "Models whose caches, together, are every kind a model of the package makes: (model, capacity) pairs."
    from selfattn_nbdev.deepseek_v3 import DeepSeekV3
    from selfattn_nbdev.hybrid import Gemma4, Qwen35
    torch.manual_seed(0)
    tiny = TinyGPT(64, 32, d_model=16, num_heads=2, num_layers=2)
    windowed = TinyGPT(64, 32, d_model=16, num_heads=2, num_layers=2, window=4, rope=True)
    qwen = Qwen35(64, 32, 16, 2, 4, 1, 24, 8, linear_num_key_heads=2, linear_num_value_heads=2,
                  linear_key_head_dim=8, linear_value_head_dim=8)
    gemma = Gemma4(64, 32, 16, 2, 4, 1, 24, 8, layer_types=['sliding_attention', 'full_attention'] * 2,
                   window=4, num_kv_shared_layers=2)
    latent = DeepSeekV3(64, 32, 16, 4, 2, 32, kv_rank=8, rope_dim=4, nope_dim=4, v_dim=4)
    return [(m.eval(), c) for m, c in [(tiny, None), (tiny, 32), (windowed, 32), (qwen, None), (qwen, 32),
                                       (gemma, None), (latent, None), (latent, 32)]]


def test_every_cache_keeps_one_protocol_and_a_reset_one_serves_as_a_new_one():
    """The protocol every cache keeps: num_seen, positions(num_new) after them, len (the keys it holds) and reset.
    After a reset, a cache serves a new prompt exactly as a new cache does (KV caches growing, static, ring, latent;
    recurrent and hybrid ones; a shared one and its source)."""
    kinds = set()
    for model, capacity in _every_kind_of_model():
        first, second = torch.randint(0, 64, (1, 6)), torch.randint(0, 64, (1, 9))
        caches = model.new_caches(capacity)
        with torch.no_grad(): model(first, caches)
        for cache in caches:
            kinds.add(type(cache).__name__)
            assert cache.num_seen == 6, (type(cache).__name__, cache.num_seen)
            assert torch.equal(cache.positions(2), torch.tensor([[6, 7]])), type(cache).__name__
            held = len(cache)  # its keys: every token's, a window's, or none (a state, a shared layer)
            assert held <= 6 and (held == 0) == (type(cache).__name__ in ('HybridCache', 'SharedKV')), \
                (type(cache).__name__, held)
        for cache in caches: cache.reset()
        for cache in caches: assert (cache.num_seen, len(cache)) == (0, 0), type(cache).__name__
        with torch.no_grad():  # the new prompt, then one step after it
            fresh = model.new_caches(capacity)
            again, new = model(second, caches), model(second, fresh)
            step, new_step = model(torch.tensor([[5]]), caches), model(torch.tensor([[5]]), fresh)
        assert torch.equal(again, new) and torch.equal(step, new_step), (type(model).__name__, capacity)
    assert kinds == {'KVCache', 'StaticKVCache', 'RingKVCache', 'HybridCache', 'KVSource', 'SharedKV'}, kinds


def test_a_recurrent_and_a_paged_cache_keep_the_protocol_too():
    "The caches a model does not make itself: a linear layer's alone, and one layer's view of a block pool."
    from selfattn_nbdev.linear import GatedDeltaNet, RecurrentCache
    from selfattn_nbdev.serving import BlockPool, PagedKVCache, Sequence
    torch.manual_seed(0)
    layer, cache, x = GatedDeltaNet(32, 2, 4, 8, 4).eval(), RecurrentCache(), torch.randn(2, 5, 32)
    with torch.no_grad():
        layer(torch.randn(2, 7, 32), cache=cache)
        assert (cache.num_seen, len(cache)) == (7, 0) and torch.equal(cache.positions(1), torch.tensor([[7]]))
        cache.reset()
        assert (cache.num_seen, cache.state, cache.conv) == (0, None, None)
        assert torch.equal(layer(x, cache=cache), layer(x, cache=RecurrentCache()))
    pool = BlockPool(num_blocks=4, block_size=4)
    paged = PagedKVCache(pool, 0)
    rows = [Sequence(torch.tensor([1, 2, 3]), 1, 0), Sequence(torch.tensor([4, 5, 6, 7, 8]), 1, 1)]
    for seq in rows: seq.length = len(seq.tokens)
    paged.rows = rows
    assert (paged.num_seen, len(paged)) == (5, 5)
    assert torch.equal(paged.positions(1), torch.tensor([[3], [5]]))
    paged.reset()
    assert (paged.num_seen, len(paged), paged.rows) == (0, 0, []) and rows[1].length == 5  # the sequences keep theirs


def test_a_models_forward_inside_shared_masks_leaves_the_outer_scope_open(monkeypatch):
    """A model's forward keeps its masks in its own dict: the scope around it is untouched, and a layer called after
    the model still shares its mask in that scope."""
    from selfattn_nbdev import kernels, masks
    model, ids, window = _llama(2), torch.randint(0, 64, (1, 12)), sliding_window(3)
    layer, x = MultiHeadAttention(16, 16, 32, num_heads=4).eval(), torch.randn(2, 12, 16)  # batch 2: a new mask
    with torch.no_grad(), kernels.shared_masks():
        outer = kernels._switches.masks
        for _ in range(2):
            model(ids, mask_mod=window)
            assert kernels._switches.masks is outer and outer == {}  # the model's own, not the scope's
        built = _dense_masks_built(monkeypatch)
        layer(x, mask_mod=window); layer(x, mask_mod=window)
        assert len(built) == 1
    assert kernels._switches.masks is None


def test_moved_families_still_import_from_their_old_home():
    "Gemma and DeepSeek-V3 have modules of their own; models still gives the same objects, by name and by `import *`."
    from selfattn_nbdev import deepseek_v3, gemma, pretrained
    from selfattn_nbdev.models import DeepSeekV3, Gemma, GemmaRMSNorm, LatentAttention
    assert (Gemma, GemmaRMSNorm) == (gemma.Gemma, gemma.GemmaRMSNorm)
    assert (DeepSeekV3, LatentAttention) == (deepseek_v3.DeepSeekV3, deepseek_v3.LatentAttention)
    names = {}
    exec('from selfattn_nbdev.models import *', names)
    assert set(gemma.__all__) | set(deepseek_v3.__all__) <= set(names)
    assert pretrained.FAMILIES['gemma3_text'][0] is gemma.Gemma
    assert pretrained.FAMILIES['deepseek_v3'][0] is deepseek_v3.DeepSeekV3
    from selfattn_nbdev import gemma4, hybrid  # Gemma 4 moved from the hybrid page to its own
    moved = ('GEMMA4_ROPE', 'Gemma4', 'Gemma4Attention', 'Gemma4Block', 'Gemma4RMSNorm', 'KVSource', 'SharedKV',
             'gemma4_config', 'gemma4_weight_map', 'kv_sources')
    assert set(moved) == set(gemma4.__all__) and all(getattr(hybrid, n) is getattr(gemma4, n) for n in moved)
    assert pretrained.FAMILIES['gemma4_text'][0] is gemma4.Gemma4


def test_a_window_that_holds_every_key_builds_no_mask(monkeypatch):
    "window >= T hides nothing: SDPA's causal flag, no dense mask (a Mistral prompt shorter than its window)."
    from selfattn_nbdev import multihead
    from selfattn_nbdev.kernels import attention_kernel
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    model, ids = Llama(64, 64, d_model=32, num_heads=4, num_layers=2, window=16).eval(), torch.randint(0, 64, (2, 16))
    with torch.no_grad(), attention_kernel('explicit'): explicit = model(ids)
    built = _count_calls(monkeypatch, multihead, 'causal_allowed', slice(0, 1))
    with torch.no_grad(): fused, longer = model(ids), model(torch.randint(0, 64, (2, 17)))
    assert built == [(17,)], built  # 16 tokens: none; 17: the window hides one key, one mask for both blocks
    assert torch.allclose(fused, explicit, atol=1e-5)



def test_a_windowed_model_builds_its_window_mask_once_a_forward_and_no_empty_row_check(monkeypatch):
    """A whole sequence longer than the window: one dense mask for every windowed block of a forward; causal,
    a window and documents leave no query without a key, so no row is searched for one (`any`)."""
    import torch.nn.functional as F
    from selfattn_nbdev import multihead
    from selfattn_nbdev.kernels import attention_kernel
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    model, ids = Llama(64, 64, d_model=32, num_heads=4, num_layers=4, window=5).eval(), torch.randint(0, 64, (2, 20))
    with torch.no_grad(), attention_kernel('explicit'): explicit = model(ids)
    built = _count_calls(monkeypatch, multihead, 'causal_allowed', slice(0, 1))
    searched = _count_calls(monkeypatch, torch.Tensor, 'any', lambda a: tuple(a[0].shape))
    with torch.no_grad(): fused = model(ids)
    assert built == [(20,)] and searched == [], (built, searched)
    assert torch.allclose(fused, explicit, atol=1e-5)


def test_shared_masks_shares_a_windows_mask_across_modules_of_the_same_window(monkeypatch):
    "Inside shared_masks(): modules of one causal flag and window share one dense mask; another window builds its own."
    from selfattn_nbdev import multihead
    from selfattn_nbdev.kernels import shared_masks
    torch.manual_seed(0)
    stack = [MultiHeadAttention(16, 16, 32, num_heads=4, window=w).eval() for w in (3, 3, 3, 5)]
    x = torch.randn(2, 12, 16)
    with torch.no_grad(): alone = [layer(x) for layer in stack]
    built = _count_calls(monkeypatch, multihead, 'causal_allowed', slice(0, 1))
    with torch.no_grad(), shared_masks(): shared = [layer(x) for layer in stack]
    assert built == [(12,), (12,)], built  # window 3 once, window 5 once
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))



def test_a_padded_forward_under_inference_mode_shares_its_mask_too(monkeypatch):
    "torch.inference_mode: the model's private copy of the padding has no version counter, yet one mask for 4 blocks."
    from selfattn_nbdev import multihead
    model, ids = _llama(), torch.randint(0, 64, (2, 24))
    padding = torch.zeros(2, 24, dtype=torch.bool); padding[1, :5] = True
    with torch.inference_mode():
        first = model(ids, key_padding_mask=padding)
        allowed = _count_calls(monkeypatch, multihead.MultiHeadAttention, '_allowed', slice(1, 3))
        second = model(ids, key_padding_mask=padding)
    assert allowed == [(24, 24)] and torch.equal(first, second), allowed


def test_what_a_forward_hands_its_blocks_to_share_their_masks():
    """A causal forward without inputs: nothing to share (SDPA's flag); a model with a window, a mask_mod or padding:
    a new dict each forward, in which the window's mask is made once; with caches and no inputs: none."""
    from selfattn_nbdev import kernels, masks
    from selfattn_nbdev.models import Llama
    model, ids = _llama(2), torch.randint(0, 64, (1, 12))
    torch.manual_seed(0)
    windowed = Llama(vocab_size=64, context_length=32, d_model=32, num_heads=4, num_layers=2, window=4).eval()
    seen = []
    for m in (model, windowed):
        m.blocks[-1].register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get('_forward_masks')),
                                               with_kwargs=True)
    with torch.no_grad():
        model(ids); model(ids, mask_mod=sliding_window(3))
        caches = model.new_caches()
        model(ids, caches=caches); model(ids[:, :1], caches=caches)
        windowed(ids); windowed(ids)
    plain, modded, prefill, step, first, second = seen
    assert plain is None and prefill is None and step is None, seen
    assert len(modded) == 1 and len(first) == 1  # SDPA's form of the mod's mask; the window's
    assert first is not second and len(second) == 1  # made again the next forward: nothing kept between calls
    assert kernels._switches.masks is None


def test_deepseeks_blocks_share_a_mask_mods_dense_mask(monkeypatch):
    "LatentAttention reads the model's dict too: one dense mask of your mask_mod for three blocks, the same logits."
    from selfattn_nbdev import kernels, masks
    from selfattn_nbdev.deepseek_v3 import DeepSeekV3
    torch.manual_seed(0)
    model = DeepSeekV3(50, 32, 16, 4, 3, 32, kv_rank=8, rope_dim=4, nope_dim=4, v_dim=4).eval()
    ids, window = torch.randint(0, 50, (2, 12)), sliding_window(4)
    built = _dense_masks_built(monkeypatch)
    with torch.no_grad(): shared = model(ids, mask_mod=window)
    assert built == [(12, 12)], built
    monkeypatch.delitem(MultiHeadAttention._model_parts, 'forward_masks')  # every block its own
    built.clear()
    with torch.no_grad(): alone = model(ids, mask_mod=window)
    assert len(built) == 3 and torch.equal(shared, alone)


def test_a_padded_batchs_runs_are_found_once_a_forward(monkeypatch):
    "Attended run by run, four blocks find the runs of their padding once a forward, kept in the model's dict."
    from selfattn_nbdev import kernels, masks
    from selfattn_nbdev.kernels import attention_kernel
    model, ids = _llama(), torch.randint(0, 64, (2, 24))
    padding = torch.zeros(2, 24, dtype=torch.bool); padding[1, :5] = True
    with torch.no_grad(): dense = model(ids, key_padding_mask=padding)
    found = _count_calls(monkeypatch, kernels, 'varlen_runs', slice(0, 1))
    with torch.no_grad(), attention_kernel('varlen'):
        first, second = model(ids, key_padding_mask=padding), model(ids, key_padding_mask=padding)
    assert len(found) == 2, found  # one a forward, for four blocks
    real = ~padding[..., None]
    assert torch.allclose(first * real, dense * real, atol=1e-5) and torch.equal(first, second)
