"""Every page's version of the story's module, run again.

The story grows `MultiHeadAttention`, `TinyGPT` and the caches page by page. Every method is defined once, on the
page that builds the class; a later page adds *parts*, entries of dicts that those methods read (see Develop). Here
each page's parts are put back (`as_of`: the entries of later pages taken out), the module is run on the inputs
that page supports, and compared with the package's final module on the same weights: the story's modules compute
what the package computes."""
import contextlib

import pytest
import torch

import selfattn_nbdev  # noqa: F401  (every module, so every part is in place)
from selfattn_nbdev import decoding
from selfattn_nbdev.decoding import StaticKVCache
from selfattn_nbdev.generation import KVCache, TinyGPT
from selfattn_nbdev.multihead import MultiHeadAttention

PAGES = ['multihead', 'generation', 'decoding', 'rope', 'gqa_window_rope', 'masks', 'kernels',
         'models']  # the reading order of the modules that grow the story's classes
HOME = {MultiHeadAttention: 'multihead', TinyGPT: 'generation', KVCache: 'generation', StaticKVCache: 'decoding'}
PARTS = [(MultiHeadAttention, name) for name in ('_position_rules', '_shown', '_options', '_mask_rules', '_score_rules',
                                                 '_call_parts', '_kernel_choices', '_products')]
PARTS += [(KVCache, '_forget'), (TinyGPT, '_call_parts'), (StaticKVCache, '_kinds')]  # the parts later pages add


def _fn(part):
    "The function of a part: (inputs, part), a method's name, or the part itself."
    if isinstance(part, str): return getattr(MultiHeadAttention, part)
    return part[-1] if isinstance(part, tuple) else part


def _page(f) -> int: return PAGES.index(f.__module__.rsplit('.', 1)[-1])


@contextlib.contextmanager
def as_of(page: str):
    "Put back the parts as they stand after `page`: those of later pages are not there yet."
    parts = [(getattr(owner, name), dict(getattr(owner, name))) for owner, name in PARTS]
    try:
        for table, entries in parts:
            table.clear(); table.update({k: f for k, f in entries.items() if _page(_fn(f)) <= PAGES.index(page)})
        yield
    finally:
        for table, entries in parts: table.clear(); table.update(entries)


def test_every_part_comes_from_a_page_after_its_class():
    "A part is added by a later page (or the class's own), never by an earlier one: the story reads forward."
    for owner, name in PARTS:
        table = getattr(owner, name)
        assert table, (owner.__name__, name)                       # every part is used by some page
        for entry in table.values():
            assert _page(_fn(entry)) >= PAGES.index(HOME[owner]), (owner.__name__, name, entry)


def _pair(page, **options):
    "A module of `page`'s version and the package's final one, with the same weights."
    torch.manual_seed(0)
    final = MultiHeadAttention(8, 8, 16, num_heads=2, **options).double().eval()
    with as_of(page):
        story = MultiHeadAttention(8, 8, 16, num_heads=2, **options).double().eval()
    story.load_state_dict(final.state_dict())
    return story, final


@pytest.mark.parametrize('causal', [True, False])
def test_the_multihead_page_module_is_the_final_one(causal):
    story, final = _pair('multihead', causal=causal)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    pad = torch.tensor([[False] * 6, [True] + [False] * 3 + [True] * 2])   # a padded first token: no key at all
    with torch.no_grad():
        expected = [final(x), final(x, key_padding_mask=pad), final(x, key_padding_mask=pad, return_attn_weights=True)]
        with as_of('multihead'):
            assert not MultiHeadAttention._mask_rules and not MultiHeadAttention._options   # no later part yet
            got = [story(x), story(x, key_padding_mask=pad), story(x, key_padding_mask=pad, return_attn_weights=True)]
    for a, b in zip(got[:2], expected[:2]): assert (a - b).abs().max() < 1e-12
    assert (got[2][0] - expected[2][0]).abs().max() < 1e-12 and (got[2][1] - expected[2][1]).abs().max() < 1e-12


def test_the_generation_page_cache_and_generate():
    story, final = _pair('generation')
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    with torch.no_grad():
        full = final(x)
        with as_of('generation'):
            for explicit in (False, True):
                cache, outs = KVCache(), []
                for chunk in (x[:, :4], x[:, 4:5], x[:, 5:]):
                    out = story(chunk, cache=cache, return_attn_weights=explicit)
                    outs.append(out[0] if explicit else out)
                assert (torch.cat(outs, 1) - full).abs().max() < 1e-12
    torch.manual_seed(0)
    model = TinyGPT(11, 32, d_model=16, num_heads=2).eval()
    prompt = torch.randint(0, 11, (2, 5))
    expected = decoding.generate(model, prompt, 8)
    with as_of('generation'):
        assert torch.equal(decoding.generate(model, prompt, 8), expected)
        assert torch.equal(decoding.generate(model, prompt, 8, use_cache=False), expected)
        row, stop = expected[:1], int(expected[0, 6])
        first = int((row[0, 5:] == stop).nonzero()[0]) + 5      # where row 0 writes its stop id
        stops = decoding.generate(model, prompt[:1], 8, stop_ids=stop)
        assert torch.equal(stops, row[:, :first + 1])          # it ends there
        assert [type(c) for c in model.new_caches()] == [KVCache, KVCache]
        model.train()
        list(decoding.generate_stream(model, prompt, 2))
        assert model.training                               # the caller's mode comes back


def test_the_batches_page_static_cache():
    story, final = _pair('decoding')
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    with torch.no_grad():
        full = final(x)
        with as_of('decoding'):
            cache = StaticKVCache(12)
            outs = [story(x[:, :4], cache=cache)] + [story(x[:, t:t + 1], cache=cache) for t in range(4, 9)]
            assert len(cache) == 9 and cache._keys.shape[2] == 12    # no ring before the modern page
    assert (torch.cat(outs, 1) - full).abs().max() < 1e-12


@pytest.mark.parametrize('options', [dict(num_kv_heads=1), dict(window=3), dict(rope=True),
                                     dict(num_kv_heads=1, window=3, rope=True)])
def test_the_modern_page_module_is_the_final_one(options):
    story, final = _pair('gqa_window_rope', **options)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    pad = torch.zeros(2, 9, dtype=torch.bool); pad[1, :2] = True
    with torch.no_grad():
        expected = [final(x), final(x, key_padding_mask=pad, return_attn_weights=True)[0]]
        with as_of('gqa_window_rope'):
            got = [story(x), story(x, key_padding_mask=pad, return_attn_weights=True)[0]]
            for cache in (KVCache(), StaticKVCache(12)):
                steps = torch.cat([story(x[:, :4], cache=cache)] + [story(x[:, t:t + 1], cache=cache)
                                                                    for t in range(4, 9)], 1)
                assert (steps - expected[0]).abs().max() < 1e-12
    for a, b in zip(got, expected): assert (a - b).abs().max() < 1e-12


def test_the_modern_page_tiny_gpt():
    torch.manual_seed(0)
    final = TinyGPT(11, 32, d_model=16, num_heads=2, rope=True).eval()
    tokens = torch.randint(0, 11, (2, 7))
    with as_of('gqa_window_rope'):
        torch.manual_seed(0)
        story = TinyGPT(11, 32, d_model=16, num_heads=2, rope=True).eval()
        assert story.pos_emb is None
        with torch.no_grad(): got = story(tokens)
    with as_of('generation'):
        torch.manual_seed(0)
        assert TinyGPT(11, 32, d_model=16, num_heads=2).pos_emb is not None   # the story's GPT has a table
    story.load_state_dict(final.state_dict())
    with torch.no_grad(): assert (story(tokens) - final(tokens)).abs().max() < 1e-5
    assert got.shape == (2, 7, 11)
