"""The transformers route hands transformers the mask it expects (page 17's hf_mask): a tensor or None, the tensor
transformers' own sdpa gets, with the package's findings beside it as `.hf`. Wherever transformers reads that tensor
(static-cache generation, Gemma 4's shared keys and values, DeepSeek-V3.2's indexer, torch.export and
torch.compile, a user's own 4-D mask), the route equals eager attention: float32, a left-padded batch of 24 tokens
whose windows are 8, logits within 1e-5 (relative) and 16 greedy tokens equal."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.hf_route import COMMON, FAMILIES, VOCAB, padded_batch, relative, tiny
from selfattn_nbdev.hf import hf_attention, hf_mask, register


@pytest.fixture(scope='module', autouse=True)
def registered():
    register()


def greedy(model, implementation: str, ids, attention_mask, **options) -> tuple:
    "16 greedy tokens and the logits of every step, with `implementation`."
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16,
                             min_new_tokens=16, output_logits=True, return_dict_in_generate=True, **options)
    return out.sequences, torch.stack(out.logits, 1)              # (b, T + 16), (b, 16, vocab)


def against_eager(model, **options) -> tuple:
    "The largest relative logit gap of generate's steps, and whether the tokens are eager's."
    ids, attention_mask = padded_batch()
    (theirs, their_logits), (ours, our_logits) = (greedy(model, name, ids, attention_mask, **options)
                                                  for name in ('eager', 'selfattn_nbdev'))
    return relative(our_logits, their_logits), torch.equal(ours, theirs)


@pytest.mark.parametrize('model_type', ['llama', 'mistral', 'qwen3', 'gemma2', 'gemma3_text', 'gpt_oss',
                                        'gemma4_text'])
def test_static_cache_generate(model_type):
    "generate(cache_implementation='static'): transformers makes the static cache's mask contiguous, then slices it."
    gap, same = against_eager(tiny(model_type), cache_implementation='static')
    assert gap <= 1e-5 and same, (gap, same)


def gemma4(shared: int):
    "A small Gemma 4 (text) of 4 layers, sliding and full in turn (windows of 8), whose last `shared` share KV."
    cfg = AutoConfig.for_model('gemma4_text', **{**COMMON, **FAMILIES['gemma4_text'], 'num_hidden_layers': 4,
                                                 'layer_types': ['sliding_attention', 'full_attention'] * 2,
                                                 'num_kv_shared_layers': shared})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation='eager').float().eval()


@pytest.mark.parametrize('use_cache', [False, True])
def test_gemma4_shares_keys_and_values_across_layers(use_cache):
    "num_kv_shared_layers=2 (Gemma 4 E2B shares in 20 layers): transformers slices the mask of the layer it reuses."
    model, (ids, attention_mask) = gemma4(2), padded_batch()
    real, logits = attention_mask.bool(), {}
    for name in ('eager', 'selfattn_nbdev'):
        model.set_attn_implementation(name)
        with torch.no_grad(): logits[name] = model(ids, attention_mask=attention_mask, use_cache=use_cache).logits
    assert relative(logits['selfattn_nbdev'][real], logits['eager'][real]) <= 1e-5
    gap, same = against_eager(model)
    assert gap <= 1e-5 and same, (gap, same)
    with torch.no_grad(): unshared = gemma4(0)(ids, attention_mask=attention_mask).logits
    assert relative(unshared[real], logits['eager'][real]) > 0.1   # the sharing changes the model: it was tested


def test_deepseek_v32_indexer_picks_the_keys():
    "DeepSeek-V3.2's indexer reads attention_mask[:, 0] and hands the keys it picked to the attention as indices."
    cfg = AutoConfig.for_model('deepseek_v32', **{**COMMON, 'num_hidden_layers': 1, 'num_key_value_heads': 4,
                                                  'q_lora_rank': 32, 'kv_lora_rank': 16, 'qk_rope_head_dim': 8,
                                                  'qk_nope_head_dim': 8, 'v_head_dim': 12, 'index_topk': 4,
                                                  'index_n_heads': 2, 'index_head_dim': 16,
                                                  'first_k_dense_replace': 1, 'head_dim': 16})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation='eager').float().eval()
    ids, attention_mask = padded_batch()
    real, logits = attention_mask.bool(), {}
    for name in ('eager', 'selfattn_nbdev'):
        model.set_attn_implementation(name)
        with torch.no_grad(): logits[name] = model(ids, attention_mask=attention_mask).logits
    assert relative(logits['selfattn_nbdev'][real], logits['eager'][real]) <= 1e-5
    gap, same = against_eager(model)
    assert gap <= 1e-5 and same, (gap, same)


@pytest.mark.heavy
def test_torch_export_and_fullgraph_compile_of_a_route_model():
    "Inside export and compile the mask goes as a tensor alone: nothing is asked of it on the host."
    model = tiny('llama', 'selfattn_nbdev')
    ids, attention_mask = padded_batch()
    real = attention_mask.bool()
    with torch.no_grad():
        want = model(ids, attention_mask=attention_mask).logits
        exported = torch.export.export(model, (ids,), dict(attention_mask=attention_mask, use_cache=False))
        got = exported.module()(ids, attention_mask=attention_mask, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend='eager')
        again = compiled(ids, attention_mask=attention_mask).logits
    model.set_attn_implementation('eager')
    with torch.no_grad(): eager = model(ids, attention_mask=attention_mask).logits
    for logits in (want, got, again):
        assert relative(logits[real], eager[real]) <= 1e-5


def test_a_users_4d_mask():
    """transformers passes a 4-D mask through as it is: a float one is added to the scores, as eager adds it, and a
    boolean one says True = attend, as sdpa reads it. Here a block-diagonal mask: two documents in one row."""
    model, T = tiny('llama'), 16
    ids = torch.randint(3, VOCAB, (1, T), generator=torch.Generator().manual_seed(2))
    doc = torch.arange(T) >= 6                                            # tokens 0-5, then 6-15
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out = {}
    for name, mask in [('eager', additive), ('selfattn_nbdev', additive), ('sdpa', allowed[None, None]),
                       ('selfattn_nbdev bool', allowed[None, None])]:
        model.set_attn_implementation(name.split()[0])
        with torch.no_grad(): out[name] = model(ids, attention_mask=mask).logits
    assert relative(out['selfattn_nbdev'], out['eager']) <= 1e-5
    assert relative(out['selfattn_nbdev bool'], out['sdpa']) <= 1e-5
    with torch.no_grad(): second = model(ids[:, 6:]).logits              # the second document alone
    assert relative(out['selfattn_nbdev bool'][:, 6:], second) <= 1e-5


def test_the_mask_is_sdpas_with_the_findings_beside_it():
    "A copy or slice of the tensor has no .hf and is computed from the tensor alone, to the same result."
    real = torch.ones(2, 12, dtype=torch.bool)
    real[1, :5] = False
    mask = hf_mask(2, 12, 12, attention_mask=real)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 12, 12) and mask.hf.known
    assert not hasattr(mask.clone(), 'hf') and not hasattr(mask[:, :, 4:], 'hf')
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 12, 8).unbind(0)
    llama = type('LlamaAttention', (), {'is_causal': True})()
    carried, alone = (hf_attention(llama, q, k, v, m)[0] for m in (mask, mask.clone()))
    torch.testing.assert_close(carried, alone, rtol=0, atol=1e-6)
    assert carried[1, :5].abs().max() == 0                                # padded queries: zeros
    assert hf_mask(2, 12, 12) is None                                     # causal, no padding: SDPA's flag


@pytest.mark.parametrize('how', ['beams', 'assisted', 'prompt lookup'])
def test_beam_search_and_speculative_decoding(how):
    """Beam search on the padded batch; speculative decoding, by a one-block draft model (routed too) or by n-grams of
    the prompt, on its unpadded first row (transformers' assisted decoding takes one row): eager's 16 tokens."""
    model, (ids, attention_mask) = tiny('llama'), padded_batch()
    if how != 'beams': ids, attention_mask = ids[:1], attention_mask[:1]
    options = {'beams': dict(num_beams=3), 'prompt lookup': dict(prompt_lookup_num_tokens=3)}.get(how, {})
    if how == 'assisted':
        torch.manual_seed(1)
        options['assistant_model'] = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            'llama', **{**COMMON, **FAMILIES['llama'], 'num_hidden_layers': 1})).float().eval()
    out = []
    for name in ('eager', 'selfattn_nbdev'):
        model.set_attn_implementation(name)
        if how == 'assisted': options['assistant_model'].set_attn_implementation(name)
        with torch.no_grad():
            out.append(model.generate(ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16,
                                      min_new_tokens=16, **options))
    assert torch.equal(*out)
