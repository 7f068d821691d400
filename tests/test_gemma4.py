"""Layers that share keys and values (nbs/27_gemma4.ipynb): the package's Gemma4, read by from_hf from tiny random
Gemma 4 (text) models that transformers built and saved offline, against transformers with num_kv_shared_layers = 0
and 2, with and without per-layer inputs, with proportional RoPE: logits, gradients, greedy tokens with growing and
static caches, left-padded batches, and in float64 with transformers' float32 steps lifted, the same function to
~1e-15; SharedKV and KVSource as caches; what from_hf refuses. Nothing is downloaded."""
import tempfile

import pytest
import torch

transformers = pytest.importorskip('transformers')
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.gemma4 import modeling_gemma4 as g4  # noqa: E402

from selfattn_nbdev.decoding import generate  # noqa: E402
from selfattn_nbdev.gemma4 import Gemma4, KVSource, SharedKV, gemma4_config, kv_sources  # noqa: E402
from selfattn_nbdev.pretrained import from_hf, save_hf  # noqa: E402

transformers.logging.set_verbosity_error()
TYPES = ["sliding_attention", "full_attention"] * 3


def hf_gemma4(shared=2, per_layer=8, perturb=False, **over):
    "A tiny random Gemma 4 (text) of 6 layers; perturb: its norms and layer scalars away from their init."
    cfg = AutoConfig.for_model(
        "gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
        layer_types=TYPES, num_kv_shared_layers=shared, hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
        eos_token_id=None, **over)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if 'norm' in name: p.add_(0.3 * torch.randn_like(p))
            for layer in model.model.layers: layer.layer_scalar.fill_(0.5 + torch.rand(()).item())
    return model


def ours_of(hf):
    with tempfile.TemporaryDirectory() as folder:  # from_hf reads it whole
        hf.save_pretrained(folder)
        return from_hf(folder).eval()


@pytest.fixture
def exact_transformers(monkeypatch):
    """transformers' Gemma 4 computes its norms, RoPE tables and embedding scales in float32 even in a float64 model;
    here in the model's dtype, so that float64 shows the two models compute the same function (to ~1e-15)."""
    def norm(self, x):
        out = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return out * self.weight if self.with_scale else out

    def rope(self, x, position_ids, layer_type):
        inv = getattr(self, f"{layer_type}_inv_freq")  # proportional RoPE: zeros past the turned pairs
        dim, base = 2 * len(inv), self.config.rope_parameters[layer_type]["rope_theta"]
        exact = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = position_ids[..., None].double() * torch.where(inv == 0, 0.0, exact)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    monkeypatch.setattr(g4.Gemma4RMSNorm, 'forward', norm)
    monkeypatch.setattr(g4.Gemma4TextRotaryEmbedding, 'forward', rope)

    def in_float64(hf):
        hf.double().set_attn_implementation("sdpa")
        for m in hf.modules():
            if isinstance(m, g4.Gemma4TextScaledWordEmbedding):
                m.embed_scale = torch.tensor(m.scalar_embed_scale, dtype=torch.float64)
        return hf
    return in_float64


CONFIGS = [(2, 8, None), (2, 8, 30.0), (0, 8, None), (4, 8, None), (0, 0, None), (2, 0, None)]


@pytest.mark.parametrize('shared,per_layer,final_cap', CONFIGS)
def test_float64_logits_and_gradients_are_transformers(exact_transformers, shared, per_layer, final_cap):
    "Norms, layer scalars away from their init, proportional RoPE, sharing: the same function and gradients."
    hf = hf_gemma4(shared, per_layer, perturb=True, final_logit_softcapping=final_cap)
    ours = ours_of(hf).double().train()
    hf = exact_transformers(hf).train()
    ids = torch.randint(3, 128, (2, 40))
    out = {}
    # output_hidden_states: transformers 5.23 fails on a sharing model without per-layer inputs otherwise
    for name, logits in [('ours', ours(ids)), ('hf', hf(ids, output_hidden_states=True).logits)]:
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        out[name] = logits.detach()
    assert ((out['ours'] - out['hf']).abs().max() / out['hf'].abs().max()) < 1e-10
    # the sharing blocks hold no keys or values of their own
    assert [b.attn.shares_kv for b in ours.blocks] == [i >= 6 - shared for i in range(6)]
    assert all(not hasattr(b.attn, 'W_key') for b in ours.blocks if b.attn.shares_kv)
    for i in (3, 5):  # queries of a block with keys and of a sharing one (when any share)
        q = ours.blocks[i].attn.W_query.weight.grad, hf.model.layers[i].self_attn.q_proj.weight.grad
        assert (q[0] - q[1]).abs().max() < 1e-10 * q[1].abs().max(), i
    last = max(i for i, source in enumerate(ours.kv_sources) if source is None)  # the last with keys
    k = ours.blocks[last].attn.W_key.weight.grad, hf.model.layers[last].self_attn.k_proj.weight.grad
    assert (k[0] - k[1]).abs().max() < 1e-10 * k[1].abs().max()


def test_a_compiled_step_with_shared_layers_writes_the_eager_tokens():
    """generate(compile=True) with layers that share keys and values: a SharedKV has nothing to count on the host
    (its source does), so the step compiles instead of stopping on a missing begin_step; one graph (Dynamo alone)."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    ours = ours_of(hf_gemma4())
    prompts = [torch.randint(3, 128, (n,)) for n in (4, 9)]
    torch._dynamo.reset(); counters.clear()
    out = generate(ours, prompts, 12, compile=dict(backend='eager', fullgraph=True))
    assert counters['stats']['unique_graphs'] == 1
    assert all(torch.equal(a, b) for a, b in zip(out, generate(ours, prompts, 12)))


@pytest.mark.heavy  # 15 generations: make test and CI run it, make test-quick skips it
@pytest.mark.parametrize('shared,per_layer,final_cap', CONFIGS[:5])
def test_float32_logits_and_greedy_tokens_equal_transformers(shared, per_layer, final_cap):
    "As transformers builds it, in float32: logits within 1e-5 of the largest, its greedy tokens with every cache."
    hf = hf_gemma4(shared, per_layer, final_logit_softcapping=final_cap)
    ours = ours_of(hf)
    ids = torch.randint(3, 128, (2, 40))
    with torch.no_grad():
        theirs, mine = hf(ids).logits, ours(ids)
    assert ((mine - theirs).abs().max() / theirs.abs().max()) < 1e-5
    prompt = ids[:, :10]
    want = hf.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(generate(ours, prompt, 30), want)
    assert torch.equal(generate(ours, prompt, 30, static=True), want)
    assert torch.equal(generate(ours, prompt, 30, use_cache=False), want)


def test_a_left_padded_batch_gives_each_prompt_what_it_gives_alone_and_what_transformers_gives():
    hf = hf_gemma4()
    ours = ours_of(hf)
    torch.manual_seed(1)
    prompts = [torch.randint(3, 128, (5,)), torch.randint(3, 128, (12,))]
    both = generate(ours, prompts, 20)
    for row, prompt in zip(both, prompts):
        assert torch.equal(row, generate(ours, prompt[None], 20)[0])
    padded = torch.stack([torch.cat([torch.zeros(7, dtype=torch.long), prompts[0]]), prompts[1]])
    mask = (padded != 0).long(); mask[1] = 1
    theirs = hf.generate(padded, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(theirs[0, 7:], both[0]) and torch.equal(theirs[1], both[1])


def test_shared_layers_cache_nothing_and_a_model_without_caches_makes_its_own():
    ours = ours_of(hf_gemma4())
    caches = ours.new_caches()
    assert [type(c).__name__ for c in caches] == ['KVCache', 'KVCache', 'KVSource', 'KVSource', 'SharedKV', 'SharedKV']
    assert caches[4].source is caches[2] and caches[5].source is caches[3]
    ids = torch.randint(3, 128, (1, 24))
    with torch.no_grad():
        whole = ours(ids)
        stepped = torch.cat([ours(ids[:, :16], caches)] + [ours(ids[:, t:t + 1], caches) for t in range(16, 24)], 1)
    torch.testing.assert_close(stepped, whole, rtol=0, atol=1e-5)
    assert [len(c) for c in caches] == [7, 24, 7, 24, 0, 0]  # a window of 8 keeps 7 for the next token
    assert caches[5].num_seen == caches[3].num_seen == 24
    static = ours.new_caches(capacity=32)
    assert isinstance(static[2], KVSource) and isinstance(static[4], SharedKV)
    with pytest.raises(ValueError, match='token_ids and caches only'):
        ours(ids, document_ids=torch.zeros_like(ids))


def test_save_hf_writes_what_transformers_reads(tmp_path):
    hf = hf_gemma4()
    ours = ours_of(hf)
    folder = save_hf(ours, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.randint(3, 128, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=0, atol=0)


def test_kv_sources_follow_transformers_and_refuse_what_cannot_share():
    assert kv_sources(TYPES, 0) == [None] * 6
    assert kv_sources(TYPES, 2) == [None, None, None, None, 2, 3]
    assert kv_sources(TYPES, 3) == [None, None, None, 1, 2, 1]
    cfg = AutoConfig.for_model("gemma4_text", num_hidden_layers=6, layer_types=TYPES, num_kv_shared_layers=3)
    modes = cfg.kv_sharing_modes
    assert [m == 'reuse' for m in modes] == [s is not None for s in kv_sources(TYPES, 3)]
    with pytest.raises(ValueError, match='needs an earlier full_attention layer'):
        kv_sources(["sliding_attention"] * 3 + ["full_attention"], 1)
    with pytest.raises(ValueError, match=r'num_shared must be an int in \[0, 5\]'):
        kv_sources(TYPES, 6)


@pytest.mark.parametrize('setting,value,message', [
    ('attention_k_eq_v', True, 'attention_k_eq_v=True is not supported'),
    ('enable_moe_block', True, 'enable_moe_block=True is not supported'),
    ('use_double_wide_mlp', True, 'use_double_wide_mlp=True is not supported'),
    ('rope_parameters', {"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                         "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                rope_theta=1e6, factor=8.0)}, 'factor=8.0 is not supported'),
    ('per_layer_config', {'1': {'head_dim': 32}, '3': {'head_dim': 64}}, 'per_layer_config=.* is not supported'),
])
def test_from_hf_refuses_by_name_what_gemma4_lacks(setting, value, message):
    config = dict(model_type="gemma4_text", num_hidden_layers=6, layer_types=TYPES, hidden_size=64,
                  num_attention_heads=4, head_dim=16, intermediate_size=96, vocab_size=128) | {setting: value}
    with pytest.raises(ValueError, match=message):
        gemma4_config(config)


def test_the_published_defaults_build_proportional_rope_and_the_wide_full_heads():
    sizes = gemma4_config(dict(model_type="gemma4_text", num_hidden_layers=12, hidden_size=64,
                               num_attention_heads=4, vocab_size=128))
    assert sizes["global_head_dim"] == 512 and sizes["head_dim"] == 256 and sizes["rope_proportion"] == 0.25
    assert sizes["layer_types"][5] == sizes["layer_types"][11] == "full_attention"
    assert sizes["per_layer_dim"] == 256
