"""What building a block mask costs, per call: uncompiled, and compiled as flex_attend compiles it.

Masks that depend on the batch (key padding, document ids) cannot be built once and kept: the fused path builds
one per call, or once per forward for a model's blocks (`_share_across_blocks`). On CUDA: batch 8, document ids
and key padding at T = 2,048 and 8,192; then MultiHeadAttention with document ids at T = 8,192 (d_model 1,024,
16 heads, bfloat16), with a tensor of the caller's (built every call), with a shared copy (built once), and with
the dense mask. --small: tiny sizes on the CPU, to check the script. The figures in bench/gpu.json's probes came
from the first version of this script (commit 0a8e174): it compiled the builder with dynamic shapes."""
import argparse, sys, time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu import timed  # noqa: E402
from selfattn_nbdev.masks import and_masks, causal, documents, key_padding  # noqa: E402
from selfattn_nbdev.kernels import (flex_mode,  # noqa: E402
                                    _share_across_blocks as share_across_blocks)
from selfattn_nbdev.multihead import MultiHeadAttention  # noqa: E402


def first_call(fn, cuda) -> float:
    "Seconds of one call of fn, the device's work included (for a call that compiles)."
    if cuda: torch.cuda.synchronize()
    start = time.perf_counter(); fn()
    if cuda: torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--small', action='store_true'); args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = 'cuda' if cuda else 'cpu'
    B, sizes, reps = (8, (2048, 8192), 5) if cuda else (2, (256, 512), 2)
    compiled = torch.compile(create_block_mask, dynamic=False)       # as flex_attend compiles it
    for T in sizes:
        g = torch.Generator().manual_seed(T)
        ids = lambda: torch.randint(0, 4, (B, T), generator=g).sort(-1).values.to(device)   # 4 documents a row
        pad = lambda: (torch.arange(T) >= torch.randint(T // 2, T, (B, 1), generator=g)).to(device)
        for name, make in (('documents', lambda: and_masks(causal, documents(ids()))),
                           ('padding', lambda: and_masks(causal, key_padding(pad())))):
            eager, _ = timed(lambda: create_block_mask(make(), B, None, T, T, device=device), reps, cuda)
            first = first_call(lambda: compiled(make(), B, None, T, T, device=device), cuda)
            later, _ = timed(lambda: compiled(make(), B, None, T, T, device=device), reps, cuda)
            print(f'T={T} {name}: uncompiled {eager * 1e3:.2f} ms; compiled first call {first:.2f} s, '
                  f'later calls {later * 1e3:.2f} ms (new masks of the same shape)', flush=True)
    T, d = (8192, 1024) if cuda else (512, 64)
    dtype = torch.bfloat16 if cuda else torch.float32
    m = MultiHeadAttention(d, d, T, num_heads=16 if cuda else 4).to(device, dtype).eval()
    x = torch.randn(B, T, d, device=device, dtype=dtype)
    ids = torch.randint(0, 4, (B, T), generator=torch.Generator().manual_seed(0)).sort(-1).values.to(device)
    shared = share_across_blocks(ids)
    with torch.no_grad():
        for label, mode, doc_ids in (('a tensor of the caller, built every call', 'compiled', ids),
                                     ('a shared copy, built once', 'compiled', shared),
                                     ('the dense mask', 'off', ids)):
            with flex_mode(mode): seconds, _ = timed(lambda: m(x, document_ids=doc_ids), reps, cuda)
            print(f'MultiHeadAttention, documents, T={T}, {label}: {seconds * 1e3:.2f} ms a call', flush=True)


if __name__ == '__main__':
    main()
