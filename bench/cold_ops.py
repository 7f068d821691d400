"""Benchmark: what a small operator costs right after a decode step's weight read, against the same call repeated.

A decode step on a CPU reads each weight matrix once, then runs a handful of small operators (a norm, RoPE, a cache
write, attention over the cache, an activation) before the next read. Those operators do almost no arithmetic; their
cost is the host's: Python, PyTorch's dispatch, and the memory that code and its data live in. A weight read larger
than the core's own caches pushes that code and data out, so the first call of each operator after a read finds
them gone. This measures that directly, at the Llama shape of bench/cpu_decode.py (d_model 1024, 16 query heads of
64 sharing 4 key/value heads, 64 cached tokens), one thread, float32:

- `hot`: the operator called again right after itself (its code and data in the caches);
- `after <size>`: the operator called once right after `F.linear` has read one row through a weight of that size
  (1 MiB, smaller than this core's L2; 4 MiB and 22 MiB, the attention output's and the gate-and-up product's
  weights of the Llama shape; 128 MiB);
- `again`: the same call once more, right after its call after 128 MiB: the cost is paid by the first call of an
  operator after a read, not by every call.

Operators: `x * w`, `x + x` and `silu` over one token's 1,024 numbers; `rms_norm` and `layer_norm` of it; `split
heads` (a view and a transpose); `RoPE`, the package's `rope_rotate` (rotate-half, 6 operators); `cache write`, one
token's keys by `index_copy_`; `attention`, one query's 16 heads over 64 cached keys of 4 key/value heads (SDPA,
GQA).

Medians of `--rounds` rounds, microseconds. `caches`: this machine's cache sizes (Linux's sysfs). Nothing asserted.

    python bench/cold_ops.py --out bench/cold_ops.json        # about a minute
"""
import argparse, datetime, json, os, statistics, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.benchmark import cpu_model  # noqa: E402
from selfattn_nbdev.gqa_window_rope import rope_rotate  # noqa: E402

D, HEADS, KV_HEADS, HD, CACHED = 1024, 16, 4, 64, 64


def caches() -> dict:
    "Each cache level of CPU 0 as sysfs names it (e.g. 'L2': '2048K'), or {} where sysfs has none."
    found = {}
    for index in sorted(Path('/sys/devices/system/cpu/cpu0/cache').glob('index*')):
        kind = (index/'type').read_text().strip()
        name = f"L{(index/'level').read_text().strip()}" + ({'Data': 'd', 'Instruction': 'i'}.get(kind, ''))
        found[name] = (index/'size').read_text().strip()
    return found


def operators() -> dict:
    "A decode step's small operators at the Llama shape, each a function of nothing (inputs made here)."
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, D, generator=g)
    w = torch.randn(D, generator=g)
    q = torch.randn(1, HEADS, 1, HD, generator=g)
    k = torch.randn(1, KV_HEADS, CACHED, HD, generator=g)
    v = torch.randn(1, KV_HEADS, CACHED, HD, generator=g)
    cos, sin = torch.randn(1, HD, generator=g), torch.randn(1, HD, generator=g)
    keys = torch.zeros(1, KV_HEADS, 2 * CACHED, HD)
    column = torch.tensor([CACHED])
    new = torch.randn(1, KV_HEADS, 1, HD, generator=g)

    return {
        'x * w': lambda: x * w,
        'x + x': lambda: x + x,
        'silu': lambda: F.silu(x),
        'rms_norm': lambda: F.rms_norm(x, (D,), w, 1e-6),
        'layer_norm': lambda: F.layer_norm(x, (D,), w, w, 1e-5),
        'split heads': lambda: x.view(1, 1, HEADS, HD).transpose(1, 2),
        'RoPE': lambda: rope_rotate(q, cos, sin),  # the package's, as a decode step calls it
        'cache write': lambda: keys.index_copy_(2, column, new),
        'attention': lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }


def measure(rounds: int) -> dict:
    "Medians of `rounds` rounds, µs, for each operator and column, on one thread (the caller's count comes back)."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try: return _measure(rounds)
    finally: torch.set_num_threads(threads)


def _measure(rounds: int) -> dict:
    g = torch.Generator().manual_seed(1)
    sizes = {'1 MiB': (256, D), '4 MiB': (D, D), '22 MiB': (5632, D), '128 MiB': (32768, D)}
    weights = {name: torch.randn(*shape, generator=g) for name, shape in sizes.items()}
    row = torch.randn(1, D, generator=g)
    ops = operators()
    us = lambda seconds: seconds * 1e6
    result = {}
    with torch.no_grad():
        for name, op in ops.items():
            for _ in range(20): op()
            times = {'hot': []} | {f'after {s}': [] for s in sizes} | {'again': []}
            for _ in range(rounds):
                op()
                start = time.perf_counter(); op(); times['hot'].append(us(time.perf_counter() - start))
                for size, W in weights.items():
                    F.linear(row, W)
                    start = time.perf_counter(); op(); times[f'after {size}'].append(us(time.perf_counter() - start))
                    if size == '128 MiB':
                        start = time.perf_counter(); op(); times['again'].append(us(time.perf_counter() - start))
            result[name] = {k: statistics.median(v) for k, v in times.items()}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=61)
    parser.add_argument('--out', help='write the figures as JSON to this file')
    args = parser.parse_args()
    micro = measure(args.rounds)
    out = dict(command='python bench/cold_ops.py --out bench/cold_ops.json', date=datetime.date.today().isoformat(),
               torch=torch.__version__, machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count()),
               threads=1, dtype='float32', rounds=args.rounds, caches=caches(),
               shape=dict(d_model=D, heads=HEADS, kv_heads=KV_HEADS, head_dim=HD, cached_tokens=CACHED),
               microseconds=micro)
    columns = list(next(iter(micro.values())))
    print(f"{'operator':14}" + ''.join(f'{c:>14}' for c in columns))
    for name, row in micro.items():
        print(f'{name:14}' + ''.join(f'{row[c]:14.1f}' for c in columns))
    if args.out: Path(args.out).write_text(json.dumps(out, indent=1) + '\n')


if __name__ == '__main__':
    main()
