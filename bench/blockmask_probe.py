"""What building a block mask costs on CUDA, per call: uncompiled, and through torch.compile(create_block_mask).

Masks that depend on the batch (key padding, document ids) cannot be built once and cached: the fused path builds
one per call. Batch 8, document ids and key padding at T = 2,048 and 8,192; then MultiHeadAttention with document
ids at T = 8,192 (d_model 1,024, 16 heads, bfloat16). --small: tiny sizes on the CPU, to check the script."""
import argparse, statistics, sys, time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev.masks import and_masks, causal, documents, flex_mode, key_padding  # noqa: E402
from selfattn_nbdev.multihead import MultiHeadAttention  # noqa: E402


def seconds(fn, sync, reps=5):
    "Median seconds of fn() over reps calls, and the first call's."
    times = []
    for _ in range(reps + 1):
        sync(); start = time.perf_counter(); fn(); sync(); times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--small', action='store_true'); args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = 'cuda' if cuda else 'cpu'
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    B, sizes = (8, (2048, 8192)) if cuda else (2, (256, 512))
    compiled = torch.compile(create_block_mask)
    for T in sizes:
        g = torch.Generator().manual_seed(T)
        ids = lambda: torch.randint(0, 4, (B, T), generator=g).sort(-1).values.to(device)   # 4 documents a row
        pad = lambda: (torch.arange(T) >= torch.randint(T // 2, T, (B, 1), generator=g)).to(device)
        for name, make in (('documents', lambda: and_masks(causal, documents(ids()))),
                           ('padding', lambda: and_masks(causal, key_padding(pad())))):
            eager = seconds(lambda: create_block_mask(make(), B, None, T, T, device=device), sync)
            first, later = seconds(lambda: compiled(make(), B, None, T, T, device=device), sync)
            print(f'T={T} {name}: uncompiled {eager[1] * 1e3:.2f} ms; compiled first call {first:.2f} s, '
                  f'later calls {later * 1e3:.2f} ms (new masks of the same shape)', flush=True)
    T, d = (8192, 1024) if cuda else (512, 64)
    dtype = torch.bfloat16 if cuda else torch.float32
    m = MultiHeadAttention(d, d, T, num_heads=16 if cuda else 4).to(device, dtype).eval()
    x = torch.randn(B, T, d, device=device, dtype=dtype)
    ids = torch.randint(0, 4, (B, T), generator=torch.Generator().manual_seed(0)).sort(-1).values.to(device)
    with torch.no_grad():
        for mode in ('compiled', 'off'):
            with flex_mode(mode):
                first, later = seconds(lambda: m(x, document_ids=ids), sync)
            print(f'MultiHeadAttention, documents, T={T}, flex_mode({mode!r}): {later * 1e3:.2f} ms a call',
                  flush=True)


if __name__ == '__main__':
    main()
