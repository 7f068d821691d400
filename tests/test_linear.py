"""The gated delta rule (nbs/18_linear.ipynb) against transformers' own torch implementations, and the package's
GatedDeltaNet layer inside transformers' Qwen3-Next and Qwen3.5 models; Kimi Linear with the package's KDA kernels in
place of its own. Tiny models built offline from configs, float32; nothing is downloaded."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip('transformers')
from conftest import check_against_transformers, left_padded_batch, with_package_linear_layers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next  # noqa: E402

from selfattn_nbdev.linear import (GatedDeltaNet, RecurrentCache, chunk_gated_delta_rule, chunk_kda,  # noqa: E402
                                   fused_recurrent_gated_delta_rule, fused_recurrent_kda)

transformers.logging.set_verbosity_error()  # the "flash-linear-attention is not installed" notice

OURS = {'chunk_gdn': chunk_gated_delta_rule, 'recurrent_gdn': fused_recurrent_gated_delta_rule,
        'chunk_kda': chunk_kda, 'recurrent_kda': fused_recurrent_kda}
THEIRS = {'chunk_gdn': hf_next.torch_chunk_gated_delta_rule, 'recurrent_gdn': hf_next.torch_recurrent_gated_delta_rule,
          'chunk_kda': hf_kimi.chunk_kimi_delta_attention, 'recurrent_kda': hf_kimi.recurrent_kimi_delta_attention}


def rule_inputs(kda: bool, b=2, T=37, h=2, h_v=4, d_k=16, d_v=8, dtype=torch.float32, seed=0, strong=False):
    "q, k (b, T, h, d_k), v (b, T, h_v, d_v), g (b, T, h_v[, d_k]) <= 0, beta in [0, 1], S0. KDA: h = h_v."
    gen = torch.Generator().manual_seed(seed)
    if kda: h = h_v
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    g = -F.softplus(r(b, T, h_v, d_k) if kda else r(b, T, h_v)) * (30 if strong else 1)
    return r(b, T, h, d_k), r(b, T, h, d_k), r(b, T, h_v, d_v), g, torch.rand(b, T, h_v, generator=gen,
                                                                               dtype=dtype), r(b, h_v, d_k, d_v)


def run(fn, name, x, S0, chunk):
    kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if name.startswith('chunk'): kw['chunk_size'] = chunk
    q, k, v, g, beta = x                  # g and beta by name: fla's fused_recurrent_gated_delta_rule puts gk, gv first
    return fn(q, k, v, g=g, beta=beta, **kw)


@pytest.mark.parametrize('with_state', [False, True], ids=['zero_state', 'initial_state'])
@pytest.mark.parametrize('name', list(OURS))
def test_rules_equal_transformers_forward_and_gradients(name, with_state, record_diff):
    "T = 37 with chunks of 16 (no multiple), value heads grouped over key heads (GDN): outputs, final state, grads."
    x = [t.requires_grad_() for t in rule_inputs('kda' in name)]
    S0 = x.pop().detach().requires_grad_() if with_state else (x.pop(), None)[1]
    leaves = x + ([S0] if with_state else [])
    results = []
    for fn in (OURS[name], THEIRS[name]):
        o, S = run(fn, name, x, S0, chunk=16)
        grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.shape[-1])).sum() + S.sum(), leaves)
        results.append((o, S, grads))
    (o, S, grads), (o_hf, S_hf, grads_hf) = results
    assert record_diff(name, 'transformers', o, o_hf) < 1e-5
    assert record_diff(name + ' state', 'transformers', S, S_hf) < 1e-5
    for a, b in zip(grads, grads_hf):
        assert record_diff(name + ' grads', 'transformers', a, b) < 1e-5


@pytest.mark.parametrize('kda', [False, True], ids=['gdn', 'kda'])
@pytest.mark.parametrize('strong', [False, True], ids=['mild', 'strong_decay'])
def test_chunked_equals_recurrence_in_float64(kda, strong, record_diff):
    "The WY form against the token loop, strong decays included (exp(-30 softplus) underflows without the masking)."
    *x, S0 = rule_inputs(kda, T=45, dtype=torch.float64, strong=strong)
    chunked, recurrent = (chunk_kda, fused_recurrent_kda) if kda else (chunk_gated_delta_rule,
                                                                      fused_recurrent_gated_delta_rule)
    o1, S1 = run(chunked, 'chunk', x, S0, chunk=8)
    o2, S2 = run(recurrent, 'recurrent', x, S0, chunk=None)
    assert torch.isfinite(o1).all()
    assert record_diff('chunked', 'recurrence', o1, o2) < 1e-12
    assert record_diff('chunked state', 'recurrence', S1, S2) < 1e-12


def test_bad_inputs_are_named():
    q, k, v, g, beta, S0 = rule_inputs(False)
    cases = [(dict(g=-g), 'g is a log-decay and must be <= 0'),
             (dict(beta=beta + 1), 'beta must lie in [0, 1]'),
             (dict(beta=beta - 1), 'beta must lie in [0, 1]'),
             (dict(initial_state=S0.transpose(-1, -2)), 'initial_state must be 2x4x16x8 (b, h_v, d_k, d_v); got 2x4x8x16'),
             (dict(g=g[..., None]), 'g must be 2x37x4 (b, T, h_v); got g 2x37x4x1'),
             (dict(beta=beta[:, :-1]), 'beta must be 2x37x4 (b, T, h_v); got 2x36x4'),
             (dict(k=k[:, :-1]), 'q and k must both be (b, T, h, d_k)'),
             (dict(v=v[:, :, :3]), 'v must be (b=2, T=37, h_v, d_v) with h_v a multiple of h=2; got v 2x37x3x8'),
             (dict(scale=0.0), 'scale must be a positive number or None'),
             (dict(q=q.numpy()), 'q must be a tensor')]
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        for change, message in cases:
            args = dict(q=q, k=k, v=v, g=g, beta=beta) | change
            with pytest.raises((ValueError, TypeError)) as e: fn(**args)
            assert message in str(e.value), (change.keys(), str(e.value))
    with pytest.raises(ValueError, match='chunk_size must be a positive integer'):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    kq, kk, kv, kg, kbeta, _ = rule_inputs(True)
    with pytest.raises(ValueError, match=r'g must be 2x37x4x16 \(b, T, h_v, d_k\)'):
        chunk_kda(kq, kk, kv, kg[..., 0], kbeta)
    with pytest.raises(ValueError, match='g is a log-decay'):
        fused_recurrent_kda(kq, kk, kv, -kg, kbeta)


def test_layer_errors_and_cache():
    with pytest.raises(ValueError, match="layout must be one of"): GatedDeltaNet(32, 2, 4, 8, 4, layout='mamba')
    with pytest.raises(ValueError, match='num_v_heads must be a multiple of num_k_heads; got 3 and 2'):
        GatedDeltaNet(32, 2, 3, 8, 4)
    with pytest.raises(ValueError, match='head_k_dim must be a positive integer'): GatedDeltaNet(32, 2, 4, 0, 4)
    layer, cache = GatedDeltaNet(32, 2, 4, 8, 4), RecurrentCache()
    with torch.no_grad():
        layer(torch.randn(2, 5, 32), cache=cache)
        held = cache.state.numel() + cache.conv.numel()
        for _ in range(3): layer(torch.randn(2, 100, 32), cache=cache)   # 305 tokens: the cache does not grow
        assert cache.state.numel() + cache.conv.numel() == held and cache.seen == 305
        with pytest.raises(ValueError, match=r"the cache's conv window is \(2, 48, 3\) but this call needs \(3, 48, 3\)"):
            layer(torch.randn(3, 1, 32), cache=cache)
        with pytest.raises(ValueError, match='attention_mask must be 2x5 \\(b, T\\); got 2x4'):
            layer(torch.randn(2, 5, 32), attention_mask=torch.ones(2, 4))
        with pytest.raises(ValueError, match='only without a cache'):
            layer(torch.randn(1, 5, 32), cache=RecurrentCache(), cu_seq_lens_q=torch.tensor([0, 2, 5]))


@pytest.mark.parametrize('layout', ['qwen3_next', 'qwen3_5'])
def test_layer_cached_equals_uncached_float64(layout, record_diff):
    "A prompt longer than a chunk, then single tokens and a multi-token continuation, against one call."
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 4, layout=layout, chunk_size=16).double()
    x = torch.randn(2, 60, 32, dtype=torch.float64)
    cache = RecurrentCache()
    with torch.no_grad():
        parts = [layer(x[:, :40], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(40, 50)]
        parts.append(layer(x[:, 50:], cache=cache))
        assert record_diff('GatedDeltaNet cached', 'uncached', torch.cat(parts, 1), layer(x)) < 1e-12


SMALL = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
CONFIGS = {
    'qwen3_next': dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    'qwen3_5_text': dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=8),
    'kimi_linear': dict(num_key_value_heads=4, linear_num_heads=4, linear_head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, layer_types=['linear_attention', 'linear_attention', 'linear_attention',
                                                    'full_attention']),
}


def tiny(model_type: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **(SMALL | CONFIGS[model_type]))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture
def kimi_with_package_kernels(monkeypatch):
    "Kimi Linear's KDA kernels replaced by the package's chunk_kda / fused_recurrent_kda (its layer is its own)."
    calls = []
    def install():
        monkeypatch.setattr(hf_kimi, 'chunk_kimi_delta_attention', wrap(chunk_kda))
        monkeypatch.setattr(hf_kimi, 'recurrent_kimi_delta_attention', wrap(fused_recurrent_kda))
        return calls
    def wrap(fn):
        def kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                   cu_seqlens=None, **kwargs):
            assert cu_seqlens is None
            calls.append(fn.__name__)
            return fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return kernel
    return install


@pytest.mark.parametrize('model_type', ['qwen3_next', 'qwen3_5_text'])
def test_package_layer_inside_transformers(model_type, record_diff):
    theirs = tiny(model_type)
    ours = with_package_linear_layers(theirs, expected=3)
    assert all(type(b.linear_attn) is GatedDeltaNet for b in ours.model.layers if hasattr(b, 'linear_attn'))
    check_against_transformers(theirs, ours, *left_padded_batch(128), record_diff, model_type)


def test_package_kernels_inside_kimi_linear(kimi_with_package_kernels, record_diff):
    theirs = tiny('kimi_linear')
    ids, mask = left_padded_batch(128)
    with torch.no_grad():
        reference = theirs(ids, attention_mask=mask).logits
        hf_gen = theirs.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    calls = kimi_with_package_kernels()   # from here on, the package's kernels
    with torch.no_grad():
        ours = theirs(ids, attention_mask=mask).logits
        got = theirs.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        uncached = theirs.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   use_cache=False)
    assert 'chunk_kda' in calls and 'fused_recurrent_kda' in calls
    real = mask.bool()
    assert record_diff('kimi_linear logits', 'transformers', ours[real], reference[real]) < 1e-5
    assert torch.equal(got, hf_gen) and torch.equal(uncached, got)


def test_package_functions_in_qwen35s_own_kernel_slots(monkeypatch, record_diff):
    """chunk_gated_delta_rule and fused_recurrent_gated_delta_rule put, unwrapped, where transformers' Qwen3.5 calls
    fla: it hands them what it hands every kernel (use_cache, ...), which fla takes and leaves unread, and so must they.
    Logits of a padded batch and 12 greedy tokens (prefill by the chunked form, each step by the recurrent one)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35
    theirs = tiny('qwen3_5_text')
    ids, mask = left_padded_batch(128)
    generate = lambda: theirs.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                       do_sample=False)
    with torch.no_grad(): reference, expected = theirs(ids, attention_mask=mask).logits, generate()
    monkeypatch.setattr(hf35, 'torch_chunk_gated_delta_rule', chunk_gated_delta_rule)
    monkeypatch.setattr(hf35, 'torch_recurrent_gated_delta_rule', fused_recurrent_gated_delta_rule)
    with torch.no_grad(): ours, got = theirs(ids, attention_mask=mask, use_cache=True).logits, generate()
    real = mask.bool()
    assert record_diff('qwen3_5 logits, package kernels', 'transformers', ours[real], reference[real]) < 1e-5
    assert torch.equal(got, expected)
