"""Window and padding masks on CPU: block-sparse tiled attention, the dense-mask fallback and FlexAttention.

    python bench/masks.py            # the full run (~10 min), writes bench/masks.json
    python bench/masks.py --quick    # small sizes: a smoke test (writes nothing)

Batch 1, 2 heads of head_dim 64, float32, one forward pass under torch.no_grad(), one torch thread. Each case runs
in a fresh process; peak memory is the peak resident set size (ru_maxrss) during the call minus the resident size
just before it. Block masks are built before the timed call (as FlexAttention's are) and timed separately. `steady_peak_bytes`:
the peak of the later, timed calls alone (the peak is reset after the first call, which may compile).
- `tiled`: tiled_attention with the block mask of sliding_window(256), T = 1,024 ... 16,384, tiles of 64;
- `dense`: F.scaled_dot_product_attention with the dense (T, T) window mask, T = 4,096 and 16,384;
- `flex`: torch.compile(flex_attention) with create_block_mask, T = 4,096 and 16,384 (the first call compiles);
- `padded`: MultiHeadAttention(512, 512, num_heads=8) on a batch of 4 x 2,048 tokens, 22 % padded vs none;
- `module_window` / `module_dense`: the module as a user calls it, MultiHeadAttention(128, 128, num_heads=2,
  window=512) at T = 16,384 (the fused path picks its kernel), against SDPA with the dense window-512 mask on
  the same shapes: the window path's peak memory must be at most 10 % of the dense path's.
"""
import argparse, datetime, json, os, platform, resource, shlex, statistics, subprocess, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.benchmark import cpu_model, slope  # noqa: E402

HEADS, HEAD_DIM, WINDOW, BLOCK = 2, 64, 256, 64
MODULE_WINDOW = 512  # the module's window case (issue 19's memory target)
# glibc maps every block of 64 KiB or more on its own and unmaps it when freed, so that the resident size follows
# what is allocated (by default it keeps freed memory for reuse, and a later call's peak would not show)
MALLOC_ENV = {**os.environ, 'MALLOC_MMAP_THRESHOLD_': '65536'}


def rss_bytes():
    return int(open('/proc/self/statm').read().split()[1]) * 4096


def vm_hwm_bytes():
    "The process's peak resident size since the last reset (VmHWM in /proc/self/status)."
    line = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))
    return int(line.split()[1]) * 1024


def run_case(kind, T, reps):
    "One case in this process: seconds (median), peak extra bytes, and set-up seconds."
    from selfattn_nbdev.masks import block_mask, dense_mask, key_padding, sliding_window
from selfattn_nbdev.kernels import flex_attend
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
    elif kind == 'module_dense':
        allowed = dense_mask(sliding_window(MODULE_WINDOW), T)
        call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    elif kind == 'module_window':
        m = MultiHeadAttention(HEADS * HEAD_DIM, HEADS * HEAD_DIM, T, num_heads=HEADS,
                               window=MODULE_WINDOW).eval()
        x = torch.randn(1, T, HEADS * HEAD_DIM)
        call = lambda: m(x)
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
        open('/proc/self/clear_refs', 'w').write('5')  # reset the peak (VmHWM): compiling is over
        before = rss_bytes()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter(); call(); times.append(time.perf_counter() - t0)
        steady = vm_hwm_bytes() - before
    return {'kind': kind, 'T': T, 'seconds': statistics.median(times), 'peak_bytes': max(peak, 0),
            'steady_peak_bytes': max(steady, 0), **setup}


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
    cases += [(kind, 1024 if args.quick else 16384) for kind in ('module_window', 'module_dense')]
    rows = []
    for kind, T in cases:
        out = subprocess.run([sys.executable, __file__, '--case', kind, str(T), '1' if args.quick else '3'],
                             capture_output=True, text=True, check=True, env=MALLOC_ENV)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1])); print(rows[-1], flush=True)
    tiled = [r for r in rows if r['kind'] == 'tiled']
    result = {'machine': cpu_model(), 'torch': torch.__version__, 'python': platform.python_version(),
              'threads': 1, 'heads': HEADS, 'head_dim': HEAD_DIM, 'window': WINDOW, 'block': BLOCK, 'rows': rows,
              'tiled_time_exponent': slope([r['T'] for r in tiled], [r['seconds'] for r in tiled]),
              'tiled_memory_exponent': slope([r['T'] for r in tiled], [r['peak_bytes'] for r in tiled])}
    peak = {r['kind']: r['steady_peak_bytes'] for r in rows}
    result['module_window_memory_share'] = peak['module_window'] / max(peak['module_dense'], 1)
    result.update({'date': datetime.date.today().isoformat(),
                   'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])})
    print(json.dumps({k: v for k, v in result.items() if k != 'rows'}))
    if not args.quick: (ROOT / 'bench' / 'masks.json').write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
