"""The package as an attention implementation of transformers (selfattn_nbdev.hf, page 17): every family of
bench/hf_route.py against eager attention (logits, the gradients of a training step, greedy tokens), the routes it
takes (run by run, Flex, explicit), the mask it is given, and what it refuses by name."""
import subprocess, sys

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import (blockwise_overlay, causal_mask_function, chunked_causal_mask_function,
                                        or_masks, sdpa_mask, sliding_window_causal_mask_function)

from bench.hf_route import FAMILIES, REFUSED, VOCAB, padded_batch, prove, refusal, tiny
from selfattn_nbdev import hf
from selfattn_nbdev.hf import HFMask, attend, hf_attention, hf_mask, register
from selfattn_nbdev.masks import and_masks, dense_mask, key_padding
from selfattn_nbdev.kernels import flex_mode


@pytest.fixture(scope='module', autouse=True)
def registered():
    register()


@pytest.mark.parametrize('model_type', FAMILIES)
def test_family_agrees_with_eager(model_type):
    "Logits within 1e-5 and gradients within 1e-4 (relative), and the same 16 greedy tokens from a padded batch."
    r = prove(model_type)
    assert r['logits'] <= 1e-5, r
    assert r['gradients'] <= 1e-4, r
    assert r['same_tokens'] and r['new_tokens'] == 16, r


def count_calls(monkeypatch, name: str) -> list:
    "Wrap selfattn_nbdev.hf's `name` so that every call is counted; returns the list that grows."
    calls, real = [], getattr(hf, name)
    monkeypatch.setattr(hf, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def eager_and_ours(model_type: str, T: int, pads: int, **context) -> tuple:
    "Logits of eager and of selfattn_nbdev on a batch of T tokens whose second row has `pads` pads on the left."
    model = tiny(model_type)
    ids, attention_mask = padded_batch(T, pads)
    out = {}
    with torch.no_grad():
        for name in ('eager', 'selfattn_nbdev'):
            model.set_attn_implementation(name)
            out[name] = model(ids, attention_mask=attention_mask, **context).logits
    real = attention_mask.bool()
    return out['eager'][real], out['selfattn_nbdev'][real], out['selfattn_nbdev']


@pytest.mark.parametrize('model_type', ['llama', 'mistral', 'deepseek_v3'])
def test_padding_attends_run_by_run_on_a_cpu(model_type, monkeypatch):
    "From RUNS_MIN_TOKENS tokens a CPU attends each row's real tokens alone (a window, values of another width too)."
    varlen, runs = count_calls(monkeypatch, 'varlen_attend'), count_calls(monkeypatch, '_cpu_runs')
    theirs, ours, everything = eager_and_ours(model_type, 1100, 300)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
    assert len(varlen) == 2 and len(runs) == 1  # two blocks, one search for the runs
    assert torch.isfinite(everything).all()      # padded queries too


@pytest.mark.parametrize('model_type', ['gpt_oss', 'gemma2'])
def test_sinks_and_cap_go_run_by_run_explicitly(model_type, monkeypatch):
    "Sinks and the soft cap change the scores: on a CPU from RUNS_MIN_TOKENS tokens, the explicit path run by run."
    by_run = count_calls(monkeypatch, '_by_run')
    theirs, ours, everything = eager_and_ours(model_type, 1100, 300)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
    assert len(by_run) == 2 and torch.isfinite(everything).all()


@pytest.mark.parametrize('model_type', ['mistral', 'llama4_text', 'gemma2'])
def test_flex_when_asked(model_type, monkeypatch):
    "flex_mode('eager') sends a padded window, Llama 4's chunks (a predicate kept as it is) and the cap to Flex."
    flex = count_calls(monkeypatch, 'flex_attend')
    with flex_mode('eager'):
        theirs, ours, _ = eager_and_ours(model_type, 24, 7)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
    assert len(flex) == tiny(model_type).config.num_hidden_layers


def test_short_padded_batch_takes_the_dense_mask_without_nan(monkeypatch):
    "Below RUNS_MIN_TOKENS: SDPA with the dense mask, and a padded query (no key to see) gets zeros, not NaN."
    model, (ids, attention_mask) = tiny('llama', 'selfattn_nbdev'), padded_batch()
    calls = count_calls(monkeypatch, '_sdpa')
    model.train()
    logits = model(ids, attention_mask=attention_mask).logits
    logits.sum().backward()
    assert calls and torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_the_weights_when_asked():
    "output_attentions=True: the explicit path's weights, equal to eager's on the real queries."
    model, (ids, attention_mask) = tiny('gemma3_text'), padded_batch()
    weights = {}
    with torch.no_grad():
        for name in ('eager', 'selfattn_nbdev'):
            model.set_attn_implementation(name)
            weights[name] = model(ids, attention_mask=attention_mask, output_attentions=True).attentions
    real = attention_mask.bool()
    for ours, theirs in zip(weights['selfattn_nbdev'], weights['eager']):
        torch.testing.assert_close(ours.transpose(1, 2)[real], theirs.transpose(1, 2)[real], rtol=0, atol=1e-6)


def test_dropout_in_training_only():
    "transformers passes the attention dropout in training: the weights are dropped then, never in eval."
    model = tiny('llama', 'selfattn_nbdev')
    model.config.attention_dropout = 0.5
    for layer in model.model.layers: layer.self_attn.attention_dropout = 0.5
    ids, attention_mask = padded_batch()
    with torch.no_grad():
        first, second = (model(ids, attention_mask=attention_mask).logits for _ in range(2))
        model.train()
        third, fourth = (model(ids, attention_mask=attention_mask).logits for _ in range(2))
    assert torch.equal(first, second) and not torch.equal(third, fourth)


def test_the_mask_transformers_asks_for():
    """sdpa's own tensor (None where SDPA's flag does), and beside it causal and windows recognised (a cache's offsets
    too); anything else (chunks, image tokens) kept and asked."""
    assert hf_mask(2, 5, 5, attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None
    plain = hf_mask(2, 5, 5, attention_mask=torch.ones(2, 5, dtype=torch.bool), allow_is_causal_skip=False)
    assert (plain.hf.known, plain.hf.window, plain.hf.padding) == (True, None, None)
    step = hf_mask(2, 1, 8, q_offset=30, kv_offset=23, local_size=8, allow_is_causal_skip=False,
                   mask_function=sliding_window_causal_mask_function(8))
    assert step.hf.known and step.hf.window is None        # every key of the window's cache in reach
    real = torch.ones(2, 12, dtype=torch.bool)
    real[0, :4] = False
    window = hf_mask(2, 12, 12, mask_function=sliding_window_causal_mask_function(5), attention_mask=real,
                     local_size=5)
    assert (window.hf.known, window.hf.window) == (True, 5)
    assert window.hf.padding[0].tolist() == [True] * 4 + [False] * 8
    chunked = chunked_causal_mask_function(4, torch.tensor([4, 0]))
    chunks = hf_mask(2, 12, 12, mask_function=chunked, attention_mask=real, local_size=4)
    theirs = sdpa_mask(2, 12, 12, mask_function=chunked, attention_mask=real, allow_is_causal_skip=False)
    asked = dense_mask(and_masks(chunks.hf.mask_mod, key_padding(chunks.hf.padding)), 12, batch=2)
    assert not chunks.hf.known and torch.equal(asked, theirs) and torch.equal(chunks, theirs)
    assert isinstance(chunks.hf, HFMask) and chunks.hf.batch == 2
    blocks = torch.tensor([[-1, 0, 0, 0] + [-1] * 8, [-1] * 6 + [1] * 3 + [-1] * 3])  # image tokens: both ways
    images = or_masks(causal_mask_function, blockwise_overlay(blocks))
    seen = hf_mask(2, 12, 12, mask_function=images, attention_mask=real, use_vmap=True)
    theirs = sdpa_mask(2, 12, 12, mask_function=images, attention_mask=real, allow_is_causal_skip=False, use_vmap=True)
    asked = dense_mask(and_masks(seen.hf.mask_mod, key_padding(seen.hf.padding)), 12, batch=2)
    assert not seen.hf.known and torch.equal(asked, theirs) and torch.equal(seen, theirs)


def test_attend_scales_the_queries():
    "transformers' scale replaces 1/sqrt(head_dim): attend with scale s equals SDPA with scale=s."
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 6, 8, dtype=torch.float64)
    for scale in (None, 0.1, 1.0):
        ours, _ = attend(q, k, v, hf_mask(1, 6, 6), scale)
        torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))


@pytest.mark.parametrize('model_type', REFUSED)
def test_refused_by_name(model_type):
    "An encoder-decoder's or an encoder's attention is refused at the first call, naming is_causal."
    message = refusal(model_type)
    assert 'is_causal=False' in message and 'expected is_causal=True' in message, message


def test_what_is_refused_names_the_argument():
    mask = hf_mask(1, 4, 4, allow_is_causal_skip=False)
    q = torch.randn(1, 2, 4, 8)
    decoder = type('LlamaAttention', (), {'is_causal': True})()
    with pytest.raises(ValueError, match="LlamaAttention passes position_bias"):
        hf_attention(decoder, q, q, q, mask, position_bias=torch.zeros(1))
    with pytest.raises(ValueError, match=r"attention_mask must be None or a 4-D tensor .* got a torch.bool tensor "
                                         r"\(1, 4\)"):
        hf_attention(decoder, q, q, q, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"LlamaAttention got list\. A BlockMask is flex_attention's"):
        hf_attention(decoder, q, q, q, [mask])
    with pytest.raises(ValueError, match=r"has shape \(1, 1, 4, 4\); LlamaAttention gives 4 queries and 5 keys"):
        hf_attention(decoder, q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), mask)
    one = q[:, :, -1:]  # a decode step given a mask sized for other keys (MiniMax's, by its linear layers' cache)
    with pytest.raises(ValueError, match=r"\(2, 1, 1, 1\); LlamaAttention gives 1 queries and 4 keys.*other kind's "
                                         r"cache.*padding included.*without padding"):
        hf_attention(decoder, one.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1),
                     torch.zeros(2, 1, 1, 1))
    with pytest.raises(ValueError, match='is_causal=False'):
        hf_attention(decoder, q, q, q, mask, is_causal=False)
    for given in (mask, None):                                  # None: causal, SDPA's flag
        out, weights = hf_attention(decoder, q, q, q, given, position_ids=torch.arange(4), use_cache=True)
        assert out.shape == (1, 4, 2, 8) and weights is None


def test_register_takes_a_name():
    assert register('selfattn_nbdev_again') == 'selfattn_nbdev_again'
    model, (ids, attention_mask) = tiny('mistral', 'selfattn_nbdev_again'), padded_batch()
    with torch.no_grad(): assert torch.isfinite(model(ids, attention_mask=attention_mask).logits).all()


@pytest.mark.heavy
def test_importing_the_module_leaves_transformers_alone():
    "The package depends on torch alone: transformers is imported by register(), not by importing selfattn_nbdev.hf."
    code = 'import sys, selfattn_nbdev.hf; print("transformers" in sys.modules)'
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == 'False'


@pytest.mark.parametrize('model_type', ['llama', 'mistral', 'gemma2'])
def test_packed_sequences_as_transformers_packs_them(model_type):
    """Padding-free batches (transformers' DataCollatorWithFlattening): documents side by side in one row, each told
    apart by position_ids that start again at 0, no attention_mask, no cache (transformers looks for documents only
    then). Each document attends only within itself."""
    model = tiny(model_type)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(12), torch.arange(18)])[None]       # two documents
    out = {}
    with torch.no_grad():
        for name in ('eager', 'selfattn_nbdev'):
            model.set_attn_implementation(name)
            out[name] = model(ids, position_ids=positions, use_cache=False).logits
        alone = model(ids[:, 12:], position_ids=positions[:, 12:], use_cache=False).logits  # by itself
    scale = out['eager'].abs().max().item()
    torch.testing.assert_close(out['selfattn_nbdev'], out['eager'], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(out['selfattn_nbdev'][:, 12:], alone, rtol=0, atol=1e-5 * scale)


def test_a_gpu_hands_a_padded_causal_batch_to_sdpa_with_the_tensor(monkeypatch):
    "The GPU's choice, run here: no runs, SDPA with the tensor transformers made, equal to eager."
    monkeypatch.setattr(hf, '_gpu_takes_the_tensor', lambda q, found, scored:
                        found.known and found.window is None and not scored)
    sdpa, varlen = count_calls(monkeypatch, '_sdpa'), count_calls(monkeypatch, 'varlen_attend')
    theirs, ours, everything = eager_and_ours('llama', 1100, 300)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
    assert len(sdpa) == 2 and not varlen and torch.isfinite(everything).all()


@pytest.mark.parametrize('pads', [0, 7])
def test_a_windowed_mask_is_opened_once_a_forward_or_not_at_all(monkeypatch, pads):
    """The dense path of a window (Mistral, 24 tokens, window 8): without padding every query sees its own key, so
    no row is searched; with padding the first layer searches the rows once, the others read what it found."""
    model = tiny('mistral', 'selfattn_nbdev')
    ids, attention_mask = padded_batch(24, pads)
    searched, real_any = [], torch.Tensor.any
    with torch.no_grad():
        model.set_attn_implementation('eager'); eager = model(ids, attention_mask=attention_mask).logits
        model.set_attn_implementation('selfattn_nbdev')
        monkeypatch.setattr(torch.Tensor, 'any', lambda *a, **k: searched.append(a[0].shape) or real_any(*a, **k))
        ours = model(ids, attention_mask=attention_mask).logits
    assert model.config.num_hidden_layers == 2 and len(searched) == (1 if pads else 0), searched
    real = attention_mask.bool()
    torch.testing.assert_close(ours[real], eager[real], rtol=0, atol=1e-5 * eager.abs().max().item())
