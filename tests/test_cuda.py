"""On a CUDA GPU (skipped elsewhere): every kernel the fused path picks there, against the explicit path in float64.

CI has no GPU, so these run where one is lent (with bench/gpu.py):

    python -m pytest --noconftest -o addopts='' tests/test_cuda.py

`SELFATTN_TEST_DEVICE=cpu` runs the same cases on the CPU (varlen, which is CUDA-only, skipped), which checks the
tests themselves. The CPU tests of the CUDA logic (the kernel choice, varlen's packing, the CUDA-graph decode step)
live beside the other tests; these run the real kernels."""
import contextlib, copy, os

import pytest
import torch

from selfattn_nbdev import MultiHeadAttention
from selfattn_nbdev.generation import TinyGPT
from selfattn_nbdev.decoding import generate
from selfattn_nbdev.masks import block_mask, dense_mask, sliding_window
from selfattn_nbdev.kernels import flex_mode, pick_kernel
from selfattn_nbdev.tiled import tiled_attention

DEVICE = os.environ.get('SELFATTN_TEST_DEVICE', 'cuda')
pytestmark = pytest.mark.skipif(DEVICE == 'cuda' and not torch.cuda.is_available(), reason='needs a CUDA GPU')

B, T, D, HEADS = 2, 256, 128, 4
CONFIGS = {  # name: (module options, padding?, documents?)
    'window': (dict(window=64), False, False),
    'padding': (dict(), True, False),
    'padding, 2 kv heads': (dict(num_kv_heads=2), True, False),
    'padding, not causal': (dict(causal=False), True, False),
    'documents, rope': (dict(rope=True), False, True),
    'window, padding, documents, 2 kv heads': (dict(window=64, num_kv_heads=2), True, True),
}
# the largest difference allowed, relative to the largest value compared
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _inputs(padded, with_documents):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=g)
    pad = (torch.arange(T) >= torch.tensor([[T], [T - 70]])) if padded else None       # row 1: 70 padded
    ids = torch.tensor([[0] * 100 + [1] * 100 + [2] * 56, [0] * 30 + [1] * 226]) if with_documents else None
    return x, pad, ids


def _run(module, x, pad, ids, explicit):
    "Outputs at the real positions and the gradients of a loss that reads only them."
    x = x.clone().requires_grad_()
    if pad is not None:          # NaN in the padding: it must reach no real output or gradient
        x_in = torch.where(pad[..., None], torch.full_like(x, float('nan')), x)
    else: x_in = x
    out = module(x_in, key_padding_mask=pad, document_ids=ids, return_attn_weights=explicit)
    out = out[0] if explicit else out
    real = torch.ones(B, T, 1, dtype=torch.bool, device=x.device) if pad is None else ~pad[..., None]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    (out * weight * real).sum().backward()
    return out.masked_fill(~real, 0.0), x.grad, module.W_query.weight.grad


def _close(ours, theirs, dtype, what):
    ours, theirs = ours.double(), theirs.double()
    assert torch.isfinite(ours).all(), f'{what}: not finite'
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert error < TOLERANCE[dtype], f'{what}: relative difference {error:.2e}'


@pytest.mark.parametrize('mode', ['compiled', 'off'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('name', list(CONFIGS))
def test_fused_kernels_equal_the_explicit_path(name, dtype, mode):
    "The kernel picked on this device (varlen, FlexAttention or the dense mask), forward and backward."
    options, padded, with_documents = CONFIGS[name]
    torch.manual_seed(0)
    ours = MultiHeadAttention(D, D, T, num_heads=HEADS, **options).to(DEVICE, dtype)
    reference = copy.deepcopy(ours).double()             # the same (rounded) weights, in float64
    x, pad, ids = (None if t is None else t.to(DEVICE) for t in _inputs(padded, with_documents))
    runs_only = 'window' not in options   # padding, documents or both: varlen in half precision
    half = dtype == torch.bfloat16
    with flex_mode(mode):
        kernel = pick_kernel(DEVICE, True, T, T, True, 0.0, runs_only=runs_only, half=half)
        if DEVICE == 'cpu' and kernel == 'varlen': pytest.skip('varlen flash attention runs on CUDA only')
        got = _run(ours, x.to(dtype), pad, ids, explicit=False)
    expected = _run(reference, x.to(dtype).double(), pad, ids, explicit=True)
    for what, a, b in zip(('outputs', 'x.grad', 'W_query.grad'), got, expected):
        _close(a, b, dtype, f'{name}, {kernel}, {what}')


def test_the_kernels_picked_on_cuda():
    "What the tests above exercise on CUDA: varlen for padding alone in bfloat16, FlexAttention for the rest."
    if DEVICE != 'cuda': pytest.skip('the CUDA choice')
    with flex_mode('compiled'):
        assert pick_kernel('cuda', True, T, T, True, 0.0, runs_only=True, half=True) == 'varlen'
        assert pick_kernel('cuda', True, T, T, True, 0.0, runs_only=True, half=False) == 'flex'
        assert pick_kernel('cuda', True, T, T, True, 0.0) == 'flex'     # training: FlexAttention's backward


@pytest.mark.parametrize('causal', [False, True])
def test_tiled_attention_with_a_block_mask(causal):
    "The tiled kernel on the device: the window's empty tiles skipped, the rest equal to the dense reference."
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, HEADS, T, 32, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
               for _ in range(3))
    window = sliding_window(48)
    tiles = block_mask(window, T, block_size=64, device=DEVICE)
    ours = tiled_attention(q, k, v, block_mask=tiles)
    scores = (q @ k.transpose(-2, -1) / 32 ** 0.5).masked_fill(~dense_mask(window, T, device=DEVICE), -torch.inf)
    theirs = torch.softmax(scores, -1) @ v
    assert (ours - theirs).abs().max() < 1e-12
    grads = [torch.autograd.grad(out.sum(), (q, k, v)) for out in (ours, theirs)]
    for a, b in zip(*grads): assert (a - b).abs().max() < 1e-12


def test_compiled_decode_with_cuda_graphs_writes_the_eager_tokens():
    "generate(compile=True): on CUDA the decode step is a CUDA graph; prompts of different lengths, left padded."
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, context_length=64, d_model=32, num_heads=4, num_layers=2).to(DEVICE).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (n,), generator=g).to(DEVICE) for n in (5, 9)]
    eager = generate(model, prompts, 12)
    compiled = generate(model, prompts, 12, compile=True if DEVICE == 'cuda' else dict(backend='eager'))
    for a, b in zip(eager, compiled): assert torch.equal(a, b)
    again = generate(model, prompts, 12, compile=True if DEVICE == 'cuda' else dict(backend='eager'))
    for a, b in zip(eager, again): assert torch.equal(a, b)   # a second call replays, still right


@pytest.mark.parametrize('family', ['GPT2', 'Llama'])
def test_stacked_products_in_a_cuda_graph_write_the_separate_products_tokens(family):
    "q, k, v (and gate, up) stacked and read through one view inside the CUDA graph: the tokens of three products."
    from selfattn_nbdev.decoding import _decode_step, stacked
    from selfattn_nbdev.pretrained import GPT2, Llama
    torch.manual_seed(0)
    model = (GPT2(vocab_size=64, context_length=64, d_model=64, num_heads=4, num_layers=2) if family == 'GPT2' else
             Llama(64, 64, d_model=64, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=96))
    model = model.to(DEVICE).eval()
    prompt = torch.randint(0, 64, (1, 7), device=DEVICE)
    step = _decode_step(model, True if DEVICE == 'cuda' else dict(backend='inductor', fullgraph=True))
    def greedy(stack):
        caches = model.new_caches(7 + 12)
        with torch.no_grad(), (stacked(model) if stack else contextlib.nullcontext()):
            ids = [model(prompt, caches)[:, -1].argmax(-1, keepdim=True)]
            for _ in range(11): ids.append(step(ids[-1], caches)[:, -1].argmax(-1, keepdim=True))
        return torch.cat(ids, 1)
    assert torch.equal(greedy(True), greedy(False))
    assert torch.equal(generate(model, prompt, 12, compile=True if DEVICE == 'cuda' else dict(backend='eager')),
                       torch.cat([prompt, greedy(False)], 1))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_unpad_trains_like_the_padded_batch(dtype):
    "A right-padded batch and its unpadded row (varlen flash attention in bfloat16): the same loss and gradients."
    import torch.nn.functional as F
    from selfattn_nbdev.kernels import unpad
    torch.manual_seed(0)
    model = TinyGPT(64, 128, d_model=64, num_heads=4, num_layers=2).to(DEVICE)
    reference = copy.deepcopy(model).double()
    model = model.to(dtype)
    pad = (torch.arange(128) >= torch.tensor([[128], [40], [97], [1]])).to(DEVICE)
    tokens, targets = torch.randint(0, 64, (2, 4, 128)).to(DEVICE).unbind(0)
    real = ~pad
    expected = F.cross_entropy(reference(tokens)[real], targets[real])
    expected.backward()
    row = unpad(tokens, pad)
    with flex_mode('compiled'):
        loss = F.cross_entropy(model(row.token_ids, document_ids=row.document_ids)[0].float(),
                               row.pack(targets)[0])
    loss.backward()
    assert abs(loss.item() - expected.item()) < TOLERANCE[dtype] * expected.item()
    _close(model.token_emb.weight.grad, reference.token_emb.weight.grad, dtype, 'unpad, token_emb.grad')


def test_a_prompt_out_of_the_vocabulary_is_named_on_the_gpu_too():
    """generate reads the prompt's ids once on the GPU (one wait per generation), so an id out of range is named
    before nn.Embedding's device-side assert would leave the CUDA context unusable."""
    model = TinyGPT(20, 16, d_model=16, num_heads=2).to(DEVICE)
    with pytest.raises(ValueError, match=r'prompt_ids must be in \[0, 20\); got values from 0 to 25'):
        generate(model, torch.tensor([[0, 25]], device=DEVICE), 2)
