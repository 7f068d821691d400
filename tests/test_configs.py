"""Configs read as transformers reads them. A published config.json leaves out every setting equal to its config
class's default and every setting transformers derives (layer types, head sizes, RoPE's fields): for each family the
package builds, a small random model of transformers is saved, its config.json cut down to what still gives
transformers the same config (generically: a key goes when leaving it out changes nothing), and `from_hf` must give
transformers' logits (1e-5 of the largest, float32) on a text longer than the windows. Then RoPE's rescalings on
Llama-shaped models past their original length (with the cache too), the gpt-oss attention layer, and the two cases
of ../shared/cases (Qwen2's sliding layers, GPT-2's untied head)."""
import json

import pytest
import torch

import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

import selfattn_nbdev.hybrid  # noqa: E402,F401  registers qwen3_5_text in HF_DEFAULTS
from selfattn_nbdev.models import HF_DEFAULTS, hf_settings
from selfattn_nbdev.pretrained import from_hf, save_hf
from selfattn_nbdev.llama_attention import LlamaAttention

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
TOKENS = 24   # longer than every window below (4)
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
FAMILIES = {  # model_type: the settings of a small random model (the rest: transformers' defaults)
    'gpt2': dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.1),
    'llama': SMALL | dict(rope_theta=500000.0),
    'mistral': SMALL | dict(sliding_window=4),
    'qwen2': SMALL | dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2),
    'qwen3': SMALL | dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=3),
    'gemma2': SMALL | dict(num_hidden_layers=4, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                           initializer_range=0.02),
    'gemma3_text': SMALL | dict(num_hidden_layers=6, head_dim=16, sliding_window=4, initializer_range=0.02),
    'deepseek_v3': SMALL | dict(num_key_value_heads=4, first_k_dense_replace=2, q_lora_rank=24, kv_lora_rank=16,
                                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}


def rel(a, b) -> float: return ((a - b).abs().max() / b.abs().max()).item()


def same_config(cls, a: dict, b: dict) -> bool:
    "Whether transformers reads two config.json contents as one config (and reads the first at all)."
    read = lambda config: cls.from_dict(json.loads(json.dumps(config))).to_dict()  # a copy: from_dict fills it in
    try: return read(a) == read(b)
    except (KeyError, ValueError, TypeError): return False


def published(saved: dict, cls) -> dict:
    """config.json as the hub has it: each key (and each key of a dict such as rope_parameters) whose absence leaves
    transformers' config the same is dropped, one by one, whatever the family."""
    kept = dict(saved)
    for key in list(saved):
        if key == 'model_type': continue
        without = {k: v for k, v in kept.items() if k != key}
        if same_config(cls, without, saved):
            kept = without
        elif isinstance(kept[key], dict):   # RoPE's settings: each field alone
            for sub in list(kept[key]):
                inner = {k: v for k, v in kept[key].items() if k != sub}
                if same_config(cls, kept | {key: inner}, saved): kept[key] = inner
    return kept


def older_spelling(saved: dict, cls) -> dict:
    "The published config with RoPE as transformers 4 wrote it: rope_scaling, rope_theta (Gemma 3's local base) beside."
    config = published(saved, cls)
    rope = config.get('rope_parameters')
    if not rope: return config
    out = {k: v for k, v in config.items() if k != 'rope_parameters'}
    if 'full_attention' in rope:   # Gemma 3: the global blocks' RoPE in rope_scaling
        full, local = dict(rope['full_attention']), rope.get('sliding_attention') or {}
        if 'rope_theta' in local: out['rope_local_base_freq'] = local['rope_theta']
    else: full = dict(rope)
    if 'rope_theta' in full: out['rope_theta'] = full.pop('rope_theta')
    if full.get('rope_type', 'default') != 'default': out['rope_scaling'] = full
    return out


def saved_model(tmp_path, kind, settings, rewrite=published):
    "A small random model of transformers, saved, its config.json rewritten; and transformers' model read back."
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **settings), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    path = tmp_path / 'config.json'
    saved = json.loads(path.read_text())
    cls = type(model.config)
    rewritten = rewrite(saved, cls)
    assert same_config(cls, rewritten, saved), kind     # the same model, for transformers
    path.write_text(json.dumps(rewritten))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation='eager', dtype=torch.float32)
    return theirs.eval(), saved, rewritten


@pytest.mark.parametrize('spelling', ['rope_parameters', 'rope_scaling'])
@pytest.mark.parametrize('kind', list(FAMILIES))
def test_a_published_config_gives_transformers_logits(kind, spelling, tmp_path):
    rewrite = published if spelling == 'rope_parameters' else older_spelling
    theirs, saved, minimal = saved_model(tmp_path, kind, FAMILIES[kind], rewrite)
    assert len(minimal) < len(saved) and 'layer_types' not in minimal   # defaults and derived settings left out
    ours = from_hf(tmp_path)
    token_ids = torch.randint(0, 96, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(ours(token_ids), theirs(token_ids).logits) <= 1e-5, (kind, minimal)
    layer_types = getattr(theirs.config, 'layer_types', None)
    if layer_types is not None and kind != 'mistral':   # each block's window, as transformers derives it
        windows = [b.attn.window for b in ours.blocks]
        assert windows == [4 if t == 'sliding_attention' else None for t in layer_types], (windows, layer_types)


def test_defaults_are_transformers_defaults():
    "Every default of the table is the one of transformers' config class (RoPE's base: its default_theta)."
    for kind, defaults in HF_DEFAULTS.items():
        cls = type(AutoConfig.for_model(kind))
        fields = cls.__dataclass_fields__
        for key, value in defaults.items():
            if key in ('rope_theta', 'rope_local_base_freq'):
                theta = cls.default_theta
                want = theta['global' if key == 'rope_theta' else 'local'] if isinstance(theta, dict) else theta
            elif key == 'sliding_window_pattern': want = 6   # Gemma 3's __post_init__: kwargs.get(..., 6)
            elif key == 'full_attention_interval': want = 4  # Qwen3.5's __post_init__: kwargs.pop(..., 4)
            elif key == 'global_head_dim': want = 512         # Gemma 4's __post_init__: kwargs.pop(..., 512)
            elif key == 'partial_rotary_factor':                # Qwen3.5 keeps it in rope_parameters
                want = AutoConfig.for_model(kind).rope_parameters[key]
            else:
                assert key in fields, (kind, key)
                want = fields[key].default
            assert value == want, (kind, key, value, want)


def test_derived_settings():
    "Mistral's window everywhere (4,096 unless null); Qwen's from max_window_layers on; Gemma's patterns; heads."
    sizes = dict(vocab_size=8, hidden_size=32, intermediate_size=8, num_hidden_layers=6, num_attention_heads=4)
    assert hf_settings(dict(sizes, model_type='mistral'))['layer_types'] == ['sliding_attention'] * 6
    assert hf_settings(dict(sizes, model_type='mistral', sliding_window=None))['layer_types'] is None
    qwen = hf_settings(dict(sizes, model_type='qwen2', use_sliding_window=True, max_window_layers=4))
    assert qwen['layer_types'] == ['full_attention'] * 4 + ['sliding_attention'] * 2
    assert hf_settings(dict(sizes, model_type='qwen2', max_window_layers=4))['layer_types'] is None   # not used
    gemma3 = hf_settings(dict(sizes, model_type='gemma3_text', sliding_window_pattern=3))
    assert gemma3['layer_types'] == ['sliding_attention', 'sliding_attention', 'full_attention'] * 2
    assert gemma3['rope_parameters']['sliding_attention']['rope_theta'] == 1e4
    assert gemma3['rope_parameters']['full_attention']['rope_theta'] == 1e6
    assert hf_settings(dict(sizes, model_type='gemma2'))['layer_types'][:2] == ['sliding_attention', 'full_attention']
    llama = hf_settings(dict(sizes, model_type='llama', sliding_window=4, layer_types=['sliding_attention'] * 6))
    assert llama['layer_types'] is None and llama['head_dim'] == 8 and llama['num_key_value_heads'] == 4
    assert hf_settings(dict(sizes, model_type='qwen3'))['head_dim'] == 128   # Qwen3's default, not derived
    yarn = hf_settings(dict(sizes, model_type='llama', max_position_embeddings=64, original_max_position_embeddings=8,
                            rope_scaling=dict(type='yarn', factor=None, original_max_position_embeddings=16)))
    rope = yarn['rope_parameters']['full_attention']   # the top level wins; a null factor: 64 / 8
    assert (rope['rope_type'], rope['original_max_position_embeddings'], rope['factor']) == ('yarn', 8, 8.0)


def test_what_the_models_do_not_compute_is_refused_by_name():
    config = dict(model_type='llama', vocab_size=8, hidden_size=32, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=4)
    for key, value in [('hidden_act', 'gelu'), ('mlp_bias', True), ('attention_bias', True),
                       ('partial_rotary_factor', 0.5)]:
        with pytest.raises(ValueError, match=f'{key}={value!r} is not supported'):
            from_hf({}, config | {key: value})
    for kind in ('mixtral', 'qwen2_moe', 'gpt_oss'):
        with pytest.raises(ValueError, match=f"model_type='{kind}' is not supported.*from selfattn_nbdev.hf import "
                                             r"register; register\(\)`, then `AutoModelForCausalLM.from_pretrained"):
            from_hf({}, config | {'model_type': kind})
    with pytest.raises(ValueError, match='reorder_and_upcast_attn=True is not supported'):
        from_hf({}, dict(model_type='gpt2', vocab_size=8, n_embd=8, n_layer=1, n_head=2, reorder_and_upcast_attn=True))


def test_dropout_is_honoured_in_training_only(tmp_path):
    "attention_dropout (GPT-2: attn_pdrop, resid_pdrop, embd_pdrop) drops in training mode, and never in eval."
    theirs, _, _ = saved_model(tmp_path, 'llama', FAMILIES['llama'] | dict(attention_dropout=0.5))
    ours = from_hf(tmp_path)
    assert all(b.attn.dropout.p == 0.5 for b in ours.blocks)
    token_ids = torch.randint(0, 96, (1, TOKENS))
    with torch.no_grad():
        assert rel(ours(token_ids), theirs(token_ids).logits) <= 1e-5
        ours.train()
        assert rel(ours(token_ids), theirs(token_ids).logits) > 1e-3
    gpt = from_hf(GPT2LMHeadModel(GPT2Config(**FAMILIES['gpt2'])).state_dict(), GPT2Config(**FAMILIES['gpt2']))
    block = gpt.blocks[0]
    assert (block.attn.dropout.p, block.drop.p, block.drop_input.p, gpt.blocks[1].drop_input.p) == (0.1, 0.1, 0.1, 0)


LONG = 40   # past original_max_position_embeddings (16)
RESCALED = {
    'linear': dict(rope_type='linear', factor=4.0),
    'llama3': dict(rope_type='llama3', factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    'yarn': dict(rope_type='yarn', factor=4.0, original_max_position_embeddings=16),
    'dynamic': dict(rope_type='dynamic', factor=4.0),   # its L: max_position_embeddings, 16 below
    'longrope': dict(rope_type='longrope', original_max_position_embeddings=16),   # factor: 64 / 16
}


def rescaled_model(tmp_path, kind, rope_type, rewrite=published):
    head_dim = 16 if kind == 'llama' else 32
    rope = dict(RESCALED[rope_type], rope_theta=10000.0)
    if rope_type == 'longrope':  # a divisor per pair, short and long
        pairs = torch.linspace(0, 1, head_dim // 2)
        rope |= dict(short_factor=(1 + 0.2 * pairs).tolist(), long_factor=(1 + 6 * pairs ** 2).tolist())
    settings = SMALL | dict(head_dim=head_dim, rope_parameters=rope,
                            max_position_embeddings=16 if rope_type == 'dynamic' else 64)
    return saved_model(tmp_path, kind, settings, rewrite)[0]


@pytest.mark.parametrize('spelling', ['rope_parameters', 'rope_scaling'])
@pytest.mark.parametrize('rope_type', list(RESCALED))
@pytest.mark.parametrize('kind', ['llama', 'qwen3'])
def test_rescaled_rope_past_the_original_length(kind, rope_type, spelling, tmp_path):
    "Logits of 40 tokens (original length 16), all at once and step by step with the cache, as transformers."
    theirs = rescaled_model(tmp_path, kind, rope_type, published if spelling == 'rope_parameters' else older_spelling)
    ours = from_hf(tmp_path, context_length=64)
    assert ours.blocks[0].attn.rope_scaling['rope_type'] == rope_type
    token_ids = torch.randint(0, 96, (1, LONG), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(ours(token_ids), theirs(token_ids).logits) <= 1e-5
        mid = token_ids[:, :24]     # past L, shorter than the longest so far: dynamic keeps the longest's base
        assert rel(ours(mid), theirs(mid).logits) <= 1e-5
        short = token_ids[:, :12]   # shorter than L: dynamic goes back to the plain base, longrope to short_factor
        assert rel(ours(short), theirs(short).logits) <= 1e-5
        caches, past = ours.new_caches(), None   # a prompt of 8, then one token a step: each as transformers turns it
        for i in [8, *range(9, LONG + 1)]:
            step = token_ids[:, :8] if i == 8 else token_ids[:, i - 1:i]
            mine = ours(step, caches)
            out = theirs(step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            assert rel(mine, out.logits) <= 1e-5, (rope_type, i)


def gpt_oss_layer(window=4):
    "Layer 0 of a small gpt-oss (sliding, sinks, biases everywhere, YaRN not truncated) of transformers."
    config = AutoConfig.for_model('gpt_oss', vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
                                  num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
                                  rope_parameters=dict(rope_type='yarn', factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                       truncate=False, original_max_position_embeddings=16,
                                                       rope_theta=150000.0))
    config._attn_implementation = 'eager'
    torch.manual_seed(0)
    layer = GptOssAttention(config, layer_idx=0).eval()
    with torch.no_grad(): layer.sinks.normal_()
    assert layer.sliding_window == window and layer.o_proj.bias is not None
    return config, layer


def gpt_oss_gap(out_bias: bool) -> float:
    config, layer = gpt_oss_layer()
    T, W = 12, config.sliding_window
    ours = LlamaAttention(32, 64, 4, 2, head_dim=8, qkv_bias=True, window=W, rope_base=150000.0,
                          rope_scaling=config.rope_parameters, sinks=True, out_bias=out_bias).eval()
    with torch.no_grad():
        for mine, theirs in [(ours.W_query, layer.q_proj), (ours.W_key, layer.k_proj), (ours.W_value, layer.v_proj),
                             (ours.out_proj, layer.o_proj)]:
            mine.weight.copy_(theirs.weight)
            if mine.bias is not None: mine.bias.copy_(theirs.bias)
        ours.sinks.copy_(layer.sinks)
        x = torch.randn(2, T, 32)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None]
        mask = torch.zeros(T, T).masked_fill(~((j <= i) & (i - j < W)), -torch.inf)[None, None]
        cos, sin = GptOssRotaryEmbedding(config)(x, torch.arange(T)[None])   # transformers' RoPE, its own
        expected = layer(x, (cos, sin), mask)[0]
        return rel(ours(x), expected)


def test_llama_attention_is_gpt_oss_attention():
    "One gpt-oss attention layer's weights in LlamaAttention: transformers' output on a text longer than the window."
    assert gpt_oss_gap(out_bias=True) <= 1e-5
    assert gpt_oss_gap(out_bias=False) > 1e-2   # o_proj's bias matters


def test_qwen2_window_layers_case(tmp_path):
    "../shared/cases/qwen2_window_layers.py: use_sliding_window, max_window_layers=2 of 4, no layer_types."
    settings = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
                    max_window_layers=2, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)
    drop = lambda config, cls: {k: v for k, v in config.items() if k != 'layer_types'}
    theirs, _, _ = saved_model(tmp_path, 'qwen2', settings, drop)
    ours = from_hf(tmp_path)
    assert [b.attn.window for b in ours.blocks] == [None, None, 4, 4]
    token_ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): assert rel(ours(token_ids), theirs(token_ids).logits) <= 1e-5


def test_gpt2_untied_head_case(tmp_path):
    "../shared/cases/gpt2_untied_head.py: GPT-2 with tie_word_embeddings=False loads its own head, writes it back."
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    theirs = GPT2LMHeadModel(config).eval()
    theirs.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    assert ours.head.weight is not ours.token_emb.weight
    token_ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): assert rel(ours(token_ids), theirs(token_ids).logits) <= 1e-5
    back = type(theirs).from_pretrained(save_hf(ours, tmp_path / 'out')).eval()
    assert torch.equal(back.lm_head.weight, theirs.lm_head.weight)
    assert not torch.equal(back.lm_head.weight, back.transformer.wte.weight)
    with torch.no_grad(): assert rel(back(token_ids).logits, theirs(token_ids).logits) <= 1e-6


@pytest.mark.parametrize('model_type', ['qwen3_moe', 'mixtral', 'gpt_oss', 'glm4_moe'])
def test_a_mixture_of_experts_is_refused_with_what_it_lacks(model_type):
    """from_hf refuses a family it does not build; where the config routes tokens to experts, the message says so
    (with the count and its key) before the families it builds and the way through transformers."""
    from transformers import AutoConfig
    from selfattn_nbdev.pretrained import from_hf
    config = AutoConfig.for_model(model_type).to_dict()
    with pytest.raises(ValueError, match=rf"model_type='{model_type}' is not supported: its blocks route tokens to "
                                         r"\d+ experts \(\w+\), a mixture of experts.*attn_implementation"):
        from_hf({}, config)
    with pytest.raises(ValueError, match=r"model_type='phi3' is not supported; from_hf builds"):  # no experts
        from_hf({}, AutoConfig.for_model('phi3').to_dict())
