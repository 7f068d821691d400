"""The masks of bench/masks.py on a CUDA GPU: this package's fused path against PyTorch's best kernel for each mask.

    python bench/gpu.py            # on a CUDA GPU: batch 8, d_model 1,024, 16 heads, bfloat16; writes bench/gpu.json
    python bench/gpu.py --small    # anywhere (CPU too): tiny sizes, float32, a smoke test (writes to --out)

Cases (causal): no padding at T = 8,192 (ours vs projections + SDPA is_causal); 22 % key padding at T = 8,192 and
2,048 (ours vs varlen flash attention on the packed tokens); window 512 at T = 8,192 and 16,384, and window 512 with
4 key/value heads at 16,384 (ours vs compiled FlexAttention). Times are medians of CUDA-event timed calls after a
warm-up (which includes compiling); peak memory from torch.cuda.max_memory_allocated.
"""
import argparse, json, statistics, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.masks import flex_attend, flex_mode, sliding_window, varlen_attend  # noqa: E402
from selfattn_nbdev.multihead import MultiHeadAttention  # noqa: E402


def timed(fn, reps, cuda):
    "Median seconds of fn() after one warm-up call, and the peak bytes it allocated."
    fn()
    if cuda: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn()
        if cuda: torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return statistics.median(times), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--small', action='store_true'); ap.add_argument('--out', default=str(ROOT / 'bench' / 'gpu.json'))
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = 'cuda' if cuda else 'cpu'
    dtype = torch.bfloat16 if cuda else torch.float32
    batch, d_model, heads = (8, 1024, 16) if cuda else (2, 64, 4)
    scale = 1 if cuda else 64           # T = 8,192 becomes 128 on the small run
    reps = 20 if cuda else 2
    rows = []
    cases = [('causal', 8192, None, 0.0, None), ('padding 22%', 8192, None, 0.22, None),
             ('padding 22%', 2048, None, 0.22, None), ('window 512', 8192, 512, 0.0, None),
             ('window 512', 16384, 512, 0.0, None), ('window 512, 4 kv heads', 16384, 512, 0.0, 4)]
    for name, T, window, padded, kv_heads in cases:
        T, window = T // scale, window and max(window // scale, 2)
        torch.manual_seed(0)
        m = MultiHeadAttention(d_model, d_model, T, num_heads=heads, window=window,
                               num_kv_heads=kv_heads).to(device, dtype).eval()
        x = torch.randn(batch, T, d_model, device=device, dtype=dtype)
        pad = (torch.arange(T, device=device) >= int(T * (1 - padded))).expand(batch, T) if padded else None
        with torch.no_grad(), flex_mode('compiled' if cuda else 'eager'):
            ours, ours_peak = timed(lambda: m(x, key_padding_mask=pad), reps, cuda)
            q = m._split_heads(m.W_query(x)); k = m._split_heads(m.W_key(x)); v = m._split_heads(m.W_value(x))
            if padded and cuda:
                best = lambda: m.out_proj(m._merge_heads(varlen_attend(q, k, v, pad, True)))
                best_name = 'varlen flash attention'
            elif window:
                best = lambda: m.out_proj(m._merge_heads(flex_attend(q, k, v, sliding_window(window), ('w', window),
                                                                     compiled=cuda)))
                best_name = 'FlexAttention' + (' compiled' if cuda else ' (uncompiled, small run)')
            else:
                best = lambda: m.out_proj(m._merge_heads(F.scaled_dot_product_attention(
                    m._split_heads(m.W_query(x)), m._split_heads(m.W_key(x)), m._split_heads(m.W_value(x)),
                    is_causal=True, attn_mask=None if pad is None else ~pad[:, None, None, :])))
                best_name = 'projections + SDPA'
            theirs, theirs_peak = timed(best, reps, cuda)
        rows.append({'case': name, 'T': T, 'ours_s': ours, 'ours_peak_bytes': ours_peak, 'best': best_name,
                     'best_s': theirs, 'best_peak_bytes': theirs_peak, 'ratio': ours / theirs})
        print(rows[-1], flush=True)
    device_name = torch.cuda.get_device_name() if cuda else f'CPU (small sizes, {torch.get_num_threads()} threads)'
    result = {'device': device_name, 'torch': torch.__version__, 'dtype': str(dtype), 'batch': batch,
              'd_model': d_model, 'heads': heads, 'rows': rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
