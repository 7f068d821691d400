"""Benchmark: the package's attention against PyTorch's fused kernel, on CPU.

    python bench/benchmark.py            # the full run (~10 min on 2 cores), writes bench/results.json
    python bench/benchmark.py --quick    # small T, few repetitions: a smoke test

One run times five implementations of the same causal multi-head attention (float32, batch 2,
d_in = d_out = 256, 4 heads, no dropout) at every num_tokens T:

- `fast`: `MultiHeadAttention` (its SDPA path);
- `explicit`: `MultiHeadAttention(..., return_attn_weights=True)` (scores, mask, softmax, weighted sum);
- `wrapper`: `MultiHeadAttentionWrapper` (4 `CausalAttention` heads; no output projection);
- `reference`: the same projections + `F.scaled_dot_product_attention(..., is_causal=True)` + the same out_proj;
- `torch_mha`: `nn.MultiheadAttention(batch_first=True)` with a causal mask and `need_weights=False`;
- `torch_mha_causal`: the same called as its documentation recommends for a causal mask: the mask *and*
  `is_causal=True` (a hint that lets it skip reading the mask);
- `fused_qkv`: the package's fast path with the three projections fused into one matrix product (the weights
  concatenated at every call, so that the module's state-dict names could stay as they are).

Forward timings run the modules in eval mode under `torch.no_grad()` (where `nn.MultiheadAttention` takes its
fused inference path); forward+backward timings run them in training mode (dropout is 0 either way).

All share one set of weights and are first checked against `reference` on a small input (abort if any is off
by more than 1e-5). Timing alternates the implementations inside every repetition (in a new random order each time, so that
none always runs after the same neighbour, whose freed memory or cache state it would inherit) after a
warm-up, with the thread count pinned; each implementation's ratio to `reference` is taken repetition by
repetition, so machine noise affects both sides of a ratio alike. Peak extra memory of one forward is measured
in a fresh process per implementation and T (the highest rise of the resident set size during the call).
"""
import argparse, datetime, json, math, os, platform, random, shlex, statistics, subprocess, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev import MultiHeadAttention, MultiHeadAttentionWrapper, to_torch_multihead  # noqa: E402

BATCH, D, HEADS = 2, 256, 4
IMPLS = ['fast', 'explicit', 'wrapper', 'reference', 'torch_mha', 'torch_mha_causal', 'fused_qkv']


def build(context_length: int, seed: int = 0, training: bool = False) -> dict:
    "The implementations, sharing one set of weights; each maps x (b, T, D) -> (b, T, D) (wrapper: no out_proj)."
    torch.manual_seed(seed)
    mha = MultiHeadAttention(D, D, context_length, num_heads=HEADS, qkv_bias=True).eval()
    wrapper = MultiHeadAttentionWrapper(D, D, context_length, num_heads=HEADS, qkv_bias=True).eval()
    hd = D // HEADS
    with torch.no_grad():
        for h, head in enumerate(wrapper.heads):
            for name in ['W_query', 'W_key', 'W_value']:
                getattr(head, name).weight.copy_(getattr(mha, name).weight[h * hd:(h + 1) * hd])
                getattr(head, name).bias.copy_(getattr(mha, name).bias[h * hd:(h + 1) * hd])
    torch_mha = to_torch_multihead(mha)
    for m in [mha, wrapper, torch_mha]: m.train(training)
    causal_mask = torch.ones(context_length, context_length, dtype=torch.bool).triu(1)

    def fused_qkv(x):
        "One matrix product for the three projections, then the same kernel and out_proj."
        b, T, _ = x.shape
        weight = torch.cat([mha.W_query.weight, mha.W_key.weight, mha.W_value.weight])  # (3D, D)
        bias = torch.cat([mha.W_query.bias, mha.W_key.bias, mha.W_value.bias])
        q, k, v = F.linear(x, weight, bias).view(b, T, 3, HEADS, hd).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (b, heads, T, hd)
        return mha.out_proj(ctx.transpose(1, 2).reshape(b, T, D))

    def reference(x, out_proj=True):
        b, T, _ = x.shape
        split = lambda t: t.view(b, T, HEADS, hd).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(split(mha.W_query(x)), split(mha.W_key(x)), split(mha.W_value(x)), is_causal=True)
        ctx = ctx.transpose(1, 2).reshape(b, T, D)
        return mha.out_proj(ctx) if out_proj else ctx

    return {
        'fast': mha,
        'explicit': lambda x: mha(x, return_attn_weights=True)[0],
        'wrapper': wrapper,
        'reference': reference,
        'torch_mha': lambda x: torch_mha(x, x, x, attn_mask=causal_mask[:x.shape[1], :x.shape[1]], need_weights=False)[0],
        'torch_mha_causal': lambda x: torch_mha(x, x, x, attn_mask=causal_mask[:x.shape[1], :x.shape[1]],
                                                need_weights=False, is_causal=True)[0],
        'fused_qkv': fused_qkv,
        '_reference_without_out_proj': lambda x: reference(x, out_proj=False),
        '_params': list(mha.parameters()) + list(wrapper.parameters()) + list(torch_mha.parameters()),
    }


def check_correctness(tol: float = 1e-5) -> dict:
    "Every implementation against the reference on a small input; abort on a mismatch."
    impls = build(64)
    x = torch.randn(BATCH, 64, D)
    diffs = {}
    with torch.no_grad():
        for name in IMPLS:
            ref = impls['_reference_without_out_proj' if name == 'wrapper' else 'reference'](x)
            diffs[name] = (impls[name](x) - ref).abs().max().item()
    bad = {k: v for k, v in diffs.items() if not v <= tol}
    if bad:
        sys.exit(f'ABORT: implementations disagree with the reference by more than {tol}: {bad}')
    return diffs


def _time(fn, x, backward: bool) -> float:
    t0 = time.perf_counter()
    if backward:
        fn(x).sum().backward()
    else:
        with torch.no_grad(): fn(x)
    return time.perf_counter() - t0


def _quartiles(values):
    q = statistics.quantiles(values, n=4, method='inclusive') if len(values) > 1 else [values[0]] * 3
    return {'median': statistics.median(values), 'q1': q[0], 'q3': q[2]}


def time_all(T: int, reps: int, backward: bool, warmup: int) -> dict:
    impls = build(T, training=backward)
    x = torch.randn(BATCH, T, D, requires_grad=backward)
    params = impls['_params']
    times = {name: [] for name in IMPLS}
    for _ in range(warmup):
        for name in IMPLS: _time(impls[name], x, backward)
    shuffle = random.Random(T).shuffle
    for rep in range(reps):
        order = list(IMPLS)
        shuffle(order)  # a new order every repetition: no implementation always follows the same one
        for name in order:
            for p in params: p.grad = None
            x.grad = None
            times[name].append(_time(impls[name], x, backward))
    out = {}
    for name in IMPLS:
        ratios = [t / r for t, r in zip(times[name], times['reference'])]
        out[name] = {'seconds': _quartiles(times[name]), 'ratio_to_reference': _quartiles(ratios), 'reps': reps}
    return out


MEMORY_SNIPPET = r'''
import gc, os, sys, threading, time, torch
sys.path.insert(0, {root!r})
from bench.benchmark import build
torch.set_num_threads({threads})
impls = build({T})
x = torch.randn({batch}, {T}, {d})
page = os.sysconf('SC_PAGE_SIZE')
def rss():
    with open('/proc/self/statm') as f: return int(f.read().split()[1]) * page
gc.collect()
import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)  # give freed set-up memory back, so the forward cannot reuse it unseen
start, peak, done = rss(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.0002)
sampler = threading.Thread(target=sample); sampler.start()
with torch.no_grad(): out = impls[{name!r}](x)
peak[0] = max(peak[0], rss()); done.set(); sampler.join()
print(peak[0] - start)
'''


def peak_memory(name: str, T: int, threads: int) -> int:
    """Bytes by which one forward raises the resident set size of a fresh process, at its highest.

    A thread samples the current RSS (/proc/self/statm) every 0.2 ms while the forward runs; the result is the
    highest sample minus the RSS just before the call (the output, which stays alive, included). Memory freed while
    building the modules is first returned to the system (`malloc_trim`), so that the forward cannot reuse it unseen."""
    code = MEMORY_SNIPPET.format(root=str(ROOT), threads=threads, T=T, batch=BATCH, d=D, name=name)
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    return int(res.stdout.strip().splitlines()[-1])


def import_overhead(runs: int = 15) -> dict:
    """What `import selfattn_nbdev` adds once torch is imported: timed inside fresh interpreters, median of `runs`.

    (Timing two whole interpreters, with and without the package, buries a few milliseconds under the
    ~100 ms run-to-run noise of `import torch` itself.)"""
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    code = ('import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); '
            'import selfattn_nbdev; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)')
    # warm the file cache, and write the package's bytecode as pip does at install (a run that
    # finds it stale, as PYTHONDONTWRITEBYTECODE leaves it after an export, would time the compiler)
    warm = {k: v for k, v in env.items() if k != 'PYTHONDONTWRITEBYTECODE'}
    subprocess.run([sys.executable, '-c', code], check=True, env=warm, capture_output=True)
    torch_s, added_s = [], []
    for _ in range(runs):
        out = subprocess.run([sys.executable, '-c', code], check=True, env=env, capture_output=True, text=True).stdout
        a, b = map(float, out.split())
        torch_s.append(a); added_s.append(b)
    return {'import_torch_ms': 1000 * statistics.median(torch_s), 'overhead_ms': 1000 * statistics.median(added_s), 'runs': runs}


def cpu_model() -> str:
    "The CPU's model name from /proc/cpuinfo (Linux); else platform.processor() or the machine type."
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                key, _, value = line.partition(':')
                if key.strip() == 'model name' and value.strip(): return value.strip()
    except OSError: pass
    return platform.processor() or platform.machine()


def provenance(script: str) -> dict:
    "Where and how a result was measured: the machine, torch, Python, the date, and the command that reruns it."
    return dict(machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count()), torch=torch.__version__,
                python=platform.python_version(), date=datetime.date.today().isoformat(),
                command='python ' + ' '.join(shlex.quote(a) for a in [os.path.relpath(script, ROOT)] + sys.argv[1:]))


def slope(xs, ys) -> float:
    "Least-squares slope of log(ys) against log(xs): the scaling exponent."
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.mean(lx), statistics.mean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--quick', action='store_true', help='T = 128, 256 only, 3 repetitions: a smoke test')
    ap.add_argument('--threads', type=int, default=os.cpu_count())
    ap.add_argument('--out', default=str(ROOT/'bench'/'results.json'))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Ts = [128, 256] if args.quick else [128, 512, 1024, 2048, 4096]
    reps = {128: 60, 512: 30, 1024: 15, 2048: 8, 4096: 4}
    if args.quick: reps = {T: 3 for T in Ts}
    mem_Ts = [128, 256] if args.quick else [2048, 4096]

    started = time.time()
    print(f'torch {torch.__version__}, {args.threads} threads, {cpu_model()}')
    diffs = check_correctness()
    print('correctness vs reference (max abs diff): ' + ', '.join(f'{k} {v:.1e}' for k, v in diffs.items()))

    timings = {'forward': {}, 'forward_backward': {}}
    for T in Ts:
        for mode, backward in [('forward', False), ('forward_backward', True)]:
            timings[mode][T] = time_all(T, reps[T], backward, warmup=2 if T <= 1024 else 1)
            row = timings[mode][T]
            print(f'T={T:5d} {mode:17s} ' + '  '.join(
                f"{n} {row[n]['seconds']['median'] * 1e3:8.2f} ms ({row[n]['ratio_to_reference']['median']:.2f}x)" for n in IMPLS), flush=True)

    memory = {name: {T: peak_memory(name, T, args.threads) for T in mem_Ts} for name in IMPLS}
    for name in IMPLS:
        print(f'peak extra memory {name:10s} ' + '  '.join(f'T={T}: {memory[name][T] / 2**20:8.1f} MiB' for T in mem_Ts))
    imports = import_overhead(5 if args.quick else 15)
    print(f"import selfattn_nbdev adds {imports['overhead_ms']:.1f} ms over import torch ({imports['import_torch_ms']:.0f} ms)")

    fit_Ts = [T for T in Ts if T >= 1024] or Ts
    exponents = {mode: {n: slope(fit_Ts, [timings[mode][T][n]['seconds']['median'] for T in fit_Ts]) for n in IMPLS}
                 for mode in timings}
    mem_exponents = {n: (math.log(memory[n][mem_Ts[1]] / memory[n][mem_Ts[0]]) / math.log(mem_Ts[1] / mem_Ts[0])
                         if min(memory[n].values()) > 0 else float('nan')) for n in IMPLS}
    worst_fast = max(timings[m][T]['fast']['ratio_to_reference']['median'] for m in timings for T in Ts)
    targets = {
        'fast path <= 1.05x reference at every T, forward and forward+backward': worst_fast <= 1.05,
        'explicit path memory grows ~T^2 (exponent >= 1.7)': mem_exponents['explicit'] >= 1.7,
        'fast path memory grows ~T (exponent <= 1.3)': mem_exponents['fast'] <= 1.3,
        'import selfattn_nbdev adds < 50 ms over import torch': imports['overhead_ms'] < 50,
    }
    print('\ntargets:')
    for k, ok in targets.items(): print(f"  {'MET    ' if ok else 'NOT MET'} {k}")
    print(f'  (worst fast-path ratio {worst_fast:.3f}; memory exponents: fast {mem_exponents["fast"]:.2f}, '
          f'explicit {mem_exponents["explicit"]:.2f}; time exponents over T >= {fit_Ts[0]}: '
          + ', '.join(f'{n} {e:.2f}' for n, e in exponents['forward'].items()) + ')')

    results = {
        'machine': {'platform': platform.platform(), 'processor': platform.processor() or platform.machine(),
                    'cpu_model': cpu_model(),
                    'cpu_count': os.cpu_count(), 'python': platform.python_version()},
        'torch': torch.__version__, 'threads': args.threads, 'quick': args.quick,
        'config': {'batch': BATCH, 'd_in': D, 'd_out': D, 'num_heads': HEADS, 'causal': True, 'dropout': 0.0, 'dtype': 'float32'},
        'num_tokens': Ts, 'correctness_max_abs_diff': diffs, 'timings': timings,
        'peak_extra_memory_bytes': memory, 'time_exponents': exponents, 'time_exponent_fit_T': fit_Ts,
        'memory_exponents': mem_exponents, 'import': imports, 'targets': targets,
        'seconds_taken': round(time.time() - started, 1),
        'load_average_at_start': os.getloadavg()[0],
        'date': datetime.date.today().isoformat(),
        'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]]),
    }
    Path(args.out).write_text(json.dumps(results, indent=1) + '\n')
    print(f'\nwrote {args.out} ({results["seconds_taken"]} s)')


if __name__ == '__main__':
    main()
