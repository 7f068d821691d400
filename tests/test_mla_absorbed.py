"""Issue 46, point 4: `LatentAttention` decodes through the latents (W_UK folded into the queries, W_UV after the
weighted sum) instead of rebuilding every cached key and value. Absorbed and rebuilt are compared in float64 by
forcing the choice (`_absorbs`) both ways; the cost of a decode step per cached token is counted with torch's
FlopCounterMode."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from selfattn_nbdev.decoding import StaticKVCache, generate
from selfattn_nbdev.generation import KVCache
from selfattn_nbdev.deepseek_v3 import DeepSeekV3, LatentAttention

YARN = dict(rope_type='yarn', factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1)
SIZES = dict(kv_rank=16, rope_dim=8, nope_dim=12, v_dim=10)


def _layer(q_rank=None, rope_scaling=YARN, bias=True, context=64, **sizes):
    torch.manual_seed(0)
    return LatentAttention(32, context, 4, **{**SIZES, **sizes}, q_rank=q_rank, rope_scaling=rope_scaling,
                           bias=bias).double().eval()


def _decode(layer, x, cache, monkeypatch, absorb, prompt=9, chunk=1):
    "The prompt at once, then `chunk` tokens a step, with the absorbed form forced on or off for every step."
    monkeypatch.setattr(layer, '_absorbs', lambda T, S: absorb)  # old code has no such choice: fails here
    with torch.no_grad():
        steps = [layer(x[:, :prompt], cache)]
        steps += [layer(x[:, t:t + chunk], cache) for t in range(prompt, x.shape[1], chunk)]
    monkeypatch.undo()
    return torch.cat(steps, 1)


@pytest.mark.parametrize('q_rank', [None, 24])
@pytest.mark.parametrize('chunk', [1, 3])
def test_absorbed_equals_rebuilt_with_a_growing_cache(q_rank, chunk, monkeypatch):
    "Yarn, biases, queries with or without their latent; one or three tokens a step: within 1e-12 in float64."
    layer = _layer(q_rank)
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    absorbed = _decode(layer, x, KVCache(), monkeypatch, True, chunk=chunk)
    rebuilt = _decode(layer, x, KVCache(), monkeypatch, False, chunk=chunk)
    with torch.no_grad(): whole = layer(x)
    assert (absorbed - rebuilt).abs().max() < 1e-12
    assert (absorbed - whole).abs().max() < 1e-12


def test_absorbed_equals_rebuilt_with_left_padding(monkeypatch):
    "A batch of 2 in a StaticKVCache, the second row 4 tokens of padding on the left; every output within 1e-12."
    layer, pads = _layer(q_rank=24), torch.tensor([0, 4])
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    absorbed = _decode(layer, x, StaticKVCache(20, pads=pads), monkeypatch, True)
    rebuilt = _decode(layer, x, StaticKVCache(20, pads=pads), monkeypatch, False)
    assert (absorbed - rebuilt).abs().max() < 1e-12
    with torch.no_grad(): alone = layer(x[1:, 4:])       # the padded row's real tokens, with no padding at all
    assert (absorbed[1:, 4:] - alone).abs().max() < 1e-12


def test_the_rule_absorbs_decoding_and_rebuilds_a_prompt():
    "One token over many cached is absorbed; a whole prompt (T = S) is rebuilt; at V3's sizes the cut is near 170."
    layer = _layer()
    assert layer._absorbs(1, 2) and layer._absorbs(1, 32_768) and layer._absorbs(4, 1000)
    assert not layer._absorbs(9, 9) and not layer._absorbs(1, 1)
    with torch.device('meta'):
        v3 = LatentAttention(7168, 163_840, 128, kv_rank=512, rope_dim=64, nope_dim=128, v_dim=128)
    assert v3._absorbs(160, 32_768) and not v3._absorbs(180, 32_768)


def test_greedy_tokens_of_a_model_equal_with_either_form(monkeypatch):
    "DeepSeekV3 (two blocks, yarn, q latent), two prompts of different lengths: the same 24 greedy tokens."
    torch.manual_seed(0)
    model = DeepSeekV3(97, 64, d_model=32, num_heads=4, num_layers=2, d_hidden=64, q_rank=24, rope_scaling=YARN,
                       **SIZES).double().eval()
    for p in model.parameters(): p.data.mul_(3)        # spread logits: no near ties between tokens
    prompts = [torch.randint(0, 97, (n,)) for n in (11, 6)]
    chosen = []
    for attn in (b.attn for b in model.blocks):
        monkeypatch.setattr(attn, '_absorbs', lambda T, S, f=attn._absorbs: chosen.append(f(T, S)) or f(T, S))
    absorbed = generate(model, prompts, 24, stop_ids=[])   # a list: one row per prompt
    assert any(chosen) and not all(chosen)             # prompts rebuilt, steps absorbed
    for attn in (b.attn for b in model.blocks): monkeypatch.setattr(attn, '_absorbs', lambda T, S: False)
    rebuilt = generate(model, prompts, 24, stop_ids=[])
    assert all(torch.equal(a, r) for a, r in zip(absorbed, rebuilt, strict=True))
    assert [len(a) for a in absorbed] == [11 + 24, 6 + 24]


def _per_cached_token(layer, d_c, d_R, lengths=(1024, 8192)):
    "FLOPs torch counts for one decode step over S cached tokens, as a slope in S: (F(S2) - F(S1)) / (S2 - S1)."
    flops = []
    for S in lengths:
        cache, half = KVCache(), torch.randn(1, 1, S, (d_c + d_R) // 2)  # the cached latent rows, in two halves
        cache.append(half, half.clone())
        with torch.no_grad(), FlopCounterMode(display=False) as counter: layer(torch.randn(1, 1, 64), cache)
        flops.append(counter.get_total_flops())
    return (flops[1] - flops[0]) / (lengths[1] - lengths[0])


@pytest.mark.parametrize('nope_dim, v_dim', [(16, 16), (64, 48)])
def test_a_decode_step_costs_heads_times_latent_width_per_cached_token(nope_dim, v_dim):
    """Per cached token, scores over d_c + d_R and a weighted sum over d_c for each of h heads: at most
    2 h (2 d_c + d_R) FLOPs, whatever the heads' key and value sizes; rebuilding would cost 2 d_c h (d_nope + d_v)
    more."""
    h, d_c, d_R = 4, 32, 8
    torch.manual_seed(0)
    layer = LatentAttention(64, 9000, h, kv_rank=d_c, rope_dim=d_R, nope_dim=nope_dim, v_dim=v_dim).eval()
    slope = _per_cached_token(layer, d_c, d_R)
    assert slope <= 2 * h * (2 * d_c + d_R) * 1.01
    assert 2 * d_c * h * (nope_dim + v_dim) > 10 * slope
