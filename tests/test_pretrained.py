"""GPT-2 and Llama built from the package's modules against transformers' own models (random weights from small
configs, never the hub): same logits in float32, same greedy tokens over 256 steps with the KV cache; the loaders'
errors; `from_torch_multihead` and `to_torch_multihead` round trips."""
import pytest
import torch
from torch import nn

import transformers  # a pinned development dependency: the proofs must run, never be skipped
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from selfattn_nbdev.causal import causal_allowed  # noqa: E402
from selfattn_nbdev.decoding import generate  # noqa: E402
from selfattn_nbdev.multihead import MultiHeadAttention, to_torch_multihead
from selfattn_nbdev.generation import KVCache  # noqa: E402
from selfattn_nbdev.pretrained import (GPT2, Llama, from_torch_multihead, gpt2_config, gpt2_from_hf,  # noqa: E402
                                       gpt2_weight_map, llama_config, llama_from_hf, load_hf_state_dict)

transformers.utils.logging.set_verbosity_error()
VOCAB, CONTEXT, PROMPT, NEW = 256, 300, 16, 256


def hf_gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4,
                                      initializer_range=0.1, bos_token_id=None, eos_token_id=None)).eval()


def hf_llama(rope_theta, seed=0, **extra):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                        rope_theta=rope_theta, initializer_range=0.1, bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None, **extra)).eval()


CASES = {'gpt2': (hf_gpt2, gpt2_from_hf), 'llama-theta-1e4': (lambda: hf_llama(10000.0), llama_from_hf),
         'llama-theta-5e5': (lambda: hf_llama(500000.0), llama_from_hf),
         'llama-tied': (lambda: hf_llama(10000.0, tie_word_embeddings=True), llama_from_hf)}


def rel(a, b) -> float: return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope='module', params=list(CASES))
def pair(request):
    make, load = CASES[request.param]
    theirs = make()
    return theirs, load(theirs.state_dict(), theirs.config.to_dict())


def test_same_logits(pair):
    theirs, ours = pair
    token_ids = torch.randint(0, VOCAB, (2, PROMPT + NEW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(ours(token_ids), theirs(token_ids).logits) <= 1e-5


def test_same_greedy_tokens_with_the_cache(pair):
    theirs, ours = pair
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    mine = generate(ours, prompt, NEW, use_cache=True)
    ref = theirs.generate(prompt, max_new_tokens=NEW, do_sample=False)
    assert mine.shape == (1, PROMPT + NEW)
    assert torch.equal(mine, ref)
    assert len(set(mine[0, PROMPT:].tolist())) > 5  # not one token repeated: a proof that could fail


def test_logits_step_by_step_with_the_cache(pair):
    "Each cached step's logits against transformers' full forward on the whole prefix."
    theirs, ours = pair
    token_ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    caches = ours.new_caches()
    assert all(isinstance(c, KVCache) for c in caches)
    with torch.no_grad():
        full = theirs(token_ids).logits                                  # (1, 40, vocab)
        steps = [ours(token_ids[:, :8], caches)] + [ours(token_ids[:, i:i + 1], caches) for i in range(8, 40)]
    assert rel(torch.cat(steps, dim=1), full) <= 1e-5


def test_structure():
    gpt2 = gpt2_from_hf(hf_gpt2().state_dict(), hf_gpt2().config.to_dict())
    assert isinstance(gpt2, GPT2) and gpt2.head.weight is gpt2.token_emb.weight
    assert gpt2.blocks[0].attn.W_query.bias is not None and not gpt2.training
    llama = llama_from_hf(hf_llama(500000.0).state_dict(), hf_llama(500000.0).config.to_dict(), context_length=64)
    attn = llama.blocks[1].attn
    assert isinstance(llama, Llama) and llama.context_length == 64 and llama.pos_emb is None
    assert (attn.num_heads, attn.num_kv_heads, attn.rope, attn.rope_base) == (4, 2, True, 500000.0)
    assert attn.out_proj.bias is None and attn.W_key.bias is None
    assert llama.head.weight is not llama.token_emb.weight


def test_checkpoint_without_prefix_and_with_buffers():
    "The hub's gpt2 files have no `transformer.` prefix and may hold the causal-mask buffers."
    theirs = hf_gpt2()
    bare = {k.removeprefix('transformer.'): v for k, v in theirs.state_dict().items() if k != 'lm_head.weight'}
    bare['h.0.attn.bias'] = torch.ones(1, 1, CONTEXT, CONTEXT)
    ours = gpt2_from_hf(bare, theirs.config.to_dict())
    token_ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad(): assert rel(ours(token_ids), theirs(token_ids).logits) <= 1e-5


def test_loader_errors_name_the_first_misfit():
    theirs = hf_gpt2()
    state, config = theirs.state_dict(), theirs.config.to_dict()
    model = GPT2(**gpt2_config(config))
    table = gpt2_weight_map(2)
    with pytest.raises(KeyError, match='no transformer.h.1.attn.c_attn.weight'):
        load_hf_state_dict(model, {k: v for k, v in state.items() if 'h.1.attn.c_attn.weight' not in k}, table,
                           'transformer.')
    bad = {**state, 'transformer.h.0.attn.c_attn.bias': torch.zeros(190)}
    with pytest.raises(ValueError, match=r'h.0.attn.c_attn.bias gives blocks.0.attn.W_value.bias the shape \(62,\)'):
        load_hf_state_dict(model, bad, table, 'transformer.')
    with pytest.raises(KeyError, match='no place for; the first: transformer.extra'):
        load_hf_state_dict(model, {**state, 'transformer.extra': torch.zeros(1)}, table, 'transformer.')
    untied = {**state, 'lm_head.weight': torch.zeros_like(state['lm_head.weight'])}
    with pytest.raises(ValueError, match='lm_head.weight differs from the token table'):
        load_hf_state_dict(model, untied, table, 'transformer.')
    with pytest.raises(KeyError, match='no n_layer'):
        gpt2_from_hf(state, {k: v for k, v in config.items() if k != 'n_layer'})
    for key, value in [('activation_function', 'relu'), ('n_inner', 100), ('scale_attn_by_inverse_layer_idx', True),
                       ('add_cross_attention', True)]:
        with pytest.raises(ValueError, match=f'{key}={value!r} is not supported'):
            gpt2_config({**config, key: value})


def test_llama_config_refuses_what_it_lacks():
    config = hf_llama(10000.0).config.to_dict()
    assert llama_config(config)['rope_base'] == 10000.0
    old_style = {k: v for k, v in config.items() if k != 'rope_parameters'} | {'rope_theta': 500000.0}
    assert llama_config(old_style)['rope_base'] == 500000.0            # transformers 4's config.json layout
    llama31 = {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
               'original_max_position_embeddings': 8192, 'rope_type': 'llama3'}
    assert llama_config({**old_style, 'rope_scaling': llama31})['rope_scaling']['factor'] == 8.0
    with pytest.raises(ValueError, match="rope_type='ntk' is not supported"):
        llama_config({**config, 'rope_parameters': {'rope_theta': 1e4, 'rope_type': 'ntk', 'factor': 2.0}})
    dynamic = llama_config({**config, 'rope_parameters': {'rope_theta': 1e4, 'rope_type': 'dynamic', 'factor': 2.0}})
    assert dynamic['rope_scaling']['original_max_position_embeddings'] == CONTEXT   # dynamic's L: max_position_embeddings
    with pytest.raises(ValueError, match='partial_rotary_factor=0.5 is not supported'):
        llama_config({**config, 'partial_rotary_factor': 0.5})
    with pytest.raises(ValueError, match="needs a number for each"):
        llama_config({**old_style, 'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0}})
    assert llama_config({**old_style, 'rope_scaling': {'rope_type': 'default'}})['rope_base'] == 500000.0
    for key, value in [('hidden_act', 'gelu'), ('attention_bias', True), ('mlp_bias', True)]:
        with pytest.raises(ValueError, match=f'{key}={value!r} is not supported'):
            llama_config({**config, key: value})
    with pytest.raises(ValueError, match="model_type='gemma2' is not supported"):
        llama_config({**config, 'model_type': 'gemma2'})
    with pytest.raises(KeyError, match='no intermediate_size'):
        llama_config({**config, 'intermediate_size': None})
    state = hf_llama(10000.0).state_dict()
    with pytest.raises(KeyError, match='no model.layers.1.mlp.up_proj.weight'):
        llama_from_hf({k: v for k, v in state.items() if 'layers.1.mlp.up' not in k}, config)


@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('causal', [True, False])
def test_from_torch_multihead_round_trip(bias, causal):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(24, 3, bias=bias, batch_first=True).eval()
    ours = from_torch_multihead(ref, context_length=12, causal=causal)
    assert not ours.training and ours.causal == causal and (ours.W_query.bias is not None) == bias
    x = torch.randn(2, 12, 24)
    mask = ~causal_allowed(12) if causal else None
    expected, _ = ref(x, x, x, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-6)
    back = to_torch_multihead(ours)                                  # to PyTorch again: the same weights
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], p, rtol=0, atol=0)
    if not bias: assert back.in_proj_bias.abs().max() == 0           # to_torch_multihead writes zero biases
    again = from_torch_multihead(to_torch_multihead(ours), 12, causal)  # ours -> PyTorch -> ours: same outputs
    torch.testing.assert_close(again(x), ours(x), rtol=0, atol=0)


def test_from_torch_multihead_keeps_dtype_dropout_and_mode():
    ref = nn.MultiheadAttention(8, 2, dropout=0.25, dtype=torch.float64)
    ours = from_torch_multihead(ref, 5)
    assert ours.W_query.weight.dtype == torch.float64 and ours.dropout.p == 0.25 and ours.training
    assert isinstance(ours, MultiHeadAttention) and ours.causal


@pytest.mark.parametrize('kwargs,name', [(dict(kdim=4), 'kdim/vdim'), (dict(vdim=4), 'kdim/vdim'),
                                         (dict(add_bias_kv=True), 'add_bias_kv'),
                                         (dict(add_zero_attn=True), 'add_zero_attn')])
def test_from_torch_multihead_refuses(kwargs, name):
    with pytest.raises(ValueError, match=f'cannot express {name}'):
        from_torch_multihead(nn.MultiheadAttention(8, 2, **kwargs), 5)
    with pytest.raises(TypeError, match='must be an nn.MultiheadAttention; got Linear'):
        from_torch_multihead(nn.Linear(8, 8), 5)
