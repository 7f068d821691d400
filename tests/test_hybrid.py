"""A hybrid model (nbs/20_hybrid.ipynb): GatedAttention against its formulas in float64 and against transformers'
Qwen3_5Attention and M-RoPE; the package's Qwen35, loaded by from_hf from a tiny random Qwen3.5 that transformers built
and saved offline, against transformers (logits, greedy tokens, cached and uncached, left-padded batches longer than a
delta-rule chunk); and the package's blocks inside transformers: GatedDeltaNet in Qwen3.5-MoE, the Indexer,
topk_indices and sparse_attention in DeepSeek-V3.2. Nothing is downloaded."""
import copy, json, math, subprocess, sys

import pytest
import torch

transformers = pytest.importorskip('transformers')
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_ds  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35  # noqa: E402

from conftest import check_against_transformers, left_padded_batch, with_package_linear_layers  # noqa: E402
from selfattn_nbdev import hybrid  # noqa: E402
from selfattn_nbdev.decoding import StaticKVCache, generate  # noqa: E402
from selfattn_nbdev.generation import KVCache  # noqa: E402
from selfattn_nbdev.hybrid import (GatedAttention, HybridCache, Qwen35, hybrid_layer_types,  # noqa: E402
                                   qwen35_config, qwen35_weight_map)
from selfattn_nbdev.linear import GatedDeltaNet  # noqa: E402
from selfattn_nbdev.gemma import GemmaRMSNorm  # noqa: E402
from selfattn_nbdev.pretrained import from_hf  # noqa: E402
from selfattn_nbdev.llama_attention import LlamaAttention  # noqa: E402
from selfattn_nbdev.sparse import Indexer, sparse_attention, topk_indices  # noqa: E402

transformers.logging.set_verbosity_error()  # "flash-linear-attention is not installed"
F64 = torch.float64


def perturb(model, scale=0.1):
    "Weights away from their init (zero-centred norms would be the identity): same offsets for a given seed."
    with torch.no_grad():
        for p in model.parameters(): p.add_(scale * torch.randn_like(p))
    return model


def causal_additive(T):
    return torch.zeros(T, T, dtype=F64).masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)[None, None]


# --- GatedAttention ---------------------------------------------------------------------------------------------------

def by_formula(attn, x, r):
    "One head, (1) and (2) of the page written out: partial RoPE on r numbers, causal softmax, the sigmoid gate."
    hd = attn.head_dim
    both = x @ attn.W_query.weight.T
    q, g = both[..., :hd], both[..., hd:]
    k, v = x @ attn.W_key.weight.T, x @ attn.W_value.weight.T
    theta = attn.rope_base ** (-torch.arange(0, r, 2, dtype=F64) / r)
    pos = torch.arange(x.shape[1], dtype=F64)[:, None]
    def turn(t):
        a = pos * theta
        x1, x2 = t[..., :r // 2], t[..., r // 2:r]
        return torch.cat([x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin(), t[..., r:]], -1)
    omega = turn(q) @ turn(k).transpose(-1, -2) / math.sqrt(hd) + causal_additive(x.shape[1])[0, 0]
    return (torch.sigmoid(g) * (torch.softmax(omega, -1) @ v)) @ attn.out_proj.weight.T


@pytest.mark.parametrize('factor,r', [(0.5, 4), (0.25, 2), (1.0, 8)])
def test_gated_attention_is_its_formula_on_every_path(factor, r, record_diff):
    torch.manual_seed(0)
    attn = GatedAttention(16, 32, 1, head_dim=8, partial_rotary_factor=factor, out_bias=False).double().eval()
    assert attn.rotary_dim == r
    x = torch.randn(2, 7, 16, dtype=F64)
    ref = by_formula(attn, x, r)
    with torch.no_grad():
        fused = attn(x)
        explicit, weights = attn(x, return_attn_weights=True)
        cache = KVCache()
        steps = torch.cat([attn(x[:, :3], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(3, 7)], 1)
        padded = attn(torch.cat([torch.zeros(2, 4, 16, dtype=F64), x], 1), cache=StaticKVCache(11, torch.tensor([4, 4])))
    for what, got in [('fused', fused), ('explicit', explicit), ('KVCache', steps), ('StaticKVCache', padded[:, 4:])]:
        assert record_diff(f'GatedAttention {what}', 'formula', got, ref) < 1e-12, what
    assert torch.allclose(weights.sum(-1), torch.ones((), dtype=F64))
    assert not hybrid._GATES.get({})                                   # the gate never outlives its call


def test_gated_attention_without_gate_and_full_rope_is_llama_attention():
    torch.manual_seed(1)
    gated = GatedAttention(32, 64, 4, 2, 8, output_gate=False, partial_rotary_factor=1.0, qk_norm=True).double()
    llama = LlamaAttention(32, 64, 4, 2, 8, qk_norm=True).double()
    llama.load_state_dict(gated.state_dict())
    x = torch.randn(2, 9, 32, dtype=F64)
    with torch.no_grad():
        assert (gated(x) - llama(x)).abs().max() < 1e-13
        with_gate = GatedAttention(32, 64, 4, 2, 8, partial_rotary_factor=1.0, qk_norm=True).double()
        assert (with_gate(x) - llama(x)).abs().max() > 1e-3              # the gate changes the output


def qwen35_text_config(**extra):
    small = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=8, max_position_embeddings=256, eos_token_id=None)
    return AutoConfig.for_model('qwen3_5_text', **(small | extra))


def test_partial_rope_is_transformers_mrope_for_text():
    "Qwen3.5's M-RoPE with its three position counters equal (text) is plain RoPE on the first rotary_dim numbers."
    cfg = qwen35_text_config(head_dim=256, rope_parameters=dict(
        rope_type='default', rope_theta=1e7, partial_rotary_factor=0.25, mrope_interleaved=True,
        mrope_section=[11, 11, 10]))
    positions = torch.tensor([[0, 1, 5, 17, 40, 63]])  # transformers: float32 angles
    cos, sin = hf_qwen35.Qwen3_5TextRotaryEmbedding(cfg)(torch.zeros(1, dtype=F64), positions)
    ours = GatedAttention(64, 4096, 4, 2, 256, partial_rotary_factor=0.25, rope_base=1e7)
    table = ours._rope_table(4096, torch.zeros(1, dtype=F64))
    assert ours.rotary_dim == cos.shape[-1] == 64
    assert (table[0][positions[0]] - cos[0]).abs().max() < 1e-5
    assert (table[1][positions[0]] - sin[0]).abs().max() < 1e-5
    assert (table[0][63, :8] - cos[0, -1, :8]).abs().max() < 1e-5 and (table[0][63, :8] - 1).abs().max() > 0.1


def test_gated_attention_equals_transformers_qwen3_5_attention(record_diff):
    cfg = qwen35_text_config()
    torch.manual_seed(0)
    theirs = perturb(hf_qwen35.Qwen3_5Attention(cfg, 3)).double().eval()
    ours = GatedAttention(64, 64, 4, 2, 16, partial_rotary_factor=0.25, qk_norm=True)
    ours.q_norm, ours.k_norm = GemmaRMSNorm(16), GemmaRMSNorm(16)
    names = {'W_query': 'q_proj', 'W_key': 'k_proj', 'W_value': 'v_proj', 'out_proj': 'o_proj',
             'q_norm': 'q_norm', 'k_norm': 'k_norm'}
    ours.double().eval().load_state_dict({f'{o}.weight': theirs.state_dict()[f'{h}.weight'] for o, h in names.items()})
    x = torch.randn(2, 12, 64, dtype=F64)
    rope = hf_qwen35.Qwen3_5TextRotaryEmbedding(cfg)(x, torch.arange(12)[None])
    with torch.no_grad():
        diff = record_diff('GatedAttention', 'Qwen3_5Attention', ours(x), theirs(x, rope, causal_additive(12))[0])
    assert diff < 1e-6                                # transformers' rotary tables are float32 (1e-7), the rest float64


def test_gemma_norm_is_qwen3_5_norm():
    "transformers' norm works in float32 whatever the input (float64 too): compared in float32."
    torch.manual_seed(0)
    theirs = perturb(hf_qwen35.Qwen3_5RMSNorm(16, eps=1e-6))
    ours = GemmaRMSNorm(16, 1e-6)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert (ours(x) - theirs(x)).abs().max() < 1e-6 and (ours(x) - x).abs().max() > 1e-2


# --- Qwen35, float64 --------------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def tiny64():
    torch.manual_seed(0)
    model = Qwen35(50, 160, 32, 4, 8, num_kv_heads=2, d_hidden=64, head_dim=8, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    return perturb(model).double().eval()


def test_qwen35_padding_and_caches_in_float64(tiny64, record_diff):
    "Texts longer than a chunk (64): a left-padded row equals itself alone; cached step by step equals all at once."
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (2, 100))
    with torch.no_grad():
        batch = tiny64(ids, tiny64.new_caches(100, torch.tensor([0, 23])))
        alone = tiny64(ids[1:, 23:])
        whole = tiny64(ids)
        for capacity in (None, 100):
            caches = tiny64.new_caches(capacity)
            steps = torch.cat([tiny64(ids[:, :70], caches)] + [tiny64(ids[:, t:t + 1], caches) for t in range(70, 90)]
                              + [tiny64(ids[:, 90:], caches)], 1)
            assert record_diff('Qwen35 cached', 'uncached', steps, whole) < 1e-12, capacity
    assert record_diff('Qwen35 padded row', 'alone', batch[1, 23:], alone[0]) < 1e-12
    assert (batch[0] - whole[0]).abs().max() < 1e-12
    assert [type(c).__name__ for c in caches] == ['HybridCache'] * 3 + ['StaticKVCache'] + ['HybridCache'] * 3 + [
        'StaticKVCache']
    assert caches[0].seen == 100 and caches[0].state.shape == (2, 4, 8, 8)   # fixed size, whatever the length


def test_qwen35_generate_with_padding_static_and_growing(tiny64):
    torch.manual_seed(2)
    ids = torch.randint(0, 50, (2, 70))
    prompts = [ids[0, 11:], ids[1]]
    cached = generate(tiny64, prompts, 12)
    uncached = generate(tiny64, prompts, 12, use_cache=False)
    assert [r.tolist() for r in cached] == [r.tolist() for r in uncached]
    assert torch.equal(cached[0][-12:], generate(tiny64, ids[:1, 11:], 12)[0, -12:])   # the same alone
    assert torch.equal(generate(tiny64, ids, 12), generate(tiny64, ids, 12, static=True))  # growing = static



@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer slows torch.compile; the eager tests cover the same lines
def test_a_compiled_decode_step_writes_the_eager_tokens():
    """generate(compile=True) by Inductor on Qwen3.5 blocks: the host counts each linear block's tokens
    (HybridCache.begin_step) and the graph reads the count as a tensor; with the last block linear (the step's bound
    comes from the KV caches), a plain batch and a left-padded one write the eager tokens."""
    torch.manual_seed(0)
    model = Qwen35(50, 160, 32, 4, 4, num_kv_heads=2, d_hidden=64, head_dim=8, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   layer_types=['full_attention', 'linear_attention'] * 2).eval()  # (the default: the next test)
    ids = torch.randint(0, 50, (2, 9))
    assert torch.equal(generate(model, ids, 10, compile=True), generate(model, ids, 10))
    prompts = [ids[0, 4:], ids[1]]
    compiled, eager = generate(model, prompts, 10, compile=True), generate(model, prompts, 10)
    assert [r.tolist() for r in compiled] == [r.tolist() for r in eager]


def test_one_graph_serves_every_compiled_step():
    "The host counts (begin_step), so no step's graph holds a count: one graph for 20 steps (Dynamo's tracing alone)."
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = Qwen35(50, 160, 32, 4, 4, num_kv_heads=2, d_hidden=64, head_dim=8, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8).eval()
    prompts = [torch.randint(0, 50, (n,)) for n in (3, 9)]
    torch._dynamo.reset(); counters.clear()
    out = generate(model, prompts, 20, compile=dict(backend='eager', fullgraph=True))
    assert counters['stats']['unique_graphs'] == 1
    assert all(torch.equal(a, b) for a, b in zip(out, generate(model, prompts, 20)))


def test_a_hybrid_cache_in_a_traced_step_reads_the_count_the_host_set(monkeypatch):
    "The logic of the compiled step on the host: begin_step counts, positions and padding read its tensor, none: refused."
    from selfattn_nbdev.hybrid import HybridCache
    cache = HybridCache(pads=torch.tensor([2, 0]))
    cache.seen = 1
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)   # as inside a graph
    with pytest.raises(ValueError, match=r'needs cache.begin_step\(num_new\) on the host first'):
        cache.positions(1)
    cache.begin_step(2)
    assert cache.seen == 3 and cache.positions(2).tolist() == [[0, 0], [1, 2]]   # less each row's padding
    assert cache.real_tokens(2).tolist() == [[False, True], [True, True]]   # row 0: columns 0, 1 are padding


# --- bad inputs -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('call,error,message', [
    (lambda m, ids: m(ids, m.new_caches()[:3]), ValueError, 'caches must be a list of 8 caches'),
    (lambda m, ids: m(ids, [KVCache()] * 8), TypeError, 'caches[0] must be a HybridCache (block 0 is linear'),
    (lambda m, ids: m(ids, m.new_caches(pads=torch.tensor([1, 0]))), ValueError, 'pads needs a capacity'),
    (lambda m, ids: m(torch.randint(0, 50, (1, 161))), ValueError, '161 new make 161, more than context_length=160'),
    (lambda m, ids: m(ids + 50), ValueError, 'token_ids must be in [0, 50)'),
    (lambda m, ids: Qwen35(50, 64, 32, 4, 3, 2, 64, 8, layer_types=['linear_attention'] * 2), ValueError,
     "layer_types must list one of ('linear_attention', 'full_attention') for each of the 3 blocks"),
    (lambda m, ids: GatedAttention(16, 32, 2, partial_rotary_factor=0), ValueError,
     'partial_rotary_factor must be a number in (0, 1]'),
    (lambda m, ids: GatedAttention(16, 32, 2, partial_rotary_factor=0.5,
                                   rope_scaling=dict(rope_type='dynamic', factor=2.0,
                                                     original_max_position_embeddings=16)), ValueError,
     "partial_rotary_factor=0.5 with rope_type='dynamic' is not supported"),
    (lambda m, ids: GatedAttention(16, 32, 2, output_gate=1), TypeError, 'output_gate must be True or False; got 1'),
    (lambda m, ids: hybrid_layer_types(0), ValueError, 'num_layers'),
    (lambda m, ids: HybridCache(torch.tensor([-1])), ValueError, 'pads'),
    (lambda m, ids: qwen35_config({'model_type': 'qwen3_5_text', 'hidden_act': 'gelu'}), ValueError,
     "hidden_act='gelu' is not supported: Qwen35 has 'silu'"),
    (lambda m, ids: qwen35_config({'model_type': 'qwen3_5_text', 'rope_parameters': {'rope_type': 'mrope2',
                                                                                      'rope_theta': 1.0}}),
     ValueError, "rope_type='mrope2' is not supported: Qwen35 has 'default'"),
])
def test_bad_inputs_are_named(tiny64, call, error, message):
    ids = torch.randint(0, 50, (2, 10))
    with pytest.raises(error) as e: call(tiny64, ids)
    assert message in str(e.value), str(e.value)


# --- Qwen3.5 loaded natively, against transformers --------------------------------------------------------------------

@pytest.fixture(scope='module')
def qwen35_pair(tmp_path_factory):
    "transformers' tiny Qwen3.5 (float32, weights away from init), saved; the package's from from_hf(folder)."
    torch.manual_seed(0)
    hf = perturb(AutoModelForCausalLM.from_config(qwen35_text_config(), dtype=torch.float32), 0.05).eval()
    folder = tmp_path_factory.mktemp('qwen35')
    hf.save_pretrained(folder)
    return hf, from_hf(folder), folder


def test_from_hf_builds_qwen35_with_transformers_defaults(qwen35_pair):
    hf, ours, folder = qwen35_pair
    assert type(ours) is Qwen35 and ours.layer_types == hf.config.layer_types
    assert ours.blocks[3].attn.rotary_dim == 4 and ours.eos_token_ids is None
    stripped = {k: v for k, v in json.loads((folder / 'config.json').read_text()).items()
                if k in ('model_type', 'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
                         'num_attention_heads', 'num_key_value_heads', 'head_dim', 'linear_num_key_heads',
                         'linear_num_value_heads', 'linear_key_head_dim', 'linear_value_head_dim')}
    read = qwen35_config(stripped)                                   # the rest: Qwen3_5TextConfig's defaults
    their = AutoConfig.for_model(**stripped)
    assert read['layer_types'] == their.layer_types and read['context_length'] == their.max_position_embeddings
    assert read['partial_rotary_factor'] == their.rope_parameters['partial_rotary_factor'] == 0.25
    assert read['rope_base'] == their.rope_parameters['rope_theta']
    eight = stripped | {'num_hidden_layers': 8, 'full_attention_interval': 2}
    assert qwen35_config(eight)['layer_types'] == AutoConfig.for_model(**eight).layer_types
    assert len(qwen35_weight_map(read['layer_types'])) == len(hf.state_dict())


def test_qwen35_logits_equal_transformers_on_a_left_padded_batch(qwen35_pair, record_diff):
    hf, ours, _ = qwen35_pair
    ids, mask = left_padded_batch(128)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        mine = ours(ids, ours.new_caches(80, torch.tensor([7, 0])))
        growing = ours(ids[1:])
    real = mask.bool()
    assert record_diff('qwen3_5_text logits', 'transformers', mine[real], theirs[real]) < 1e-5
    assert (growing[0] - theirs[1]).abs().max() < 1e-5


def test_qwen35_greedy_tokens_equal_transformers_cached_and_uncached(qwen35_pair):
    hf, ours, _ = qwen35_pair
    ids, mask = left_padded_batch(128)
    prompts = [ids[0, 7:], ids[1]]
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)[:, 80:]
    cached = generate(ours, prompts, 16)
    uncached = generate(ours, prompts, 16, use_cache=False)
    assert [row[-16:].tolist() for row in cached] == theirs.tolist()
    assert [row.tolist() for row in cached] == [row.tolist() for row in uncached]


def test_the_language_model_of_an_image_and_text_checkpoint_and_one_with_mtp(qwen35_pair, tmp_path, record_diff):
    """Qwen3.5 as the hub holds it: an image-and-text checkpoint (qwen3_5: the language model under
    model.language_model., a vision tower beside it) loads its language model, equal to transformers'
    AutoModelForCausalLM on the same folder; a text checkpoint with a multi-token-prediction head (mtp.) loads as
    without it; save_hf writes the language model back as a text checkpoint that transformers reads."""
    from transformers import AutoModelForImageTextToText
    from selfattn_nbdev.pretrained import read_checkpoint, save_hf
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    text = {k: v for k, v in qwen35_text_config().to_dict().items() if k not in ('architectures', 'model_type')}
    torch.manual_seed(0)
    both = perturb(AutoModelForImageTextToText.from_config(AutoConfig.for_model(
        'qwen3_5', text_config=text, vision_config=vision), dtype=torch.float32), 0.05).eval()
    both.save_pretrained(tmp_path / 'both')
    theirs, ours = AutoModelForCausalLM.from_pretrained(tmp_path / 'both').eval(), from_hf(tmp_path / 'both')
    assert type(ours) is Qwen35 and ours.hf_config['model_type'] == 'qwen3_5_text'
    ids, mask = left_padded_batch(128)
    with torch.no_grad():
        want = theirs(ids[1:]).logits
        assert record_diff('qwen3_5 (image and text) logits', 'transformers', ours(ids[1:]), want) < 1e-5
    save_hf(ours, tmp_path / 'back')
    again = AutoModelForCausalLM.from_pretrained(tmp_path / 'back').eval()
    with torch.no_grad(): assert (again(ids[1:]).logits - want).abs().max() < 1e-5
    _, small, _ = qwen35_pair
    tensors, config = read_checkpoint(qwen35_pair[2])
    with_mtp = from_hf(tensors | {'mtp.fc.weight': torch.zeros(64, 128)}, config)
    bare = from_hf({name.removeprefix('model.'): t for name, t in tensors.items()}, config)  # names without model.
    with torch.no_grad():
        assert torch.equal(with_mtp(ids[1:]), small(ids[1:])) and torch.equal(bare(ids[1:]), small(ids[1:]))


# --- the package's blocks inside transformers ---------------------------------------------------------------------------

def test_gated_delta_net_inside_transformers_qwen3_5_moe(record_diff):
    torch.manual_seed(0)
    config = AutoConfig.for_model('qwen3_5_moe_text', vocab_size=128, hidden_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32, max_position_embeddings=256, eos_token_id=None)
    theirs = perturb(AutoModelForCausalLM.from_config(config, dtype=torch.float32), 0.05).eval()
    ours = with_package_linear_layers(theirs, expected=3)
    assert ours.model.layers[0].linear_attn.layout == 'qwen3_5'
    check_against_transformers(theirs, ours, *left_padded_batch(128), record_diff, 'qwen3_5_moe_text')


def package_sparse_attention(attn):
    "DeepseekV32Attention.forward with its indexer and top-k masked attention replaced by the package's."
    indexer = Indexer(attn.hidden_size, attn.q_lora_rank, attn.indexer.n_heads, attn.indexer.head_dim,
                      attn.qk_rope_head_dim)
    indexer.load_state_dict(attn.indexer.state_dict())                  # transformers' names load as they are
    def forward(hidden_states, position_embeddings, attention_mask, past_key_values=None, position_ids=None,
                **kwargs):
        b, T, _ = hidden_states.shape
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
        q = attn.q_b_proj(q_resid).view(b, T, -1, attn.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], -1)
        kv_pass, k_rot = attn.kv_a_proj_with_mqa(hidden_states).split([attn.kv_lora_rank, attn.qk_rope_head_dim], -1)
        k_pass = attn.kv_a_layernorm(kv_pass).view(b, 1, T, -1)
        cos, sin = position_embeddings
        q_rot, k_rot = hf_ds.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, T, -1), cos, sin)
        if past_key_values is not None:
            k_pass, k_rot = past_key_values.update(k_pass, k_rot, attn.layer_idx)
        keys, values = attn.expand_kv(k_pass, k_rot)                     # (b, h, S, d), (b, h, S, d_v)
        index_keys = indexer.index_keys(hidden_states, cos[:, None], sin[:, None])   # (b, 1, T, d_I)
        if past_key_values is not None:
            index_keys = past_key_values.update_indexer(index_keys[:, 0], attn.layer_idx)[:, None]
        scores = indexer(hidden_states, q_resid, index_keys, cos[:, None], sin[:, None])  # (b, T, S)
        mask = attention_mask[:, 0]
        allowed = mask if mask.dtype == torch.bool else mask == 0
        indices = topk_indices(scores, attn.indexer.index_topk, allowed)
        context = sparse_attention(torch.cat([q_pass, q_rot], -1), keys, values, indices, attn.scaling)
        return attn.o_proj(context.transpose(1, 2).reshape(b, T, -1)), None
    return forward


def test_package_sparse_attention_inside_transformers_deepseek_v32(record_diff):
    small = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=16, index_topk=6, index_head_dim=16, index_n_heads=16, first_k_dense_replace=2,
                 max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model('deepseek_v32', **small),
                                              attn_implementation='eager').float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters(): p.normal_(1.0 if 'norm.weight' in name else 0.0, 0.15)
    ours = copy.deepcopy(theirs)
    for block in ours.model.layers: block.self_attn.forward = package_sparse_attention(block.self_attn)
    ids, mask = left_padded_batch(97, T=30, pad=9)                        # 21 and 30 tokens, k = 6
    check_against_transformers(theirs, ours, ids, mask, record_diff, 'deepseek_v32')
    dense = copy.deepcopy(theirs)
    for block in dense.model.layers:                                       # every key: sparsity mattered
        block.self_attn.indexer.index_topk = 30
        block.self_attn.forward = package_sparse_attention(block.self_attn)
    with torch.no_grad():
        assert (dense(ids, attention_mask=mask).logits - ours(ids, attention_mask=mask).logits).abs().max() > 1e-2


@pytest.mark.heavy
def test_from_hf_finds_qwen35_when_only_from_hf_is_imported(qwen35_pair):
    """A user who imports only from_hf: the package imports every module with itself, so the hybrid page's
    family is in FAMILIES, and nothing reaches a module through import_module."""
    folder = qwen35_pair[2]
    script = ("import sys\nfrom selfattn_nbdev.pretrained import from_hf\n"
              "assert 'selfattn_nbdev.hybrid' in sys.modules\n"
              f"model = from_hf({str(folder)!r})\nprint(type(model).__name__)")
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == 'Qwen35', out.stdout + out.stderr[-2000:]


def test_the_gate_of_one_call_never_reaches_another():
    """Between _qkv and _merge_heads the gate waits in a context variable keyed by the module: threads calling one
    module at once each get their own gate (on the module, a thread could take another's), and none stays behind."""
    import threading
    torch.manual_seed(0)
    attn = GatedAttention(32, 64, 4, 2, 8, partial_rotary_factor=0.5).double().eval()
    xs = [torch.randn(2, 16, 32, dtype=torch.float64) for _ in range(6)]
    with torch.no_grad(): alone = [attn(x) for x in xs]
    got, start = [None] * len(xs), threading.Barrier(len(xs))
    def work(i):
        start.wait()
        with torch.no_grad():
            for _ in range(20): got[i] = attn(xs[i])
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads: t.start()
    for t in threads: t.join()
    assert all((g - a).abs().max() < 1e-12 for g, a in zip(got, alone))
    assert not hybrid._GATES.get({}) and not hasattr(attn, '_gate')
