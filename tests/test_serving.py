"""Serving many at once (nbs/22_serving.ipynb): serve's tokens against generate's for each request alone on models
with grouped keys, RoPE and a sliding window (a tiny random Mistral that transformers built, read by from_hf), with a
pool that runs short (preemption) and prefix caching under pressure (remembered blocks reused); a PagedKVCache batch
against each row alone; what serve refuses, by name. Nothing is downloaded."""
import tempfile

import pytest
import torch

from selfattn_nbdev.decoding import generate
from selfattn_nbdev.generation import TinyGPT
from selfattn_nbdev.serving import BlockPool, PagedKVCache, Sequence, prefix_hashes, serve

transformers = pytest.importorskip('transformers')


@pytest.fixture(scope='module')
def mistral():
    "GQA (4 query heads, 2 key/value), RoPE, a window of 8 (shorter than the prompts and a block)."
    from transformers import MistralConfig, MistralForCausalLM
    from selfattn_nbdev.pretrained import from_hf
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          sliding_window=8, max_position_embeddings=256, initializer_range=0.2))
    with tempfile.TemporaryDirectory() as folder:  # from_hf reads it whole
        hf.save_pretrained(folder)
        return from_hf(folder).eval()


def requests(n=10, vocab=64, seed=0, prefix=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (prefix,), generator=g)
    return [torch.cat([shared, torch.randint(0, vocab, (int(k),), generator=g)])
            for k in torch.randint(1, 40, (n,), generator=g)]


@pytest.mark.parametrize('num_blocks,prefix_caching,prefix', [(64, False, 0), (64, True, 0), (24, False, 0),
                                                             (24, True, 20), (200, True, 20)])
def test_every_request_writes_what_it_writes_alone(mistral, num_blocks, prefix_caching, prefix):
    prompts = requests(prefix=prefix)
    stats = {}
    got = serve(mistral, prompts, 24, num_blocks=num_blocks, block_size=4, max_batch=4,
                prefix_caching=prefix_caching, stats=stats)
    for row, prompt in zip(got, prompts):
        assert torch.equal(row, generate(mistral, prompt[None], 24)[0])
    if num_blocks == 24: assert stats['preempted'] > 0          # the pool ran short
    if num_blocks == 200 and prefix_caching:  # no preemption: the shared 20 tokens computed once
        assert stats['prefill tokens'] == sum(map(len, prompts)) - 20 * (len(prompts) - 1)


def test_a_paged_batch_gives_each_row_its_logits_alone(mistral):
    pool = BlockPool(num_blocks=40, block_size=4)
    caches = [PagedKVCache(pool, i) for i in range(len(mistral.blocks))]
    rows = [Sequence(p, 1, i) for i, p in enumerate(requests(3))]
    with torch.no_grad():
        for seq in rows:
            seq.blocks = [pool.allocate() for _ in range(len(seq.tokens) // 4 + 2)]
            for c in caches: c.rows = [seq]
            mistral(torch.tensor([seq.tokens]), caches); seq.length = len(seq.tokens)
        for c in caches: c.rows = rows
        nxt = torch.tensor([[5, 6], [7, 8], [9, 10]])                       # two new tokens each
        step = mistral(nxt, caches)
        for seq, new, logits in zip(rows, nxt, step):
            whole = mistral(torch.tensor([seq.tokens + new.tolist()]))[0, -2:]
            torch.testing.assert_close(logits, whole, rtol=0, atol=1e-5)
    assert pool.held() == sum(len(s.blocks) for s in rows)


def test_prefix_hashes_name_a_block_by_its_whole_prefix():
    a, b = prefix_hashes([1, 2, 3, 4, 5, 6, 7], 2), prefix_hashes([9, 2, 3, 4], 2)
    assert len(a) == 3 and len(b) == 2 and a[1] != b[1]     # same block, other prefix
    assert prefix_hashes([1, 2, 3, 4], 2) == a[:2]


def test_serve_refuses_by_name():
    torch.manual_seed(0)
    gpt = TinyGPT(20, 64, 16, 2, 1).eval()
    ok = [torch.tensor([1, 2, 3])]
    with pytest.raises(ValueError, match='need 50 slots; num_blocks=2 of 4 hold 8'):
        serve(gpt, [torch.arange(20)], 30, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match='more than the model.s context_length=64'):
        serve(gpt, [torch.arange(20)], 60, num_blocks=64, block_size=4)
    with pytest.raises(ValueError, match='prompts must be a non-empty list'):
        serve(gpt, [], 4, num_blocks=8)
    with pytest.raises(ValueError, match=r'prompt'):
        serve(gpt, [torch.tensor([1, 99])], 4, num_blocks=8)
    with pytest.raises(ValueError, match='max_new_tokens'):
        serve(gpt, ok, 0, num_blocks=8)
    with pytest.raises(ValueError, match='num_blocks'):
        serve(gpt, ok, 4, num_blocks=0)
    with pytest.raises(TypeError, match='protocol of Generation'):
        serve(torch.nn.Linear(2, 2), ok, 4, num_blocks=8)


def test_serve_refuses_models_without_keys_of_their_own():
    from transformers import AutoConfig, AutoModelForCausalLM
    from selfattn_nbdev.pretrained import from_hf
    cfg = AutoConfig.for_model("gemma4_text", vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               global_head_dim=16, sliding_window=8, num_kv_shared_layers=2,
                               hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
                               layer_types=["sliding_attention", "full_attention"] * 2)
    with tempfile.TemporaryDirectory() as folder:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        model = from_hf(folder)
    with pytest.raises(ValueError, match='block 2 of Gemma4 has Gemma4Attention'):
        serve(model, [torch.tensor([1, 2])], 4, num_blocks=8)


def test_requests_arriving_between_steps_streamed_chunked_and_a_bad_one_refused_alone(mistral):
    from selfattn_nbdev.serving import Engine
    prompts = requests(8, seed=3)
    engine = Engine(mistral, num_blocks=30, block_size=4, max_batch=3, prefill_chunk=5)
    ids, new, arrivals = {}, {}, list(enumerate(prompts))
    with pytest.raises(ValueError, match='prompt must hold at least one token'):
        engine.add_request(torch.tensor([], dtype=torch.long), 4)
    with pytest.raises(ValueError, match='max_new_tokens'):
        engine.add_request(prompts[0], -1)
    steps = 0
    while arrivals or engine.has_work():
        if arrivals and steps % 3 == 0:                     # one request every third step
            i, p = arrivals.pop(0)
            ids[engine.add_request(p, 16)] = i
        for request, token, finished in engine.step(): new.setdefault(request, []).append(token)
        steps += 1
    for request, i in ids.items():
        want = generate(mistral, prompts[i][None], 16)[0, len(prompts[i]):]
        assert new[request] == want.tolist(), i


@pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')
def test_every_kernel_attends_over_paged_keys_as_over_contiguous_ones():
    "The explicit path (its weights too), the fused path, FlexAttention and the tiled kernel on the gathered keys."
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from selfattn_nbdev.generation import KVCache
    from selfattn_nbdev.multihead import MultiHeadAttention
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 16, 64, num_heads=4, num_kv_heads=2, rope=True).double().eval()
    lengths, T = [5, 11, 7], 3
    xs = [torch.randn(1, n + T, 16, dtype=torch.float64) for n in lengths]
    pool = BlockPool(num_blocks=24, block_size=4)
    cache = PagedKVCache(pool, 0)
    rows = [Sequence(torch.zeros(n + T, dtype=torch.long), 1, i) for i, n in enumerate(lengths)]
    pool_ids = iter(torch.randperm(24).tolist())                      # scattered blocks
    with torch.no_grad():
        for seq, x, n in zip(rows, xs, lengths):
            seq.blocks = [next(pool_ids) for _ in range((n + T) // 4 + 1)]
            cache.rows = [seq]; attn(x[:, :n], cache=cache); seq.length = n
        cache.rows = rows
        new = torch.cat([x[:, n:] for x, n in zip(xs, lengths)])       # (3, T, 16)
        fused = attn(new, cache=cache)
        explicit, weights = attn(new, cache=cache, return_attn_weights=True)  # rewrites the same
        for i, (x, n) in enumerate(zip(xs, lengths)):
            whole, whole_w = attn(x, return_attn_weights=True)
            torch.testing.assert_close(fused[i], whole[0, n:], rtol=0, atol=1e-12)
            torch.testing.assert_close(explicit[i], whole[0, n:], rtol=0, atol=1e-12)
            torch.testing.assert_close(weights[i, :, :, :n + T], whole_w[0, :, n:], rtol=0, atol=1e-12)
        # FlexAttention over the same gathered keys, the mask as a mask_mod
        q = attn._project(new, cache.positions(T))[0]                   # (3, heads, T, hd)
        keys, values, allowed = cache.update(*attn._project(new, cache.positions(T))[1:], attn)
        mask = lambda b, h, t, s: allowed[b, 0, t, s]
        block_mask = create_block_mask(mask, 3, None, T, keys.shape[2], device='cpu')
        flex = flex_attention(q, keys, values, block_mask=block_mask, enable_gqa=True)
        out = attn.out_proj(attn._merge_heads(flex))
        torch.testing.assert_close(out, fused, rtol=0, atol=1e-12)
        # the tiled kernel, tiles of 4 over the gathered keys, its tile mask from the same predicate
        from selfattn_nbdev.masks import block_mask as tile_mask
        from selfattn_nbdev.tiled import tiled_attention
        tiles = tile_mask(mask, T, keys.shape[2], block_size=4, batch=3, q_offset=0)
        rep = q.shape[1] // keys.shape[1]                              # query heads per key head
        tiled = tiled_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                block_size=4, block_mask=tiles)
        torch.testing.assert_close(attn.out_proj(attn._merge_heads(tiled)), fused, rtol=0, atol=1e-12)


def test_the_hybrid_and_latent_models_are_refused_by_name():
    from selfattn_nbdev.hybrid import Qwen35
    from selfattn_nbdev.serving import Engine
    torch.manual_seed(0)
    tiny = Qwen35(vocab_size=50, context_length=64, d_model=32, num_heads=4, num_layers=4, num_kv_heads=2,
                  d_hidden=64, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8)
    with pytest.raises(ValueError, match='block 0 of Qwen35 has'):
        Engine(tiny, num_blocks=8)


def test_the_serving_benchmark_measures_what_it_says(mistral):
    "bench/serving.py's runs on a small workload: every request's tokens, the KV share, the time order of tokens."
    from bench import serving as bench
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (int(n),), generator=g) for n in (5, 30, 12, 9)]
    w = dict(prompts=prompts, max_new=[6, 3, 9, 4], arrivals=[0.0, 0.0, 0.01, 0.02], num_blocks=64)
    alone = [generate(mistral, p[None], m, stop_ids=[])[0, len(p):].tolist() for p, m in zip(prompts, w['max_new'])]
    for run in (bench.run_engine, bench.run_padded):
        r = run(mistral, dict(w), alone)
        assert r['tokens_equal'] and r['useful_tokens'] == sum(w['max_new'])
        assert 0 < r['kv_used_over_reserved'] <= 1 and r['ttft_p50_ms'] <= r['ttft_p95_ms']
    wrong = [a[:-1] + [a[-1] + 1] for a in alone]                  # a test that can fail
    assert not bench.run_engine(mistral, dict(w), wrong)['tokens_equal']


def test_a_hash_collision_never_shares_a_block(mistral, monkeypatch):
    "Every prefix hashed alike: the tokens decide, so no request reads another's keys."
    from selfattn_nbdev import serving
    monkeypatch.setattr(serving, 'prefix_hashes', lambda tokens, size: ['same'] * (len(tokens) // size))
    prompts = requests(6, seed=5, prefix=8) + requests(4, seed=6)
    stats = {}
    got = serve(mistral, prompts, 12, num_blocks=200, block_size=4, max_batch=3, stats=stats)
    for row, prompt in zip(got, prompts):
        assert torch.equal(row, generate(mistral, prompt[None], 12)[0])
    # one name for every block: only a first block whose tokens match is shared (the 8 shared tokens' first 4)
    assert stats['prefill tokens'] == sum(map(len, prompts)) - 4 * 5


SAMPLINGS = [dict(temperature=1.0), dict(temperature=0.9, top_k=8), dict(temperature=1.2, top_p=0.8),
             dict(temperature=1.0, min_p=0.1), dict(temperature=0.8, repetition_penalty=1.5), dict(repetition_penalty=1.5)]


@pytest.mark.parametrize('num_blocks', [200, 14])
def test_sampled_requests_draw_what_they_draw_alone(mistral, num_blocks):
    "Each request's own options and generator: the same draws in a changing batch, after preemption, and alone."
    from selfattn_nbdev.serving import Engine
    prompts = requests(len(SAMPLINGS), seed=5)
    engine, new = Engine(mistral, num_blocks=num_blocks, block_size=4, max_batch=4, prefill_chunk=7), {}
    seeded = lambda i: torch.Generator().manual_seed(100 + i)
    for i, (p, s) in enumerate(zip(prompts, SAMPLINGS)):
        new[engine.add_request(p, 24, [], **s, generator=seeded(i))] = []
    for request, token, _ in engine.stream(): new[request].append(token)
    if num_blocks == 14: assert engine.stats["preempted"] > 0
    differ = 0
    for i, (p, s) in enumerate(zip(prompts, SAMPLINGS)):
        want = generate(mistral, p[None], 24, stop_ids=[], **s, generator=seeded(i))[0, len(p):].tolist()
        assert new[i] == want, (i, s)
        differ += want != generate(mistral, p[None], 24, stop_ids=[])[0, len(p):].tolist()
    assert differ >= 4                                             # sampled, not greedy


def test_bad_sampling_options_are_refused_alone(mistral):
    from selfattn_nbdev.serving import Engine
    engine, p = Engine(mistral, num_blocks=40, block_size=4), requests(2, seed=6)
    for bad, says in [(dict(temperature=-1.0), 'temperature'), (dict(top_p=1.5), 'top_p'), (dict(top_k=0), 'top_k'),
                      (dict(min_p=2.0), 'min_p'), (dict(repetition_penalty=0.0), 'repetition'),
                      (dict(generator=3), 'generator must be a torch.Generator'),
                      (dict(beams=4), 'add_request takes no beams; its sampling options are temperature')]:
        with pytest.raises((ValueError, TypeError), match=says): engine.add_request(p[0], 8, **bad)
    assert not engine.has_work()                                   # nothing was queued
    engine.add_request(p[1], 8)
    tokens = [t for _, t, _ in engine.stream()]
    assert tokens == generate(mistral, p[1][None], 8)[0, len(p[1]):].tolist()
