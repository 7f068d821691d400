"""Memory and time of tiled attention against explicit attention and PyTorch's fused kernel, on CPU.

    python bench/memory_tiled.py            # the full run (~5 min), writes bench/tiled.json
    python bench/memory_tiled.py --quick    # T = 256, 512, one repetition: a smoke test

Three implementations of the same attention, softmax(Q K^T / sqrt(d)) V, no mask, float32, batch 1, 2 heads of
head_dim 64, one forward pass under torch.no_grad():

- `explicit`: torch.softmax((queries / sqrt(d)) @ keys^T) @ values: the (heads, T, T) scores and weights written out;
- `tiled`: selfattn_nbdev.tiled.tiled_attention, blocks of 64 (the page nbs/11_tiled.ipynb builds it);
- `sdpa`: F.scaled_dot_product_attention, PyTorch's fused kernel.

Peak extra memory: each implementation and T in a fresh process, as bench/benchmark.py measures it: freed set-up
memory is returned to the system (malloc_trim) after a warm-up call at T = 128, then a thread samples the resident set size (/proc/self/statm)
every 0.2 ms while the call runs; the result is the highest sample minus the size just before the call (the
output included). `explicit` is skipped at a T where two (heads, T, T) float32 matrices would exceed the budget.
Time: `tiled`, `tiled` with blocks of 256 and `sdpa`, alternating within every repetition after a warm-up; the
ratio to `sdpa` is taken repetition by repetition and its median reported.

Everything runs on one torch thread unless --threads says otherwise: the comparison is per core, and it stays
meaningful on a shared machine. (A first run with 2 threads, on 2 cores that other jobs were also using, timed the
tiled loop up to 10x slower than on an idle machine: at every one of its thousands of small operations each thread
waits for the other, and a thread that has lost its core makes the other wait a whole time slice.)
"""
import argparse, ctypes, datetime, gc, json, math, os, platform, shlex, statistics, subprocess, sys, threading, time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.benchmark import cpu_model, slope  # noqa: E402
from selfattn_nbdev.tiled import tiled_attention  # noqa: E402

BATCH, HEADS, HEAD_DIM, BLOCK = 1, 2, 64, 64
BUDGET = 8 * 2**30  # bytes: the explicit path is not run where its predicted peak exceeds this


def explicit(queries, keys, values):
    "Attention with the (heads, T, T) matrices written out."
    attn_scores = (queries / math.sqrt(queries.shape[-1])) @ keys.transpose(-2, -1)  # (b, h, T, T)
    return torch.softmax(attn_scores, dim=-1) @ values                              # (b, h, T, d)


IMPLS = {
    'explicit': explicit,
    'tiled': lambda q, k, v: tiled_attention(q, k, v, block_size=BLOCK),
    'tiled_256': lambda q, k, v: tiled_attention(q, k, v, block_size=256),
    'sdpa': F.scaled_dot_product_attention,
}
MEMORY_IMPLS, TIMED_IMPLS = ['explicit', 'tiled', 'sdpa'], ['tiled', 'tiled_256', 'sdpa']


def inputs(T: int, seed: int = 0) -> tuple:
    "queries, keys, values: three (BATCH, HEADS, T, HEAD_DIM) float32 tensors."
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(BATCH, HEADS, T, HEAD_DIM, generator=g) for _ in range(3))


def explicit_fits(T: int) -> bool:
    "Whether the explicit path's scores and weights, alive together, fit the budget."
    return 2 * BATCH * HEADS * T * T * 4 <= BUDGET


class PeakRSS:
    "Context manager: the highest rise of this process's resident set size while the block runs, in `.bytes`."
    page = os.sysconf('SC_PAGE_SIZE')

    @classmethod
    def now(cls) -> int:
        with open('/proc/self/statm') as f: return int(f.read().split()[1]) * cls.page

    def _sample(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.now()); time.sleep(0.0002)

    def __enter__(self):
        gc.collect()
        ctypes.CDLL('libc.so.6').malloc_trim(0)  # freed set-up memory goes back: the call cannot reuse it unseen
        self.done, self.start = threading.Event(), self.now()
        self.peak, self.thread = self.start, threading.Thread(target=self._sample)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.peak = max(self.peak, self.now())
        self.done.set(); self.thread.join()
        self.bytes = self.peak - self.start


def measure_here(name: str, T: int) -> int:
    "In this process: the peak extra memory of one forward of `name` at length T."
    with torch.no_grad():
        IMPLS[name](*inputs(2 * BLOCK, seed=1))  # one-time set-up (thread pools, kernels) is not counted
    q, k, v = inputs(T)
    with torch.no_grad(), PeakRSS() as rss:
        out = IMPLS[name](q, k, v)
    del out
    return rss.bytes


def peak_memory(name: str, T: int, threads: int) -> int:
    "The same, in a fresh process."
    cmd = [sys.executable, __file__, '--child', name, str(T), '--threads', str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(res.stdout.strip().splitlines()[-1])


def time_all(T: int, reps: int) -> dict:
    "Seconds per forward of each timed implementation, alternating within every repetition."
    q, k, v = inputs(T)
    seconds = {name: [] for name in TIMED_IMPLS}
    with torch.no_grad():
        for _ in range(reps):
            for name in TIMED_IMPLS:
                t0 = time.perf_counter(); IMPLS[name](q, k, v)
                seconds[name].append(time.perf_counter() - t0)
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--quick', action='store_true', help='T = 256, 512, one repetition: a smoke test')
    ap.add_argument('--threads', type=int, default=1, help='torch threads (default 1: see the docstring)')
    ap.add_argument('--out', default=str(ROOT/'bench'/'tiled.json'))
    ap.add_argument('--child', nargs=2, metavar=('IMPL', 'T'), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(measure_here(args.child[0], int(args.child[1])))
        return

    started = time.time()
    Ts = [256, 512] if args.quick else [1024, 2048, 4096, 8192, 16384]
    reps = {T: 1 if args.quick else (5 if T <= 2048 else 3) for T in Ts}
    print(f'torch {torch.__version__}, {args.threads} threads, {cpu_model()}', flush=True)

    q, k, v = inputs(Ts[0], seed=1)
    with torch.no_grad():
        diff = (IMPLS['tiled'](q, k, v) - F.scaled_dot_product_attention(q, k, v)).abs().max().item()
    print(f'tiled vs sdpa at T={Ts[0]}: max abs diff {diff:.1e}', flush=True)
    if diff > 1e-6: sys.exit(f'ABORT: tiled_attention differs from SDPA by {diff:.1e}')

    memory = {name: {} for name in MEMORY_IMPLS}
    for T in Ts:
        for name in MEMORY_IMPLS:
            fits = name != 'explicit' or explicit_fits(T)
            memory[name][T] = peak_memory(name, T, args.threads) if fits else None
        print(f'T={T:6d} peak extra MiB: ' + '  '.join(
            f'{n} {memory[n][T] / 2**20:9.1f}' if memory[n][T] is not None else f'{n} (over budget)'
            for n in MEMORY_IMPLS), flush=True)
    exponents = {}
    for name in MEMORY_IMPLS:
        done = [T for T in Ts if memory[name][T]]
        exponents[name] = slope(done, [memory[name][T] for T in done]) if len(done) > 1 else float('nan')
    print('memory exponents (log-log slope): ' + ', '.join(f'{n} {p:.2f}' for n, p in exponents.items()))

    times, ratios = {name: {} for name in TIMED_IMPLS}, {'tiled': {}, 'tiled_256': {}}
    time_all(Ts[0], reps=1)  # warm-up: first calls set up kernels and caches
    for T in Ts:
        seconds = time_all(T, reps[T])
        for name in TIMED_IMPLS:
            times[name][T] = {'median': statistics.median(seconds[name]), 'reps': reps[T]}
        for name in ratios:
            ratios[name][T] = statistics.median(a / b for a, b in zip(seconds[name], seconds['sdpa']))
        print(f'T={T:6d} ms: ' + '  '.join(f'{n} {times[n][T]["median"] * 1e3:9.1f}' for n in TIMED_IMPLS)
              + f'   tiled/sdpa {ratios["tiled"][T]:.0f}x, tiled_256/sdpa {ratios["tiled_256"][T]:.0f}x', flush=True)

    results = {
        'machine': {'platform': platform.platform(), 'cpu_model': cpu_model(), 'cpu_count': os.cpu_count(),
                    'python': platform.python_version()},
        'torch': torch.__version__, 'threads': args.threads, 'quick': args.quick,
        'config': {'batch': BATCH, 'num_heads': HEADS, 'head_dim': HEAD_DIM, 'dtype': 'float32', 'causal': False,
                   'block_size': BLOCK, 'explicit_budget_bytes': BUDGET},
        'num_tokens': Ts,
        'check': {'num_tokens': Ts[0], 'max_abs_diff': diff},
        'peak_extra_memory_bytes': memory, 'memory_exponents': exponents,
        'time_seconds': times, 'time_ratio_to_sdpa': ratios,
        'seconds_taken': round(time.time() - started, 1), 'load_average_at_start': os.getloadavg()[0],
        'date': datetime.date.today().isoformat(),
        'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]]),
    }
    Path(args.out).write_text(json.dumps(results, indent=1) + '\n')
    print(f'wrote {args.out} ({results["seconds_taken"]} s)')


if __name__ == '__main__':
    main()
