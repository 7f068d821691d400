"""Inspecting a loaded model: `attention_weights(model)` gives every layer's (b, heads, T, T) weights, equal to
transformers' eager `output_attentions=True` on tiny random models built offline (never from a hub) and loaded
through `from_hf`: RoPE, grouped key/value heads, QK-norm, sliding-window layers, Gemma 2's soft cap. The
explorer draws such a layer from the module's own weights (`AttentionExplorer.from_module`)."""
import html, json, re

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from selfattn_nbdev.explorer import AttentionExplorer, package_attention
from selfattn_nbdev.models import attention_weights
from selfattn_nbdev.pretrained import from_hf

transformers.utils.logging.set_verbosity_error()
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=300, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
CASES = {
    'llama': dict(),
    'qwen3': dict(use_sliding_window=True, sliding_window=4, layer_types=['full_attention', 'sliding_attention']),
    'mistral': dict(sliding_window=5),
    'gemma2': dict(sliding_window=4, query_pre_attn_scalar=32, attn_logit_softcapping=2.0),
}


@pytest.fixture(scope='module', params=list(CASES))
def pair(request, tmp_path_factory):
    "transformers' model in eager attention, float32, and ours loaded from its saved folder."
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(request.param, **SMALL, **CASES[request.param])
    theirs = AutoModelForCausalLM.from_config(cfg, attn_implementation='eager').eval()
    with torch.no_grad():  # larger scores than the default init: the weights are not all near uniform
        for name, p in theirs.named_parameters():
            if 'proj' in name: p.mul_(4)
    folder = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(folder)
    return request.param, theirs, from_hf(folder)


def test_every_layer_equals_transformers_eager(pair):
    name, theirs, ours = pair
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = ours(ids)
        with attention_weights(ours) as weights:
            logits = ours(ids)
        ref = theirs(ids, output_attentions=True)
    assert len(weights) == len(ref.attentions) == 2
    errors = [(a - b).abs().max().item() for a, b in zip(weights, ref.attentions)]
    assert max(errors) <= 1e-5, (name, errors)
    assert torch.equal(logits, plain) or (logits - plain).abs().max() < 1e-5   # the output is the model's
    windows = [b.attn.window for b in ours.blocks]
    for w, window in zip(weights, windows):           # the mask is in the weights: a window, the future
        assert w.shape == (2, 4, 12, 12) and w.triu(1).abs().max() == 0
        if window is not None: assert w.tril(-window).abs().max() == 0 and window < 12
    assert any(windows) == (name != 'llama')
    print(f'{name}: largest difference from transformers eager {max(errors):.1e}')


def test_hooks_are_gone_after_the_block(pair):
    "The block removes every hook it added, and only those: a hook of the caller's stays."
    _, _, ours = pair
    def hooks(): return [(dict(m._forward_hooks), dict(m._forward_pre_hooks))
                         for m in ours.modules()]
    with torch.no_grad(): ours(torch.zeros(1, 3, dtype=torch.long))
    assert all(h == ({}, {}) for h in hooks())  # a model that ran holds no hook of its own
    mine = ours.register_forward_hook(lambda m, args, out: None)
    before = hooks()
    with attention_weights(ours):
        assert hooks() != before              # the block's hooks, on every attention
    assert hooks() == before
    mine.remove()
    with pytest.raises(ValueError, match='holds no MultiHeadAttention'):
        with attention_weights(torch.nn.Linear(2, 2)): pass


def test_explorer_draws_a_loaded_layer(pair):
    "The explorer of a real layer (RoPE, GQA, window) shows the module's own return_attn_weights=True weights."
    name, _, ours = pair
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    tokens = [f'w{i}' for i in range(9)]
    read = []                                          # what each layer's attention reads
    hooks = [b.attn.register_forward_pre_hook(lambda m, args: read.append(args[0][0])) for b in ours.blocks]
    with torch.no_grad(), attention_weights(ours) as weights:
        ours(ids)
    for h in hooks: h.remove()
    for layer, (block, x) in enumerate(zip(ours.blocks, read)):
        ex = AttentionExplorer.from_module(block.attn, tokens, x)
        with torch.no_grad():
            _, expected = block.attn(x, return_attn_weights=True)   # (heads, T, T)
        shown, _ = package_attention(json.loads(json.dumps(ex.inputs())))
        assert (shown - expected.double()).abs().max() <= 1e-6
        assert (shown - weights[layer][0].double()).abs().max() <= 1e-5
        page = ex._repr_html_()
        inputs = json.loads(html.unescape(re.search(r'data-inputs="([^"]*)"', page).group(1)))
        assert inputs['num_heads'] == 4 and 'W_query' not in inputs and inputs['fixed']

