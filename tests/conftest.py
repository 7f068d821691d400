"""Shared fixtures: every exported attention module behind one interface, and a recorder of the largest
differences found against PyTorch's kernels (printed at the end of the run)."""
import sys
from collections import defaultdict

import pytest
import torch

from selfattn_nbdev import (CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttention,
                            SelfAttentionV1, SelfAttentionV2)

MAX_DIFFS = defaultdict(float)  # (what, against) -> largest absolute difference seen


@pytest.fixture(autouse=True, scope='module')
def fresh_dynamo():
    """Each test module starts with no compiled graphs. Dynamo's recompile limit counts the graphs of every model that
    shares a forward, so without this a module's tests pass or fail by what ran before them (the package's own decode
    step makes room for itself: tests/test_stacked.py checks that with the limit set to 1)."""
    if 'torch._dynamo' in sys.modules: torch._dynamo.reset()
    yield


@pytest.fixture
def record_diff(record_property):
    "Call with (what, against, a, b): records max |a - b| and returns it."
    def record(what, against, a, b):
        d = (a - b).abs().max().item() if a.numel() else 0.0
        record_property('max_diff', (what, against, d))  # a property reaches the main process from xdist's workers
        return d
    return record


def pytest_runtest_logreport(report):
    for _, (what, against, d) in (p for p in report.user_properties if p[0] == 'max_diff'):
        MAX_DIFFS[what, against] = max(MAX_DIFFS[what, against], d)


def pytest_terminal_summary(terminalreporter):
    if not MAX_DIFFS: return
    terminalreporter.section('largest absolute differences against PyTorch (float64)')
    for (what, against), d in sorted(MAX_DIFFS.items()):
        terminalreporter.write_line(f'{what:<28} vs {against:<28} {d:.2e}')


class ExplicitMHA(torch.nn.Module):
    "MultiHeadAttention forced through its explicit path (the one that returns the weights)."
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.m = MultiHeadAttention(*args, **kwargs)
    def forward(self, x, key_padding_mask=None):
        return self.m(x, key_padding_mask=key_padding_mask, return_attn_weights=True)[0]


# name -> (factory(d_in, d_out, context_length, num_heads, dropout), causal?)
FACTORIES = {
    'SelfAttention':             (lambda d_in, d_out, T, h, p: SelfAttention(d_in, d_out), False),
    'SelfAttentionV1':           (lambda d_in, d_out, T, h, p: SelfAttentionV1(d_in, d_out), False),
    'SelfAttentionV2':           (lambda d_in, d_out, T, h, p: SelfAttentionV2(d_in, d_out, qkv_bias=True), False),
    'CausalAttention':           (lambda d_in, d_out, T, h, p: CausalAttention(d_in, d_out, T, dropout=p, qkv_bias=True), True),
    'MultiHeadAttentionWrapper': (lambda d_in, d_out, T, h, p: MultiHeadAttentionWrapper(d_in, d_out, T, dropout=p, num_heads=h, qkv_bias=True), True),
    'MultiHeadAttention':        (lambda d_in, d_out, T, h, p: MultiHeadAttention(d_in, d_out, T, dropout=p, num_heads=h, qkv_bias=True), True),
    'MultiHeadAttention(explicit)': (lambda d_in, d_out, T, h, p: ExplicitMHA(d_in, d_out, T, dropout=p, num_heads=h, qkv_bias=True), True),
    'MultiHeadAttention(causal=False)': (lambda d_in, d_out, T, h, p: MultiHeadAttention(d_in, d_out, T, dropout=p, num_heads=h, qkv_bias=True, causal=False), False),
}
CAUSAL = [n for n, (_, c) in FACTORIES.items() if c]
NON_CAUSAL = [n for n, (_, c) in FACTORIES.items() if not c]
WITH_DROPOUT = ['CausalAttention', 'MultiHeadAttentionWrapper', 'MultiHeadAttention', 'MultiHeadAttention(explicit)',
                'MultiHeadAttention(causal=False)']


def make(name, d_in=3, d_out=4, context_length=8, num_heads=2, dropout=0.0, dtype=torch.float64, seed=0):
    "Build module `name` with a fixed seed, in `dtype`, in eval mode."
    torch.manual_seed(seed)
    factory, _ = FACTORIES[name]
    return factory(d_in, d_out, context_length, num_heads, dropout).to(dtype).eval()


# ---- transformers' models with the package's layers inside (tests/test_linear.py, tests/test_hybrid.py) ----

def left_padded_batch(vocab, T=80, pad=7, seed=1):
    "Two rows of token ids and their attention mask, the first left-padded: longer than a delta-rule chunk of 64."
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, T), generator=gen)
    mask = torch.ones(2, T, dtype=torch.long)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


def with_package_linear_layers(model, expected: int):
    "A copy of a Qwen3-Next / Qwen3.5 (MoE) model whose linear-attention layers are the package's, same weights."
    import copy
    from selfattn_nbdev.linear import GatedDeltaNet
    ours = copy.deepcopy(model)
    swapped = 0
    for i, block in enumerate(ours.model.layers):
        if hasattr(block, 'linear_attn'):
            layer = GatedDeltaNet.from_config(ours.config, layer_idx=i)
            layer.load_state_dict(block.linear_attn.state_dict())   # strict: every name matches
            block.linear_attn, swapped = layer, swapped + 1
    assert swapped == expected, swapped
    return ours


def check_against_transformers(theirs, ours, ids, mask, record_diff, what):
    "Logits on a left-padded batch, 16 greedy tokens against the original model, cached against uncached."
    real = mask.bool()
    gen = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    with torch.no_grad():
        a, b = theirs(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        want, got = theirs.generate(ids, **gen), ours.generate(ids, **gen)
        uncached = ours.generate(ids, use_cache=False, **gen)
    assert record_diff(what + ' logits', 'transformers', a[real], b[real]) < 1e-5
    assert torch.equal(got, want), 'greedy tokens differ from transformers'
    assert torch.equal(uncached, got), 'cached and uncached generation differ'
    assert got.shape[1] == ids.shape[1] + 16


def check_saved_and_routed(hf, ours, folder, ids):
    """A family's two ways back to transformers: `save_hf` writes a checkpoint transformers reads to the very same
    logits, and transformers' own model with the package's attention inside (attn_implementation='selfattn_nbdev')
    gives its eager logits, within 1e-5 of the largest."""
    from transformers import AutoModelForCausalLM
    from selfattn_nbdev.hf import register
    from selfattn_nbdev.pretrained import save_hf
    again = AutoModelForCausalLM.from_pretrained(save_hf(ours, folder), attn_implementation="eager").eval()
    with torch.no_grad():
        eager = hf(ids).logits
        assert torch.equal(again(ids).logits, eager)
        hf.set_attn_implementation(register())
        routed = hf(ids).logits
    assert (routed - eager).abs().max() <= 1e-5 * eager.abs().max()


def tiny_decoder(kind: str):
    "A 2-block GPT-2, or Llama with grouped key/value heads (4 query, 2 key/value), width 32, vocabulary 97: in eval."
    from selfattn_nbdev.models import GPT2, Llama
    torch.manual_seed(0)
    if kind == 'gpt2': return GPT2(vocab_size=97, context_length=128, d_model=32, num_heads=4, num_layers=2).eval()
    return Llama(97, 128, 32, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=48).eval()
