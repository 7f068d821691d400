"""DeepSeek Sparse Attention (nbs/19_sparse.ipynb): sparse attention by gather equals dense attention masked to the
kept keys (float64, forward and gradients); the Indexer equals transformers' DeepseekV32Indexer on the same weights;
indexer_kl_loss is DeepSeek-V3.2's KL loss, over the causal keys (the warm-up) or the kept ones (the sparse stage);
and a tiny random DeepSeek-V3.2 built by transformers, its weights in the package's DeepSeekV3 with
SparseLatentAttention blocks, gives the same logits, the same greedy tokens, cached and uncached, on a left-padded
batch of texts longer than index_topk."""
import math

import pytest
import torch

from selfattn_nbdev.decoding import StaticKVCache, generate
from selfattn_nbdev.generation import KVCache
from selfattn_nbdev.deepseek_v3 import DeepSeekV3, LatentAttention, deepseek_weight_map
from selfattn_nbdev.models import load_hf_state_dict
from selfattn_nbdev.sparse import (Indexer, SparseLatentAttention, index_mask, indexer_kl_loss, lightning_indexer,
                                   sparse_attention, topk_indices)

transformers = pytest.importorskip('transformers')

F64 = torch.float64


def dense_masked(queries, keys, values, indices, scale=None):
    "Dense softmax attention under the mask of the kept keys: the definition sparse attention must equal."
    h, g, S = queries.shape[1], keys.shape[1], keys.shape[2]
    K, V = keys.repeat_interleave(h // g, 1), values.repeat_interleave(h // g, 1)
    scale = queries.shape[-1] ** -0.5 if scale is None else scale
    omega = (queries @ K.transpose(2, 3) * scale).masked_fill(~index_mask(indices, S)[:, None], -math.inf)
    return torch.softmax(omega, -1).nan_to_num(0.0) @ V


@pytest.mark.parametrize('h,g,T,S,k,block', [(4, 4, 7, 7, 3, 128), (8, 2, 9, 12, 5, 4), (6, 1, 16, 16, 16, 5)])
def test_sparse_attention_is_dense_attention_masked_to_the_kept_keys(h, g, T, S, k, block):
    torch.manual_seed(0)
    q = torch.randn(2, h, T, 8, dtype=F64, requires_grad=True)
    K = torch.randn(2, g, S, 8, dtype=F64, requires_grad=True)
    V = torch.randn(2, g, S, 6, dtype=F64, requires_grad=True)
    indices = topk_indices(torch.randn(2, T, S, dtype=F64), k)
    ours = sparse_attention(q, K, V, indices, scale=0.3, block_size=block)
    ref = dense_masked(q, K, V, indices, 0.3)
    assert (ours - ref).abs().max() < 1e-12
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(ours, (q, K, V), grad), torch.autograd.grad(ref, (q, K, V), grad)):
        assert (a - b).abs().max() < 1e-12
    assert (ours - torch.nn.functional.scaled_dot_product_attention(   # the mask matters (unless k keeps all)
        q, K.repeat_interleave(h // g, 1), V.repeat_interleave(h // g, 1), scale=0.3,
        is_causal=False)).abs().max() > 1e-3


def test_values_that_are_the_keys_first_numbers_are_gathered_once():
    "MLA's absorbed form: values are a view of the latents; the shortcut must give the same numbers and gradients."
    torch.manual_seed(1)
    q = torch.randn(1, 4, 10, 12, dtype=F64, requires_grad=True)
    latent = torch.randn(1, 1, 10, 12, dtype=F64, requires_grad=True)
    indices = topk_indices(torch.randn(1, 10, 10, dtype=F64), 3)
    ours = sparse_attention(q, latent, latent[..., :8], indices)
    ref = dense_masked(q, latent, latent[..., :8], indices)
    assert (ours - ref).abs().max() < 1e-12
    a = torch.autograd.grad(ours.sum(), latent)[0]
    b = torch.autograd.grad(ref.sum(), latent)[0]
    assert (a - b).abs().max() < 1e-12


def test_topk_indices_keeps_the_best_allowed_keys_in_text_order():
    scores = torch.tensor([[[5., 1., 4., 2., 3.]] * 5])                      # every query scores the keys alike
    idx = topk_indices(scores, 2)
    assert idx[0].tolist() == [[-1, 0], [0, 1], [0, 2], [0, 2], [0, 2]]       # causal; fewer than k: -1 (first)
    ties = torch.zeros(1, 1, 6)
    assert topk_indices(ties, 2, torch.ones(1, 6, dtype=torch.bool)).tolist() == [[[0, 1]]]   # ties: earliest
    pad = torch.cat([torch.full((1, 1, 3), 7.0), ties], -1)                   # the same row behind 3 padding keys
    allowed = torch.tensor([[False] * 3 + [True] * 6])
    assert topk_indices(pad, 2, allowed).tolist() == [[[3, 4]]]


def test_lightning_indexer_is_its_formula():
    torch.manual_seed(0)
    q, k, w = torch.randn(2, 3, 5, 4, dtype=F64), torch.randn(2, 1, 7, 4, dtype=F64), torch.randn(2, 5, 3, dtype=F64)
    I = lightning_indexer(q, k, w, scale=0.7)
    ref = torch.einsum('btj,bjts->bts', w, torch.relu(0.7 * q @ k.transpose(2, 3)))
    assert I.shape == (2, 5, 7) and (I - ref).abs().max() < 1e-12



def _attention(b, h, T, S, seed):
    "Random causal softmax weights (b, h, T, S), the queries being the last T of S keys."
    torch.manual_seed(seed)
    future = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
    return torch.softmax(torch.randn(b, h, T, S, dtype=F64).masked_fill(future, -math.inf), -1), ~future


def test_indexer_kl_loss_is_the_kl_divergence_to_the_head_summed_weights():
    "The dense warm-up: sum over t of KL(p_t || softmax(I_t)) over the causal keys, averaged over the rows."
    alpha, allowed = _attention(2, 3, 5, 7, seed=0)
    scores = torch.randn(2, 5, 7, dtype=F64)
    p = alpha.sum(1) / 3
    q = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1)
    ref = sum(p[b, t, s] * math.log(p[b, t, s] / q[b, t, s])
              for b in range(2) for t in range(5) for s in range(7) if allowed[t, s]) / 2
    assert abs(indexer_kl_loss(scores, alpha) - ref) < 1e-12
    assert abs(indexer_kl_loss(p.log(), alpha)) < 1e-12                      # softmax(I_t) = p_t: nothing to learn
    assert abs(indexer_kl_loss(scores.float(), alpha.float()) - ref) < 1e-5  # float32 scores, float32 target


def test_indexer_kl_loss_over_the_kept_keys_and_its_gradient():
    "The sparse stage: only the kept keys count, the target renormalised over them; gradients reach the scores only."
    alpha, allowed = _attention(2, 4, 8, 8, seed=1)
    alpha.requires_grad_(True)
    scores = torch.randn(2, 8, 8, dtype=F64, requires_grad=True)
    kept = index_mask(topk_indices(scores.detach(), 3), 8)                  # (b, T, S)
    loss = indexer_kl_loss(scores, alpha, kept)
    p = (alpha.detach().sum(1) * kept)
    p = p / p.sum(-1, keepdim=True)
    log_q = torch.log_softmax(scores.detach().masked_fill(~kept, -math.inf), -1)
    ref = torch.where(kept, p * (p.log() - log_q), 0.0).sum() / 2
    assert abs(loss - ref) < 1e-12
    elsewhere = scores.detach().masked_fill(~kept, 100.0)                   # scores outside the kept keys: no matter
    assert abs(indexer_kl_loss(elsewhere, alpha, kept) - ref) < 1e-12
    loss.backward()
    assert alpha.grad is None and scores.grad[~kept].abs().max() == 0 and scores.grad.abs().sum() > 0
    assert torch.isfinite(indexer_kl_loss(scores, alpha, torch.zeros(8, 8, dtype=torch.bool)))  # no key: 0


def test_training_the_indexer_by_its_loss_keeps_more_of_the_attention():
    "A few dozen Adam steps on the indexer alone toward a fixed attention raise the weight its top k hold."
    torch.manual_seed(0)
    alpha, _ = _attention(1, 2, 16, 16, seed=2)
    alpha = alpha ** 4 / (alpha ** 4).sum(-1, keepdim=True)                  # sharper, still causal
    q_I = torch.randn(1, 4, 16, 8, dtype=F64, requires_grad=True)
    k_I = torch.randn(1, 1, 16, 8, dtype=F64, requires_grad=True)
    w = torch.randn(1, 16, 4, dtype=F64, requires_grad=True)
    kept = lambda: index_mask(topk_indices(lightning_indexer(q_I, k_I, w).detach(), 4), 16)
    share = lambda: (alpha * kept()[:, None]).sum(-1)[..., 4:].mean().item()
    before = share()
    optimizer = torch.optim.Adam([q_I, k_I, w], lr=0.05)
    for _ in range(100):
        loss = indexer_kl_loss(lightning_indexer(q_I, k_I, w), alpha)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
    assert share() > before + 0.2

@pytest.mark.parametrize('call,message', [
    (lambda: topk_indices(torch.zeros(1, 3, 3), 0), 'k must be an integer >= 1'),
    (lambda: topk_indices(torch.zeros(1, 3, 3), 2.5), 'k must be an integer >= 1'),
    (lambda: topk_indices(torch.zeros(3, 3), 2), 'scores must be a float tensor (b, T, S)'),
    (lambda: topk_indices(torch.zeros(1, 3, 3), 2, torch.ones(3, 4, dtype=torch.bool)), 'allowed must be a bool'),
    (lambda: sparse_attention(*torch.zeros(3, 1, 2, 4, 8), torch.full((1, 4, 2), 4)), 'indices must lie in [-1, 4)'),
    (lambda: sparse_attention(*torch.zeros(3, 1, 2, 4, 8), torch.full((1, 4, 2), -2)), 'got values from -2'),
    (lambda: sparse_attention(*torch.zeros(3, 1, 2, 4, 8), torch.zeros(1, 3, 2, dtype=torch.long)),
     'for each of the 4 queries'),
    (lambda: sparse_attention(*torch.zeros(3, 1, 2, 4, 8), torch.zeros(1, 4, 2)), 'indices must be an integer'),
    (lambda: sparse_attention(torch.zeros(1, 3, 4, 8), *torch.zeros(2, 1, 2, 4, 8), torch.zeros(1, 4, 2).long()),
     'g must divide h'),
    (lambda: sparse_attention(*torch.zeros(3, 1, 2, 4, 8), torch.zeros(1, 4, 2).long(), block_size=0),
     'block_size must be a positive integer'),
    (lambda: lightning_indexer(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 3, 2)),
     'keys (b, 1, S, d)'),
    (lambda: Indexer(64, 32, rope_dim=256), 'rope_dim must be even and at most head_dim=128'),
    (lambda: indexer_kl_loss(torch.zeros(1, 3, 3), torch.zeros(1, 2, 3, 4)), 'attn_weights (b, h, T, S)'),
    (lambda: indexer_kl_loss(torch.zeros(3, 3), torch.zeros(1, 2, 3, 3)), 'scores must be (b, T, S)'),
    (lambda: SparseLatentAttention(64, 100, 4, 32, 8, 16, 16, q_rank=None), 'q_rank must be a positive integer'),
    (lambda: SparseLatentAttention(64, 100, 4, 32, 8, 16, 16, q_rank=24, index_topk=0), 'index_topk must be'),
])
def test_bad_inputs_are_named(call, message):
    with pytest.raises(ValueError, match=None) as e: call()
    assert message in str(e.value), str(e.value)


SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=16, index_topk=6, index_head_dim=16, index_n_heads=16, first_k_dense_replace=2,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)


@pytest.fixture(scope='module')
def pair():
    "transformers' tiny DeepSeek-V3.2 (eager, float32, weights far from their init) and the package's, same weights."
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model('deepseek_v32', **SMALL)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation='eager').float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if 'norm.weight' in name else 0.0, 0.15)
    L = SMALL['num_hidden_layers']
    latent = dict(kv_rank=32, rope_dim=8, nope_dim=16, v_dim=16, q_rank=48)
    ours = DeepSeekV3(97, 256, 64, 4, L, 128, norm_eps=config.rms_norm_eps, **latent)
    for block in ours.blocks:  # DeepSeek-V3's blocks, each with the sparse attention of V3.2
        block.attn = SparseLatentAttention(64, 256, 4, **latent, index_topk=6, index_heads=16, index_dim=16)
    table = deepseek_weight_map(L, q_rank=48) + [
        (f'layers.{i}.self_attn.indexer.{n}', (f'blocks.{i}.attn.indexer.{n}',), False) for i in range(L)
        for n in ('wq_b.weight', 'wk.weight', 'k_norm.weight', 'k_norm.bias', 'weights_proj.weight')]
    load_hf_state_dict(ours, hf.state_dict(), table, prefix='model.')
    return hf, ours.eval()


def test_indexer_equals_transformers_deepseek_v32_indexer(pair):
    hf, _ = pair
    theirs = hf.model.layers[1].self_attn
    ours = Indexer(64, 48, 16, 16, 8)
    ours.load_state_dict(theirs.indexer.state_dict())                       # transformers' names load as they are
    torch.manual_seed(2)
    x = torch.randn(3, 25, 64)
    positions = torch.arange(25)[None].expand(3, -1)
    cos, sin = hf.model.rotary_emb(x, positions)
    causal = torch.ones(25, 25, dtype=torch.bool).tril().expand(3, -1, -1)
    with torch.no_grad():
        c_q = theirs.q_a_layernorm(theirs.q_a_proj(x))
        chosen = theirs.indexer(x, c_q, (cos, sin), causal, positions).long()
        scores = ours(x, c_q, ours.index_keys(x, cos[:, None], sin[:, None]), cos[:, None], sin[:, None])
    chosen = chosen.masked_fill(~causal.gather(2, chosen), -1).sort(-1).values
    assert torch.equal(topk_indices(scores, 6), chosen)
    assert (chosen >= 0).sum() < 3 * 25 * 25 / 2                            # keys were left out


def test_logits_equal_transformers_on_a_left_padded_batch(pair):
    hf, ours = pair
    torch.manual_seed(3)
    ids = torch.randint(3, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :9] = 0
    ids[1, :9] = 0                                                          # row 1: 21 tokens behind 9 pads
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        mine = ours(ids, ours.new_caches(64, torch.tensor([0, 9])))
        alone = ours(ids[1:, 9:])
        dense = DeepSeekV3(97, 256, 64, 4, 2, 128, norm_eps=1e-6, kv_rank=32, rope_dim=8, nope_dim=16, v_dim=16,
                           q_rank=48)
        dense.load_state_dict(ours.state_dict(), strict=False)               # the same model, every key kept
        dense_logits = dense.eval()(ids[:1])
    real = mask.bool()
    assert (theirs - mine)[real].abs().max() < 1e-5
    assert (mine[1, 9:] - alone[0]).abs().max() < 1e-5                       # padding changes nothing
    assert (dense_logits[0] - mine[0]).abs().max() > 1e-2                    # and sparsity changes the logits


def test_sixteen_greedy_tokens_equal_transformers_cached_and_uncached(pair):
    hf, ours = pair
    torch.manual_seed(4)
    ids = torch.randint(3, 97, (2, 30))
    prompts = [ids[0], ids[1, 9:]]
    padded = ids.clone()
    padded[1, :9] = 0
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :9] = 0
    with torch.no_grad():
        theirs = hf.generate(padded, attention_mask=mask, max_new_tokens=16, do_sample=False)[:, 30:]
    cached = generate(ours, prompts, 16)
    uncached = generate(ours, prompts, 16, use_cache=False)
    assert [row[-16:].tolist() for row in cached] == theirs.tolist()
    assert [row.tolist() for row in cached] == [row.tolist() for row in uncached]
    whole = generate(ours, ids, 16)                                         # one unpadded batch, growing caches
    with torch.no_grad():
        assert torch.equal(whole[:, 30:], hf.generate(ids, max_new_tokens=16, do_sample=False)[:, 30:])


def test_sparse_latent_attention_cached_equals_uncached_in_float64():
    torch.manual_seed(0)
    layer = SparseLatentAttention(64, 100, 4, 32, 8, 16, 16, q_rank=24, index_topk=5, index_heads=4,
                                  index_dim=16).double().eval()
    x = torch.randn(2, 20, 64, dtype=F64)
    with torch.no_grad():
        whole = layer(x)
        cache = KVCache()
        steps = torch.cat([layer(x[:, :7], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(7, 20)], 1)
        static = StaticKVCache(32, pads=torch.tensor([3, 0]))
        padded = layer(torch.cat([torch.zeros(2, 3, 64, dtype=F64), x], 1)[:, :23], cache=static)
    assert (steps - whole).abs().max() < 1e-12
    assert (padded[0, 3:] - whole[0]).abs().max() < 1e-12
    dense = LatentAttention(64, 100, 4, 32, 8, 16, 16, q_rank=24).double()
    dense.load_state_dict(layer.state_dict(), strict=False)
    with torch.no_grad(): assert (dense(x) - whole).abs().max() > 1e-3     # five keys of twenty: not dense


def test_sparse_latent_attention_learns_through_the_kept_keys():
    "Gradients reach MLA's weights; the indexer's choice is a top-k, through which no gradient flows (as in V3.2)."
    torch.manual_seed(0)
    layer = SparseLatentAttention(64, 100, 4, 32, 8, 16, 16, q_rank=24, index_topk=4, index_heads=4, index_dim=16)
    layer(torch.randn(2, 12, 64)).sum().backward()
    assert layer.W_UKV.weight.grad.abs().sum() > 0 and layer.W_DQ.weight.grad.abs().sum() > 0
    assert layer.indexer.wq_b.weight.grad is None or layer.indexer.wq_b.weight.grad.abs().sum() == 0
