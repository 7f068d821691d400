"""Checkpoints from disk (nbs/13_pretrained.ipynb): `read_safetensors` against the format's own library, `from_hf` on
the folders transformers' `save_pretrained` writes (one file and sharded) for every family the package builds, against
transformers' logits (1e-5 of the largest, float32) and its greedy `generate` (16 tokens, with the package's cache);
what `from_hf` refuses, by name; and `save_hf`, which writes a model back: transformers loads it with no tensor
missing or left over and the same logits, `from_hf` reads it back to the bit, and what it refuses is named."""
import json
import re
import struct

import pytest
import torch

import transformers
from safetensors.torch import load_file, save_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from selfattn_nbdev.generation import KVCache
from selfattn_nbdev.decoding import generate
from selfattn_nbdev.pretrained import (GPT2, DeepSeekV3, Gemma, LatentAttention, Llama, deepseek_config, from_hf,
                                       gemma_config, llama_config, llama_weight_map, load_hf_state_dict,
                                       read_checkpoint, read_safetensors, save_hf, to_hf_state_dict,
                                       write_safetensors, yarn_frequencies)
from selfattn_nbdev.llama_attention import LlamaAttention, rope_frequencies

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=300, initializer_range=0.1, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
LLAMA3 = dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
# DeepSeek-V3 with dense blocks only (first_k_dense_replace = num_hidden_layers): MLA, one key and value per head
DEEPSEEK = SMALL | dict(num_key_value_heads=4, first_k_dense_replace=2, kv_lora_rank=32, q_lora_rank=48,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
YARN = dict(rope_type='yarn', rope_theta=10000.0, factor=4.0, original_max_position_embeddings=75, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32, beta_slow=1)   # half the RoPE pairs slowed; cos, sin and scores rescaled


def random_biases(model):
    "transformers starts biases at zero: random ones, so that a bias left out would show in the logits."
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('.bias'): p.normal_(0, 0.1)
    return model


FAMILIES = {  # name: (transformers' model, shard size for save_pretrained)
    'gpt2': (lambda: GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=300, n_embd=64, n_layer=2, n_head=4,
                                                initializer_range=0.1, bos_token_id=None, eos_token_id=None)), None),
    'gpt2-untied': (lambda: GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=300, n_embd=64, n_layer=2, n_head=4,
                                                       initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                                                       tie_word_embeddings=False)), '100KB'),
    'llama': (lambda: LlamaForCausalLM(LlamaConfig(**SMALL)), None),
    'llama-tied': (lambda: LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True)), '100KB'),
    'llama3-rope': (lambda: LlamaForCausalLM(LlamaConfig(**SMALL, rope_parameters=LLAMA3)), '100KB'),
    'mistral-window': (lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8, head_dim=16)), None),
    'qwen2-bias': (lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)), None),
    'qwen2-sliding-layers': (lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8,
                                                                  max_window_layers=1)), None),
    'qwen3-qk-norm': (lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=32)), '100KB'),
    'qwen3-tied': (lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True)), None),
    'llama-linear-rope': (lambda: LlamaForCausalLM(LlamaConfig(**SMALL, rope_parameters=dict(
        rope_type='linear', rope_theta=10000.0, factor=4.0))), None),
    'gemma2': (lambda: Gemma2ForCausalLM(Gemma2Config(**SMALL | dict(num_hidden_layers=4, initializer_range=0.02),
                                                      head_dim=16, sliding_window=8,
                                                      query_pre_attn_scalar=32)), '100KB'),
    'gemma2-untied': (lambda: Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=16, sliding_window=8,
                                                             query_pre_attn_scalar=16, tie_word_embeddings=False,
                                                             attn_logit_softcapping=5.0)), None),
    'gemma3': (lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **SMALL | dict(num_hidden_layers=6, initializer_range=0.02), head_dim=16, sliding_window=8,
        query_pre_attn_scalar=16, rope_parameters={'sliding_attention': dict(rope_type='default', rope_theta=1e4),
                                                   'full_attention': dict(rope_type='linear', rope_theta=1e6,
                                                                          factor=8.0)})), '100KB'),
    'deepseek-v3': (lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)), None),
    'deepseek-v3-q-proj-tied-bias': (lambda: random_biases(DeepseekV3ForCausalLM(DeepseekV3Config(
        **DEEPSEEK | dict(q_lora_rank=None, initializer_range=0.2), tie_word_embeddings=True,
        attention_bias=True))), None),   # tied, the head favours the last token: a wider start varies the text
    'deepseek-v3-not-interleaved': (lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **DEEPSEEK | dict(initializer_range=0.02), rope_interleave=False)), '100KB'),
    'deepseek-v3-yarn': (lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK, rope_parameters=YARN)), None),
}


def rel(a, b) -> float: return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope='module', params=list(FAMILIES))
def saved(request, tmp_path_factory):
    make, shard = FAMILIES[request.param]
    torch.manual_seed(0)
    theirs = make().eval()
    folder = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(folder, max_shard_size=shard or '1GB')
    assert (folder/'model.safetensors.index.json').exists() == (shard is not None)
    return request.param, theirs, folder


def test_same_logits_and_greedy_tokens(saved):
    name, theirs, folder = saved
    ours = from_hf(folder)
    assert not ours.training and not any(p.is_meta for p in ours.parameters())
    token_ids = torch.randint(0, 256, (2, 120), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(ours(token_ids), theirs(token_ids).logits) <= 1e-5, name
    prompt = token_ids[:1, :16]
    mine = generate(ours, prompt, 16)
    assert all(isinstance(c, KVCache) for c in ours.new_caches())   # generate's cache
    assert torch.equal(mine, theirs.generate(prompt, max_new_tokens=16, do_sample=False)), name
    assert len(set(mine[0, 16:].tolist())) > 3, name               # not one token repeated


def test_inference_mode_gives_no_grads_logits_and_tokens(saved):
    """Many users call a model under torch.inference_mode, whose tensors keep no version counter and refuse some
    operations: the same logits, and the same greedy tokens with a growing and a static cache, as under no_grad."""
    name, theirs, folder = saved
    ours = from_hf(folder)
    token_ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    prompt = token_ids[:, :12]
    runs = {}
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            runs[mode] = (ours(token_ids), generate(ours, prompt, 8), generate(ours, prompt, 8, static=True))
    for a, b in zip(*runs.values()): assert torch.equal(a, b), name


def test_save_hf_writes_what_transformers_and_from_hf_read(saved, tmp_path):
    name, theirs, folder = saved
    ours = from_hf(folder)
    with torch.no_grad():   # as if tuned: every tensor moves, so a tensor saved in the wrong place would show
        for p in ours.parameters(): p.add_(torch.randn_like(p), alpha=0.01)
    out = save_hf(ours, tmp_path/'tuned')
    assert sorted(p.name for p in out.iterdir()) == ['config.json', 'model.safetensors']   # no .part left
    back, info = type(theirs).from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), (name, info)                # no tensor missing, unexpected or mismatched
    token_ids = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(ours(token_ids), back.eval()(token_ids).logits) <= 1e-5, name
    again = from_hf(out)
    assert ours.state_dict().keys() == again.state_dict().keys()
    for key, t in ours.state_dict().items(): assert torch.equal(t, again.state_dict()[key]), (name, key)
    library = load_file(out/'model.safetensors')                # the format's own reader agrees
    assert library.keys() == back.state_dict().keys() - {'lm_head.weight'} | (
        {'lm_head.weight'} if 'lm_head.weight' in library else set())
    written = json.loads((out/'config.json').read_text())
    assert written['dtype'] == 'float32' and written['model_type'] == json.loads(
        (folder/'config.json').read_text())['model_type']


def test_save_hf_keeps_the_dtype_and_the_tie(tmp_path):
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True)).save_pretrained(tmp_path/'a')
    half = from_hf(tmp_path/'a', dtype='bfloat16')
    save_hf(half, tmp_path/'b')
    tensors = read_safetensors(tmp_path/'b'/'model.safetensors')
    assert 'lm_head.weight' not in tensors and {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path/'b'/'config.json').read_text())['dtype'] == 'bfloat16'
    back = from_hf(tmp_path/'b')
    assert back.head.weight is back.token_emb.weight and back.head.weight.dtype == torch.bfloat16
    # a config.json of transformers 4 names the dtype torch_dtype: that key is kept in step
    config = {**half.hf_config, 'torch_dtype': 'float32'}
    save_hf(half, tmp_path/'c', config=config)
    written = json.loads((tmp_path/'c'/'config.json').read_text())
    assert written['torch_dtype'] == written['dtype'] == 'bfloat16'


def test_save_hf_replaces_a_checkpoint_only_when_told(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(tmp_path, max_shard_size='100KB')   # sharded
    shards = sorted(p.name for p in tmp_path.glob('*.safetensors'))
    assert len(shards) > 1
    ours = from_hf(tmp_path)
    with pytest.raises(FileExistsError, match='already holds config.json, model.safetensors.index.json.*overwrite=True'):
        save_hf(ours, tmp_path)
    assert sorted(p.name for p in tmp_path.glob('*.safetensors')) == shards   # nothing touched
    with torch.no_grad(): ours.norm.weight.fill_(2.0)
    save_hf(ours, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['config.json', 'generation_config.json',
                                                          'model.safetensors']   # the old shards and index are gone
    assert torch.equal(from_hf(tmp_path).norm.weight, torch.full((64,), 2.0))   # the new file is the one read


def test_save_hf_refuses_by_name(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(tmp_path/'a')
    ours = from_hf(tmp_path/'a')
    config = ours.hf_config
    bare = Llama(vocab_size=256, context_length=300, d_model=64, num_heads=4, num_layers=2, num_kv_heads=2,
                 d_hidden=128)                                           # built by hand: no hf_config
    with pytest.raises(ValueError, match='config is None and the model has no hf_config'):
        save_hf(bare, tmp_path/'b')
    save_hf(bare, tmp_path/'b', config=config)                          # with the config, it is written
    with pytest.raises(ValueError, match=r'blocks.2.norm1.weight is \(64,\) in the config.s Llama and no such tensor'):
        save_hf(ours, tmp_path/'c', config={**config, 'num_hidden_layers': 3})
    with pytest.raises(ValueError, match=r'blocks.0.attn.W_query.weight is \(32, 64\)'):
        save_hf(ours, tmp_path/'c', config={**config, 'head_dim': 8})
    ours.extra = torch.nn.Linear(2, 2)                                  # an adapter the checkpoint has no place for
    with pytest.raises(ValueError, match=r'extra.weight is no such tensor in the config.s Llama and \(2, 2\)'):
        save_hf(ours, tmp_path/'c')
    del ours.extra
    with pytest.raises(TypeError, match="model_type makes a GPT2; got model=Llama"):
        save_hf(ours, tmp_path/'c', config={**config, 'model_type': 'gpt2', 'n_embd': 64, 'n_layer': 2,
                                            'n_head': 4, 'n_positions': 300})
    (tmp_path/'file').write_text('mine')
    with pytest.raises(NotADirectoryError, match='folder must be a directory'):
        save_hf(ours, tmp_path/'file')
    assert (tmp_path/'file').read_text() == 'mine'
    with pytest.raises(TypeError, match='folder must be a path; got NoneType'):
        save_hf(ours, None)
    with pytest.raises(TypeError, match='overwrite must be'):
        save_hf(ours, tmp_path/'d', overwrite='yes')
    assert not (tmp_path/'c').exists() and not (tmp_path/'d').exists()   # nothing made before the checks passed


def test_write_safetensors_round_trips_and_refuses_subclasses(tmp_path):
    tensors = {'f': torch.randn(3, 5), 'h': torch.randn(4).bfloat16(), 'i': torch.arange(7, dtype=torch.int16),
               'b': torch.tensor([True, False]), 'e': torch.empty(0, 3), 's': torch.tensor(2.5),
               'v': torch.randn(4, 6)[:, ::2]}                       # not contiguous: written as its values
    write_safetensors(tmp_path/'x.safetensors', tensors)
    for reader in (load_file, read_safetensors):
        got = reader(tmp_path/'x.safetensors')
        assert got.keys() == tensors.keys()
        for k, t in tensors.items(): assert torch.equal(got[k], t) and got[k].dtype == t.dtype, k
    class Shard(torch.Tensor): pass
    with pytest.raises(TypeError, match=r"tensors\['w'\] must be a plain tensor on one device; got Shard"):
        write_safetensors(tmp_path/'y.safetensors', {'w': torch.zeros(2).as_subclass(Shard)})
    assert not list(tmp_path.glob('y.safetensors*'))


def test_tied_heads_stay_tied_and_options_arrive(saved):
    name, theirs, folder = saved
    ours = from_hf(folder)
    assert (ours.head.weight is ours.token_emb.weight) == theirs.config.tie_word_embeddings
    if isinstance(ours, Gemma):
        attn = [b.attn for b in ours.blocks]
        windows = {'gemma3': [8] * 5 + [None]}.get(name, [8, None] * (len(attn) // 2))
        assert [a.window for a in attn] == windows
        assert all((a.softcap is not None) == name.startswith('gemma2') for a in attn)
        assert all((a.q_norm is not None) == (name == 'gemma3') for a in attn)
        if name == 'gemma3':   # the global block's RoPE: base 1e6, linear; the local ones: 1e4
            assert [(a.rope_base, a.rope_scaling) for a in attn[4:]] == [
                (1e4, None), (1e6, {'rope_type': 'linear', 'factor': 8.0, 'attention_factor': 1.0})]
    if isinstance(ours, Llama):
        attn = [b.attn for b in ours.blocks]
        assert all(isinstance(a, LlamaAttention) for a in attn)
        assert [a.window for a in attn] == {'mistral-window': [8, 8], 'qwen2-sliding-layers': [None, 8]}.get(
            name, [None, None])
        assert all((a.q_norm is not None) == name.startswith('qwen3') for a in attn)
        assert all((a.W_query.bias is not None) == name.startswith('qwen2') for a in attn)
        assert all((a.rope_scaling is not None) == (name in ('llama3-rope', 'llama-linear-rope')) for a in attn)
    if isinstance(ours, DeepSeekV3):
        attn = [b.attn for b in ours.blocks]
        assert all(isinstance(a, LatentAttention) for a in attn)
        assert all((a.q_rank is None) == ('q-proj' in name) for a in attn)
        assert all((a.out_proj.bias is not None) == ('bias' in name) for a in attn)
        assert all(a.interleave == ('not-interleaved' not in name) for a in attn)
        assert all((a.rope_scaling is not None) == name.endswith('yarn') for a in attn)


def test_the_options_matter():
    "Each option changes the function: a test above that passed with one ignored would be no proof."
    torch.manual_seed(0)
    x = torch.randn(1, 40, 64)
    base = LlamaAttention(64, 300, 4, 2)
    for options in [dict(rope_scaling={**LLAMA3, 'rope_type': 'llama3'}), dict(window=8), dict(qk_norm=True)]:
        other = LlamaAttention(64, 300, 4, 2, **options)
        other.load_state_dict(base.state_dict(), strict=False)
        with torch.no_grad():
            assert (other(x) - base(x)).abs().max() > 1e-3, options


@pytest.mark.parametrize('mods', ['cap', 'sinks', 'both'])
@pytest.mark.parametrize('path', ['explicit', 'fused', 'masked', 'cached'])
def test_score_modifiers_on_every_path_forward_and_backward(path, mods):
    "Capped scores and sinks against the same computed by hand in float64: outputs and every gradient."
    torch.manual_seed(0)
    cap = None if mods == 'sinks' else 3.0
    attn = LlamaAttention(32, 40, num_heads=4, num_kv_heads=2, softcap=cap, query_scale=0.2, window=6,
                          sinks=mods != 'cap').double()
    if attn.sinks is not None:
        with torch.no_grad(): attn.sinks.copy_(torch.tensor([-2.0, 0.0, 1.0, 3.0]))
    x = torch.randn(2, 10, 32, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, :2] = True                                             # two padded keys in row 1

    def by_hand(x):
        q, k, v = attn._project(x)
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
        s = q @ k.transpose(2, 3) / 8 ** 0.5                                # head_dim 8
        if cap: s = cap * torch.tanh(s / cap)
        i, j = torch.arange(10)[:, None], torch.arange(10)
        allowed = (j <= i) & (i - j < 6)
        if path == 'masked': allowed = allowed & ~pad[:, None, None, :]
        s = s.masked_fill(~allowed, -torch.inf)
        if attn.sinks is None: w = torch.softmax(s, -1).nan_to_num(0.0)
        else:   # one more term per head in the denominator, by the formula
            e = s.exp()
            w = e / (attn.sinks.exp()[:, None, None] + e.sum(-1, keepdim=True))
        return attn.out_proj(attn._merge_heads(w @ v))

    if path == 'explicit': out = attn(x, return_attn_weights=True)[0]
    elif path == 'fused': out = attn(x)
    elif path == 'masked': out = attn(x, key_padding_mask=pad)
    else:
        cache = KVCache()
        out = torch.cat([attn(x[:, :4], cache=cache)] + [attn(x[:, i:i + 1], cache=cache) for i in range(4, 10)], 1)
    expected = by_hand(x)
    if path == 'masked': out, expected = out[~pad], expected[~pad]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    mine = torch.autograd.grad(out, [x] + list(attn.parameters()), g)
    theirs = torch.autograd.grad(expected, [x] + list(attn.parameters()), g)
    for a, b in zip(mine, theirs): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_cap_changes_the_function():
    torch.manual_seed(0)
    x = torch.randn(1, 12, 32)
    plain = LlamaAttention(32, 40, 4, 2)
    capped = LlamaAttention(32, 40, 4, 2, softcap=0.5)
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad(): assert (plain(x) - capped(x)).abs().max() > 1e-3


def test_gemma_config_refuses_by_name():
    config = Gemma2Config(**SMALL, head_dim=16).to_dict()
    with pytest.raises(ValueError, match="use_bidirectional_attention=True is not supported"):
        gemma_config({**config, 'use_bidirectional_attention': True})
    with pytest.raises(ValueError, match="model_type='gemma' is not supported"):
        gemma_config({**config, 'model_type': 'gemma'})
    with pytest.raises(ValueError, match="rope_type='ntk' is not supported"):
        gemma_config({**config, 'model_type': 'gemma3_text', 'rope_parameters': {
            'full_attention': dict(rope_type='default', rope_theta=1e6),
            'sliding_attention': dict(rope_type='ntk', rope_theta=1e4, factor=2.0)}})
    local = gemma_config({**config, 'model_type': 'gemma3_text', 'rope_parameters': {   # each kind its own RoPE
        'full_attention': dict(rope_type='default', rope_theta=1e6),
        'sliding_attention': dict(rope_type='linear', rope_theta=1e4, factor=2.0)}})
    assert (local['rope_scaling'], local['local_rope_scaling']['factor']) == (None, 2.0)
    with pytest.raises(KeyError, match='no query_pre_attn_scalar'):
        gemma_config({**config, 'query_pre_attn_scalar': None})


def test_dtype_and_a_single_file(tmp_path):
    torch.manual_seed(0)
    theirs = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=32)).eval()
    theirs.save_pretrained(tmp_path)
    ours = from_hf(tmp_path/'model.safetensors', dtype=torch.float64)          # config.json beside it
    assert {p.dtype for p in ours.parameters()} == {torch.float64}
    token_ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        assert rel(ours(token_ids).float(), theirs(token_ids).logits) <= 1e-5
    bf16 = from_hf(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    # as config.json and transformers name them: a name, "torch.<name>", or "auto" (its own)
    for name, want in [('bfloat16', torch.bfloat16), ('torch.float16', torch.float16),
                       ('auto', torch.float32)]:
        assert {p.dtype for p in from_hf(tmp_path, dtype=name).parameters()} == {want}
    for bad in ['int64', 'bf16', torch.int8, 3]:  # refused by name, before any cast
        with pytest.raises(TypeError, match=r'dtype must be a floating torch\.dtype.*got'):
            from_hf(tmp_path, dtype=bad)


def test_a_state_dict_is_copied_not_taken():
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    state = theirs.state_dict()
    ours = from_hf(state, theirs.config.to_dict())
    before = state['model.embed_tokens.weight'].clone()
    with torch.no_grad(): ours.token_emb.weight.add_(1.0)
    assert torch.equal(state['model.embed_tokens.weight'], before)


def test_writes_to_loaded_weights_stay_out_of_the_file(tmp_path):
    "The mapping is private: training the loaded model never changes the checkpoint."
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(tmp_path)
    before = (tmp_path/'model.safetensors').read_bytes()
    ours = from_hf(tmp_path)
    with torch.no_grad():
        for p in ours.parameters(): p.mul_(2.0)
    del ours
    assert (tmp_path/'model.safetensors').read_bytes() == before


def test_saving_one_loaded_weight_writes_its_bytes_not_the_file(tmp_path):
    """Each tensor read is a storage of its own over its bytes of the mapped file: torch.save of one weight writes
    that weight (a view of one storage of the whole file wrote all of it: 431,017 bytes for a 256-byte norm)."""
    import io
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    file_bytes = (tmp_path/'model.safetensors').stat().st_size
    for p in (ours.norm.weight, ours.blocks[0].attn.W_query.weight):
        buffer = io.BytesIO(); torch.save(p, buffer)
        assert len(buffer.getvalue()) < p.nbytes + 4096 < file_bytes
    assert len({p.untyped_storage().data_ptr() for p in ours.parameters()}) == len(list(ours.parameters()))


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_read_safetensors_equals_the_library(tmp_path, dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    save_file({'t': t, 'scalar': t[0, 0].clone(), 'empty': t[:0]}, tmp_path/'x.safetensors')
    ours, theirs = read_safetensors(tmp_path/'x.safetensors'), load_file(tmp_path/'x.safetensors')
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape
        assert torch.equal(ours[name].reshape(-1).view(torch.uint8), theirs[name].reshape(-1).view(torch.uint8))


def write_by_hand(path, header: dict, payload: bytes):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack('<Q', len(text)) + text + payload)


def test_a_misaligned_tensor_is_copied(tmp_path):
    "A float32 tensor that starts one byte in: still read right (the reader copies it)."
    write_by_hand(tmp_path/'m.safetensors', {'a': dict(dtype='U8', shape=[1], data_offsets=[0, 1]),
                                             'b': dict(dtype='F32', shape=[2], data_offsets=[1, 9])},
                  b'\x07' + struct.pack('<2f', 1.5, -2.0) + b'\x00' * 7)
    t = read_safetensors(tmp_path/'m.safetensors')
    assert t['a'].tolist() == [7] and t['b'].tolist() == [1.5, -2.0]


def test_what_is_refused_is_named(tmp_path):
    write_by_hand(tmp_path/'f4.safetensors', {'a': dict(dtype='F4', shape=[2], data_offsets=[0, 1])}, b'\x00')
    with pytest.raises(ValueError, match='dtype F4'): read_safetensors(tmp_path/'f4.safetensors')
    (tmp_path/'junk.safetensors').write_bytes(b'\xff' * 32)
    with pytest.raises(ValueError, match='is not a safetensors file'): read_safetensors(tmp_path/'junk.safetensors')
    pickled = tmp_path/'pickled'; pickled.mkdir()
    (pickled/'pytorch_model.bin').write_bytes(b'not read'); (pickled/'config.json').write_text('{}')
    with pytest.raises(FileNotFoundError, match=r'\.bin files would be unpickled'): from_hf(pickled)
    with pytest.raises(FileNotFoundError, match='must be a state dict'): from_hf(tmp_path/'nothing.pt')
    with pytest.raises(TypeError, match='got int'): from_hf(3)
    with pytest.raises(ValueError, match='no config.json is beside'): from_hf({'a': torch.zeros(1)})
    config = LlamaConfig(**SMALL).to_dict()
    for kind in ('gemma', 'deepseek_v2', 'mixtral'):
        with pytest.raises(ValueError, match=f"model_type='{kind}' is not supported"):
            from_hf({}, {**config, 'model_type': kind})
    with pytest.raises(KeyError, match='no model_type'):
        from_hf({}, {k: v for k, v in config.items() if k != 'model_type'})
    with pytest.raises(ValueError, match='layer_types must list'):
        from_hf({}, {**config, 'model_type': 'qwen2', 'use_sliding_window': True, 'sliding_window': 8,
                     'layer_types': ['full_attention']})
    with pytest.raises(ValueError, match="rope_type='ntk' is not supported"):
        LlamaAttention(64, 300, 4, rope_scaling={'rope_type': 'ntk', 'factor': 4.0})
    with pytest.raises(AttributeError, match='rope_scaling is fixed'):
        LlamaAttention(64, 300, 4).rope_scaling = {'factor': 2.0}


def test_rope_frequencies_blend_between_the_thresholds():
    "Below L/high kept, above L/low divided by the factor, monotone in between (float64)."
    s = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    theta = rope_frequencies(128, 500000.0, dtype=torch.float64)
    scaled = rope_frequencies(128, 500000.0, s, dtype=torch.float64)
    wavelength = 2 * torch.pi / theta
    assert torch.equal(scaled[wavelength < 2048], theta[wavelength < 2048])
    torch.testing.assert_close(scaled[wavelength > 8192], theta[wavelength > 8192] / 8, rtol=1e-15, atol=0)
    ratio = theta / scaled
    assert (ratio[1:] >= ratio[:-1]).all()


def test_read_checkpoint_returns_the_config(tmp_path):
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    tensors, config = read_checkpoint(tmp_path)
    assert config['model_type'] == 'gpt2' and 'transformer.h.0.attn.c_attn.weight' in tensors
    assert isinstance(from_hf(tmp_path), GPT2)


def test_from_hf_takes_a_transformers_config_as_it_is():
    "A model's own config object (what `model.config` holds) is read as its dict: the same model, the same logits."
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    a, b = from_hf(theirs.state_dict(), theirs.config), from_hf(theirs.state_dict(), theirs.config.to_dict())
    token_ids = torch.randint(0, SMALL['vocab_size'], (1, 9))
    with torch.no_grad(): assert torch.equal(a(token_ids), b(token_ids))
    assert a.hf_config == theirs.config.to_dict()
    with pytest.raises(TypeError, match='config must be a dict'): from_hf(theirs.state_dict(), ['not', 'a', 'config'])


def test_deepseek_refuses_routed_experts_and_the_rest_by_name():
    "MoE is not attention: a DeepSeek-V3 config with routed experts is refused, naming the setting and its value."
    config = DeepseekV3Config(**DEEPSEEK).to_dict()
    for dense in (0, 1, None):
        with pytest.raises(ValueError, match=f"first_k_dense_replace={dense} < num_hidden_layers=2.*MoE is not"):
            from_hf({}, {**config, 'first_k_dense_replace': dense})
    assert deepseek_config({**config, 'first_k_dense_replace': 3})['num_layers'] == 2   # more than the blocks: dense
    with pytest.raises(ValueError, match="rope_type='linear' is not supported"):
        deepseek_config({**config, 'rope_parameters': dict(rope_type='linear', rope_theta=1e4, factor=2.0)})
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not supported"):
        deepseek_config({**config, 'num_key_value_heads': 2})
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        deepseek_config({**config, 'hidden_act': 'gelu'})
    with pytest.raises(ValueError, match="'yarn' needs a factor >= 1"):
        deepseek_config({**config, 'rope_parameters': {**YARN, 'factor': 0.5}})
    computed = deepseek_config({**config, 'rope_parameters': {**YARN, 'factor': None}})   # as transformers: 300 / 75
    assert computed['rope_scaling']['factor'] == 4.0
    with pytest.raises(KeyError, match='no kv_lora_rank'):
        deepseek_config({**config, 'kv_lora_rank': None})


def test_deepseek_yarn_frequencies_and_scales_equal_transformers():
    "YaRN's frequencies, its factor on cos and sin, and the score scale, against transformers' own numbers."
    theirs = DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK | dict(qk_rope_head_dim=32), rope_parameters=YARN))
    ours = DeepSeekV3(**deepseek_config(theirs.config.to_dict()))
    rotary = theirs.model.rotary_emb
    torch.testing.assert_close(yarn_frequencies(32, 1e4, YARN), rotary.inv_freq, rtol=1e-6, atol=0)
    attn = ours.blocks[0].attn
    assert attn.rope_scaling['attention_factor'] == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert attn.scale == pytest.approx(theirs.model.layers[0].self_attn.scaling, rel=1e-12)
    ramp = yarn_frequencies(32, 1e4, YARN) / yarn_frequencies(32, 1e4)
    assert ramp[0] == 1 and ramp[-1] == 0.25 and ((0.25 < ramp) & (ramp < 1)).any()   # kept, slowed, between


def test_deepseek_cache_keeps_the_latent_and_padded_prompts_work():
    "The cache holds d_c + d_R numbers a token; prompts of different lengths (StaticKVCache, pads) each get their own."
    torch.manual_seed(0)
    theirs = DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)).eval()
    ours = from_hf(theirs.state_dict(), theirs.config.to_dict())
    token_ids = torch.randint(0, 256, (1, 20))
    caches = ours.new_caches()
    with torch.no_grad(): ours(token_ids, caches)
    assert caches[0].keys.numel() + caches[0].values.numel() == 20 * (32 + 8)
    prompts = [token_ids[0, :12], token_ids[0, :5]]
    together = generate(ours, prompts, 8)
    for prompt, row in zip(prompts, together):
        assert torch.equal(row, theirs.generate(prompt[None], max_new_tokens=8, do_sample=False)[0])


def test_end_of_text_ids_come_from_the_folder(tmp_path):
    "eos_token_id of config.json, an id or a list; generation_config.json's when it is there, as transformers reads it."
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(LlamaConfig(**SMALL | dict(eos_token_id=5))).eval()
    theirs.save_pretrained(tmp_path)                     # generation_config.json: 5 as well
    assert from_hf(tmp_path).eos_token_ids == [5]
    assert from_hf(theirs.state_dict(), theirs.config).eos_token_ids == [5]
    generation = tmp_path/'generation_config.json'
    generation.write_text('{}')                          # transformers' generate: no end then
    assert from_hf(tmp_path).eos_token_ids is None
    generation.unlink()
    assert from_hf(tmp_path).eos_token_ids == [5]
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    free = generate(from_hf(tmp_path), prompt, 12, stop_ids=[])   # an end id the model writes: its fifth new token
    generation.write_text(json.dumps({'eos_token_id': [int(free[0, 12]), 255, 256]}))
    ours, theirs = from_hf(tmp_path), LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert ours.eos_token_ids == [int(free[0, 12]), 255]   # 256, past the vocabulary, is never written
    assert theirs.generation_config.eos_token_id == [int(free[0, 12]), 255, 256]
    stopped = generate(ours, prompt, 12)                 # generate stops there by default
    assert stopped.shape[1] < 20 and torch.equal(stopped, theirs.generate(prompt, max_new_tokens=12, do_sample=False))
    assert torch.equal(generate(ours, prompt, 12, stop_ids=[]), free)   # unless told otherwise


def test_context_length_sizes_the_rope_table(tmp_path):
    "RoPE's table for context_length positions instead of max_position_embeddings; GPT-2's learned table is refused."
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    theirs.save_pretrained(tmp_path)
    short = from_hf(tmp_path, context_length=40)
    token_ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): assert rel(short(token_ids), theirs(token_ids).logits) <= 1e-5
    assert short.context_length == 40 and short.blocks[0].attn._rope_cache[0].shape == (40, 16)
    with pytest.raises(ValueError, match='more than context_length=40'): short(torch.zeros(1, 41, dtype=torch.long))
    long = from_hf(tmp_path, context_length=600)         # past max_position_embeddings=300, as transformers runs it
    token_ids = torch.randint(0, 256, (1, 500), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(): assert rel(long(token_ids), theirs(token_ids).logits) <= 1e-5
    with pytest.raises(ValueError, match='context_length'): from_hf(tmp_path, context_length=0)
    gpt2 = tmp_path/'gpt2'
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(gpt2)
    with pytest.raises(ValueError, match='context_length=64: GPT-2 learned a vector for each of its n_positions=32'):
        from_hf(gpt2, context_length=64)


def test_a_hub_id_says_how_to_get_the_folder(tmp_path):
    for hub_id in ('Qwen/Qwen3-0.6B', 'gpt2'):
        with pytest.raises(FileNotFoundError, match=rf"source='{re.escape(hub_id)}'.*never downloads.*`hf download "
                                                    rf"{re.escape(hub_id)} --local-dir .*snapshot_download"):
            from_hf(hub_id)
    with pytest.raises(FileNotFoundError, match='must be a state dict'): from_hf(str(tmp_path/'absent.safetensors'))


def test_experts_and_other_families_are_sent_to_transformers():
    route = r"load it with transformers: `from selfattn_nbdev.hf import register; register\(\)`, then " \
            r"`AutoModelForCausalLM.from_pretrained\(folder, attn_implementation=\"selfattn_nbdev\"\)`"
    config = DeepseekV3Config(**DEEPSEEK).to_dict()
    with pytest.raises(ValueError, match='MoE is not attention.*' + route):
        from_hf({}, {**config, 'first_k_dense_replace': 1})
    with pytest.raises(ValueError, match="model_type='mixtral' is not supported.*" + route):
        from_hf({}, {**LlamaConfig(**SMALL).to_dict(), 'model_type': 'mixtral'})


def saved_llama(folder, shard=None):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(folder, max_shard_size=shard or '1GB')
    return folder


def test_a_damaged_file_is_named(tmp_path):
    "Cut short, a header that is not JSON, a tensor past the end or of the wrong size: each named, with its file."
    path = saved_llama(tmp_path)/'model.safetensors'
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: tensor \S+ F32.* truncated or damaged"):
        from_hf(tmp_path)
    n = int.from_bytes(whole[:8], 'little')
    path.write_bytes(whole[:8] + b'x' * n + whole[8 + n:])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: its header is not JSON"): from_hf(tmp_path)
    write_by_hand(tmp_path/'past.safetensors', {'a': dict(dtype='F32', shape=[4], data_offsets=[0, 16])}, b'\x00' * 8)
    with pytest.raises(ValueError, match=r'tensor a F32\[4\] needs 16 bytes and lies at bytes \d+ to \d+ of a file'):
        read_safetensors(tmp_path/'past.safetensors')
    write_by_hand(tmp_path/'size.safetensors', {'a': dict(dtype='F32', shape=[3], data_offsets=[0, 8])}, b'\x00' * 8)
    with pytest.raises(ValueError, match='tensor a F32\\[3\\] needs 12 bytes'): read_safetensors(tmp_path/'size.safetensors')


def test_a_missing_shard_is_named(tmp_path):
    folder = saved_llama(tmp_path, '100KB')
    index = folder/'model.safetensors.index.json'
    weight_map = json.loads(index.read_text())['weight_map']
    shards = sorted(set(weight_map.values()))
    (folder/shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf'names 1 shard\(s\) that .* does not hold: {shards[1]};'):
        from_hf(folder)
    saved_llama(folder, '100KB')
    name = next(k for k, v in weight_map.items() if v == shards[0])   # the index puts a tensor where it is not
    index.write_text(json.dumps({'weight_map': weight_map | {name: shards[1]}}))
    with pytest.raises(ValueError, match=rf'puts {re.escape(name)} in {shards[1]}, which does not hold it'):
        from_hf(folder)
    index.write_text('{"weight_map": ')
    with pytest.raises(ValueError, match='must be JSON with a weight_map'): from_hf(folder)


def test_a_tensor_of_another_shape_names_its_file_and_loads_nothing(tmp_path):
    folder = saved_llama(tmp_path, '100KB')
    config = json.loads((folder/'config.json').read_text())
    (folder/'config.json').write_text(json.dumps(config | {'intermediate_size': 96}))
    with pytest.raises(ValueError, match=r'layers.0.mlp.gate_proj.weight \(in model-\d+-of-\d+.safetensors\) gives '
                                         r'blocks.0.mlp.gate.weight the shape \(128, 64\); the model built from the '
                                         r'config has \(96, 64\)'):
        from_hf(folder)
    model = Llama(**llama_config(config))                 # a model of its own: a misfit leaves it as it was
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state, _ = read_checkpoint(folder)
    state['model.norm.weight'] = torch.zeros(3)          # the last tensor of the map does not fit
    with pytest.raises(ValueError, match='norm.weight gives norm.weight the shape'):
        load_hf_state_dict(model, state, llama_weight_map(2), 'model.')
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize('kind', ['gemma3', 'gemma4'])
def test_the_language_model_of_an_image_and_text_checkpoint(kind, tmp_path):
    """Gemma 3's and Gemma 4's checkpoints as the hub holds them, a vision tower beside the language model (Gemma 3's
    in the layout it was published in, language_model.model.; Gemma 4's model.language_model.): from_hf builds the
    language model, equal to transformers' model of the whole checkpoint on text, and leaves the tower unread."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
                layer_types=['sliding_attention', 'full_attention'])
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    towers = dict(vision_config=vision | (dict(image_size=32, patch_size=8) if kind == 'gemma3' else dict(head_dim=16)))
    torch.manual_seed(0)
    theirs = AutoModelForImageTextToText.from_config(AutoConfig.for_model(kind, text_config=text, **towers)).eval()
    with torch.no_grad():
        for p in theirs.parameters(): p.add_(torch.randn_like(p) * 0.05)   # away from init (norms of 0 or 1)
    theirs.save_pretrained(tmp_path)
    names = read_checkpoint(tmp_path)[0]
    assert [n for n in names if 'vision_tower.' in n]                           # a tower there to leave unread
    ours = from_hf(tmp_path)
    assert ours.hf_config['model_type'] == f'{kind}_text'
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(ours(ids), theirs(input_ids=ids).logits) < 1e-5
