"""crop: a cache keeps the first tokens it has seen and forgets the rest, so that generation goes on from there (a
rejected draft, a regenerated reply). After a crop, the next tokens' logits are those of one forward over the tokens
kept, on every cache that can go back; the others refuse by name."""
import pytest
import torch

from selfattn_nbdev.caches import KVCache, RingKVCache, StaticKVCache
from selfattn_nbdev.decoding import generate
from selfattn_nbdev.generation import TinyGPT
from selfattn_nbdev.models import Llama


def _tiny(seed=0, **options):
    torch.manual_seed(seed)
    return TinyGPT(41, 64, d_model=32, num_heads=4, num_layers=2, **options).eval()


IDS = torch.randint(0, 41, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize('capacity', [None, 32], ids=['growing', 'fixed'])
@pytest.mark.parametrize('keep', [0, 5, 11, 14, -3, -14])
def test_after_a_crop_the_next_tokens_see_only_the_tokens_kept(capacity, keep):
    "14 tokens seen, cropped to `keep`, then 4 more one by one: each step's logits equal one forward over what is kept."
    model = _tiny()
    kept = keep if keep >= 0 else 14 + keep
    caches = model.new_caches(capacity)
    with torch.no_grad():
        model(IDS[:, :14], caches)
        for cache in caches: cache.crop(keep)
        assert all(len(c) == kept and c.num_seen == kept for c in caches)
        follow = torch.randint(0, 41, (2, 4), generator=torch.Generator().manual_seed(1))
        text = torch.cat([IDS[:, :kept], follow], 1)
        full = model(text)                                                      # (2, kept + 4, vocab)
        steps = [model(follow[:, i:i + 1], caches) for i in range(4)]
    assert (torch.cat(steps, 1) - full[:, kept:]).abs().max() < 1e-5


def test_crop_then_generate_on_a_padded_batch_writes_what_a_fresh_cache_writes():
    "Left padding: the columns count. A padded batch cropped back to its prompt decodes as it did the first time."
    model = _tiny(1)
    prompts = [IDS[0, :5], IDS[1, :9]]
    first = generate(model, prompts, 6, compile=False)
    from selfattn_nbdev.decoding import _batch_prompts
    ids, pads = _batch_prompts(prompts, 41, None)                              # (2, 9)
    caches = model.new_caches(32, pads)
    with torch.no_grad():
        model(ids, caches)
        for t in range(3): model(torch.full((2, 1), 7), caches)               # three tokens, then forgotten
        for cache in caches: cache.crop(8)                     # the prompt less its last column
        logits, out = model(ids[:, -1:], caches)[:, -1], []    # which comes again
        for _ in range(6):
            out.append(logits.argmax(-1))
            logits = model(out[-1][:, None], caches)[:, -1]
    assert [row[-6:].tolist() for row in first] == torch.stack(out, 1).tolist()


def test_a_compiled_cache_counter_goes_back_in_place():
    "The fixed cache's column counter is a tensor a CUDA graph reads at one address: crop writes it in place."
    model = _tiny()
    caches = model.new_caches(32)
    with torch.no_grad(): model(IDS[:, :10], caches)
    step = caches[0].step
    caches[0].crop(4)
    assert caches[0].step is step and int(step) == 4 and len(caches[0]) == 4


def test_a_window_cache_goes_back_until_it_drops_a_key_then_refuses():
    "A ring of 5 slots (a window of 5): before it wraps, crop works as on any cache; after, it names what is gone."
    torch.manual_seed(0)
    model = Llama(vocab_size=41, context_length=64, d_model=32, num_heads=4, num_layers=1, window=5).eval()
    caches = model.new_caches(32)
    with torch.no_grad():
        model(IDS[:1, :4], caches)
        assert isinstance(caches[0], RingKVCache)
        caches[0].crop(2)
        follow = IDS[:1, 10:13]
        steps = [model(follow[:, i:i + 1], caches) for i in range(3)]
        full = model(torch.cat([IDS[:1, :2], follow], 1))
        assert (torch.cat(steps, 1) - full[:, 2:]).abs().max() < 1e-5
        for i in range(3): model(IDS[:1, 15 + i:16 + i], caches)             # 8 seen, 5 held: wrapped
    with pytest.raises(ValueError, match=r"RingKVCache has dropped 3 of the 8 tokens.*cannot go back to 6"):
        caches[0].crop(6)
    caches[0].crop(8)  # keeping everything is no going back: allowed


def test_a_growing_window_cache_that_forgot_keys_refuses():
    torch.manual_seed(0)
    model = Llama(vocab_size=41, context_length=64, d_model=32, num_heads=4, num_layers=1, window=3).eval()
    caches = model.new_caches()
    with torch.no_grad():
        for t in range(8): model(IDS[:1, t:t + 1], caches)
    assert isinstance(caches[0], KVCache) and len(caches[0]) < caches[0].num_seen
    with pytest.raises(ValueError, match=r"KVCache has dropped .* of the 8 tokens .*reset\(\)"):
        caches[0].crop(-1)


@pytest.mark.parametrize('cache', [KVCache, lambda: StaticKVCache(16)], ids=['growing', 'fixed'])
@pytest.mark.parametrize('bad,error,words', [(5, ValueError, ['keep 0 to the 3 tokens seen', 'got 5']),
                                             (-4, ValueError, ['drop at most 3', 'got -4']),
                                             (1.0, TypeError, ['num_tokens must be an int', 'got 1.0']),
                                             (True, TypeError, ['num_tokens must be an int', 'got True'])])
def test_crop_names_the_argument_and_what_it_got(cache, bad, error, words):
    model, c = _tiny(), cache()
    with torch.no_grad(): model.blocks[0].attn(torch.randn(1, 3, 32), cache=c)
    with pytest.raises(error) as raised: c.crop(bad)
    assert all(w in str(raised.value) for w in words), str(raised.value)


def _qwen35():
    from selfattn_nbdev.hybrid import Qwen35
    torch.manual_seed(0)
    return Qwen35(50, 160, 32, 4, 4, num_kv_heads=2, d_hidden=64, head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  layer_types=['full_attention', 'linear_attention'] * 2).eval()


@pytest.mark.parametrize('capacity', [None, 32], ids=['growing', 'fixed'])
def test_a_hybrid_stack_keeps_all_or_nothing_and_names_the_state_that_cannot_go_back(capacity):
    """A linear block's state sums every token: crop refuses a partial crop by the cache's name; keeping every token
    changes nothing, and 0 starts again, on every block, so that the next prompt's logits are a fresh forward's."""
    model, ids = _qwen35(), torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(2))
    caches = model.new_caches(capacity)
    with torch.no_grad():
        model(ids[:, :8], caches)
        with pytest.raises(ValueError, match=r"a HybridCache sums every token into one state and cannot go back "
                                             r"to 5 of its 8 tokens: reset\(\)"):
            caches[1].crop(5)
        with pytest.raises(ValueError, match=r"cannot go back to 7 of its 8"):
            caches[1].crop(-1)
        for cache in caches: cache.crop(8)                                   # everything kept: nothing changes
        after = model(ids[:, 8:9], caches)
        assert (after - model(ids[:, :9])[:, -1:]).abs().max() < 1e-5
        for cache in caches: cache.crop(0)                                   # nothing kept: a new start
        assert all(c.num_seen == 0 for c in caches)
        again = model(ids[:, 3:12], caches)
        assert (again - model(ids[:, 3:12])).abs().max() < 1e-5


def test_gemma4_layers_that_share_keys_crop_through_their_source():
    """Gemma 4's last layers reuse an earlier layer's keys (SharedKV): cropping every cache of the model crops each
    source once, and the next token's logits are one forward over the tokens kept."""
    pytest.importorskip('transformers')
    from tests.test_gemma4 import hf_gemma4, ours_of
    model = ours_of(hf_gemma4(shared=2))
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(3))  # within the window of 8
    for capacity in (None, 32):
        caches = model.new_caches(capacity)
        with torch.no_grad():
            model(ids, caches)
            for cache in caches: cache.crop(5)
            after = model(ids[:, 6:7], caches)
            fresh = model(torch.cat([ids[:, :5], ids[:, 6:7]], 1))[:, -1:]
        assert (after - fresh).abs().max() < 1e-4, capacity


def test_a_recurrent_crop_checks_its_argument_as_a_kv_cache_does():
    from selfattn_nbdev.caches import RecurrentCache
    cache = RecurrentCache()
    with pytest.raises(TypeError, match=r"num_tokens must be an int; got 1.5"): cache.crop(1.5)
    with pytest.raises(ValueError, match=r"keep 0 to the 0 tokens seen.*got 2"): cache.crop(2)
