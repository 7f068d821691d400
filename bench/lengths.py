"""A server's load on the compiled FlexAttention path: a new sequence length at almost every call.

    python bench/lengths.py [--lengths 300] [--small] [--out bench/lengths.json]

A `MultiHeadAttention` with a window of 64 (and one with a padding mask), in `flex_mode('compiled')`, on one torch
thread, is called once on each of `--lengths` random lengths between 129 and 1,024 (seed 0), the first of them twice
(the second call is a warm one, compiled already). For every call it records the seconds, whether torch compiled
something new (dynamo's count of graphs) and the process's resident memory. It prints the totals and the figures
that matter to a server: the seconds of all the calls, the time of a call at the 65th to 80th new lengths against the
first ones, and how much the memory grew. Before FlexAttention compiled for dynamic shapes, every new length compiled again (some 3 s on a CPU)
until torch's limit, after which every call ran the uncompiled reference code.
"""
import argparse, datetime, json, random, resource, shlex, statistics, sys, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.kernels import flex_mode  # noqa: E402
from selfattn_nbdev.multihead import MultiHeadAttention  # noqa: E402


def rss_mib() -> float:
    "The resident memory of this process now, in MiB (Linux: /proc/self/statm)."
    pages = int(Path('/proc/self/statm').read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def graphs() -> int:
    "How many graphs dynamo has compiled in this process so far."
    from torch._dynamo.utils import counters
    return counters['stats']['unique_graphs']


def run(kind: str, lengths: list, d: int = 64) -> dict:
    "Call a compiled module once per length; the seconds, new graphs and memory of every call."
    torch.manual_seed(0)
    m = MultiHeadAttention(d, d, 2048, num_heads=4, window=64 if kind == 'window' else None).eval()
    calls = []
    with flex_mode('compiled'), torch.no_grad():
        for T in lengths[:1] + lengths:                     # the first length twice: a warm call
            x = torch.randn(1, T, d)
            pad = None
            if kind == 'padding':
                pad = torch.zeros(1, T, dtype=torch.bool); pad[0, T - T // 5:] = True
            before = graphs()
            start = time.perf_counter()
            m(x, key_padding_mask=pad)
            calls.append(dict(T=T, seconds=time.perf_counter() - start, compiled=graphs() - before,
                              rss_mib=rss_mib()))
    return dict(calls=calls)


def summary(calls: list) -> dict:
    "The figures the issue asks for, from the calls of one run (calls[1] repeats the first length)."
    new = calls[:1] + calls[2:]                           # one call per new length
    first = statistics.median(c['seconds'] for c in [calls[1]] + new[1:16] if not c['compiled'])
    later = statistics.median(c['seconds'] for c in new[64:80])
    compiling = [c['seconds'] for c in calls if c['compiled']]
    return dict(total_seconds=sum(c['seconds'] for c in calls), compilations=sum(c['compiled'] for c in calls),
                calls_compiling=len(compiling), seconds_compiling_median=statistics.median(compiling),
                seconds_first_lengths=first, seconds_65_to_80=later, later_over_first=later / first,
                rss_growth_mib=calls[-1]['rss_mib'] - calls[0]['rss_mib'])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--lengths', type=int, default=300)
    ap.add_argument('--small', action='store_true', help='20 lengths, for a test')
    ap.add_argument('--out', default=str(ROOT / 'bench' / 'lengths.json'))
    args = ap.parse_args()
    n = 20 if args.small else args.lengths
    torch.set_num_threads(1)
    rng = random.Random(0)
    lengths = rng.sample(range(129, 1025), n)             # n different lengths
    result = dict(torch=torch.__version__, threads=1, lengths=n, runs={})
    for kind in ('window', 'padding'):
        r = run(kind, lengths)
        r.update(summary(r['calls']) if n >= 80 else {})
        result['runs'][kind] = r
        s = r.get('total_seconds', sum(c['seconds'] for c in r['calls']))
        print(f"{kind}: {n} lengths in {s:.1f} s, {sum(c['compiled'] for c in r['calls'])} graphs compiled"
              + (f"; a call at lengths 65-80 takes {r['later_over_first']:.2f}x one at the first lengths; "
                 f"memory grew {r['rss_growth_mib']:.0f} MiB" if n >= 80 else ''))
    import os, platform
    from bench.benchmark import cpu_model
    result['machine'] = dict(cpu_model=cpu_model(), cpu_count=os.cpu_count(),
                             platform=platform.platform())
    result['date'] = datetime.date.today().isoformat()
    result['command'] = shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
