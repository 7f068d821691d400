"""Window and padding masks on CPU: block-sparse tiled attention, the dense-mask fallback and FlexAttention.

    python bench/masks.py            # the full run (~10 min), writes bench/masks.json
    python bench/masks.py --quick    # small sizes: a smoke test (writes nothing)

Batch 1, 2 heads of head_dim 64, float32, one forward pass under torch.no_grad(), one torch thread. Each case runs
in a fresh process; peak memory is the peak resident set size (ru_maxrss) during the call minus the resident size
just before it. Block masks are built before the timed call (as FlexAttention's are) and timed separately.
- `tiled`: tiled_attention with the block mask of sliding_window(256), T = 1,024 ... 16,384, tiles of 64;
- `dense`: F.scaled_dot_product_attention with the dense (T, T) window mask, T = 4,096 and 16,384;
- `flex`: torch.compile(flex_attention) with create_block_mask, T = 4,096 and 16,384 (the first call compiles);
- `padded`: MultiHeadAttention(512, 512, num_heads=8) on a batch of 4 x 2,048 tokens, 22 % padded vs none.
"""
import argparse, json, platform, resource, statistics, subprocess, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.benchmark import cpu_model, slope  # noqa: E402

HEADS, HEAD_DIM, WINDOW, BLOCK = 2, 64, 256, 64


def rss_bytes():
    return int(open('/proc/self/statm').read().split()[1]) * 4096


def run_case(kind, T, reps):
    "One case in this process: seconds (median), peak extra bytes, and set-up seconds."
    from selfattn_nbdev.masks import block_mask, dense_mask, flex_attend, key_padding, sliding_window
    from selfattn_nbdev.multihead import MultiHeadAttention
    from selfattn_nbdev.tiled import tiled_attention
    torch.set_num_threads(1); torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, HEADS, T, HEAD_DIM).unbind(0)
    setup = {}
    t0 = time.perf_counter()
    if kind == 'tiled':
        tiles = block_mask(sliding_window(WINDOW), T, block_size=BLOCK)
        call = lambda: tiled_attention(q, k, v, block_mask=tiles)
    elif kind == 'dense':
        allowed = dense_mask(sliding_window(WINDOW), T)
        call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    elif kind == 'flex':
        call = lambda: flex_attend(q, k, v, sliding_window(WINDOW), cache_key=('window', WINDOW))
    else:
        m = MultiHeadAttention(512, 512, T, num_heads=8).eval()
        x = torch.randn(4, T, 512)
        pad = (torch.arange(T) >= int(T * 0.78)).expand(4, T) if kind == 'padded' else None
        call = lambda: m(x, key_padding_mask=pad)
    setup['build_s'] = time.perf_counter() - t0
    with torch.no_grad():
        before = rss_bytes()
        t0 = time.perf_counter(); call(); setup['first_call_s'] = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        times = []
        for _ in range(reps):
            t0 = time.perf_counter(); call(); times.append(time.perf_counter() - t0)
    return {'kind': kind, 'T': T, 'seconds': statistics.median(times), 'peak_bytes': max(peak, 0), **setup}


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--quick', action='store_true')
    ap.add_argument('--case', nargs=3); args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), int(args.case[2])))); return
    lengths = [512, 1024] if args.quick else [1024, 2048, 4096, 8192, 16384]
    cases = [('tiled', T) for T in lengths]
    cases += [('dense', T) for T in ([1024] if args.quick else [4096, 16384])]
    cases += [('flex', T) for T in ([] if args.quick else [4096, 16384])]
    cases += [(kind, 512 if args.quick else 2048) for kind in ('unpadded', 'padded')]
    rows = []
    for kind, T in cases:
        out = subprocess.run([sys.executable, __file__, '--case', kind, str(T), '1' if args.quick else '3'],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1])); print(rows[-1], flush=True)
    tiled = [r for r in rows if r['kind'] == 'tiled']
    result = {'machine': cpu_model(), 'torch': torch.__version__, 'python': platform.python_version(),
              'threads': 1, 'heads': HEADS, 'head_dim': HEAD_DIM, 'window': WINDOW, 'block': BLOCK, 'rows': rows,
              'tiled_time_exponent': slope([r['T'] for r in tiled], [r['seconds'] for r in tiled]),
              'tiled_memory_exponent': slope([r['T'] for r in tiled], [r['peak_bytes'] for r in tiled])}
    print(json.dumps({k: v for k, v in result.items() if k != 'rows'}))
    if not args.quick: (ROOT / 'bench' / 'masks.json').write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
