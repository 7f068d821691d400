"""Peak memory of LlamaAttention with and without gpt-oss's sinks, one training step at 2,048 tokens, on CPU.

    python bench/sinks_memory.py          # writes bench/sinks_memory.json and prints the ratio (~1 min)

One causal LlamaAttention (d_model 512, 8 query heads and 2 key/value heads of 64, RoPE), float32, batch 1,
forward and backward of (out * w).sum(). Three cases, each in a fresh process:

- `no_sinks`: sinks=False, the fused path (SDPA, causal);
- `sinks`: sinks=True, the path it takes now: tiled_attention with return_lse=True, then sink_after;
- `sinks_explicit`: sinks=True forced onto the explicit path (what it took before: the (b, heads, T, T) scores).

Peak extra memory as bench/memory_tiled.py measures it (PeakRSS: resident set size sampled every 0.2 ms, after a
warm-up call and malloc_trim, minus the size just before the step). Each case runs REPS times, the cases taking
turns, and the median is reported (the baseline moves by several MiB from run to run on a shared machine); one
torch thread; the time of the step is printed beside it, not asserted anywhere.
"""
import argparse, json, os, statistics, subprocess, sys, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.benchmark import provenance  # noqa: E402
from bench.memory_tiled import PeakRSS  # noqa: E402
from selfattn_nbdev.llama_attention import LlamaAttention  # noqa: E402

T, D_MODEL, HEADS, KV_HEADS = 2048, 512, 8, 2
CASES = ('no_sinks', 'sinks', 'sinks_explicit')
REPS = 3


def build(case: str) -> LlamaAttention:
    torch.manual_seed(0)
    m = LlamaAttention(D_MODEL, T, num_heads=HEADS, num_kv_heads=KV_HEADS, sinks=case != 'no_sinks')
    if case == 'sinks_explicit':  # the route before: no tiled kernel for the sinks
        m._sinks_tiled = lambda num_tokens: False
    return m


def step(m: LlamaAttention, num_tokens: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, num_tokens, D_MODEL, generator=g, requires_grad=True)
    w = torch.randn(1, num_tokens, D_MODEL, generator=g)
    (m(x) * w).sum().backward()


def child(case: str) -> dict:
    torch.set_num_threads(1)
    m = build(case)
    step(m, 128)                         # one-time set-up (thread pools, RoPE table) is not counted
    m.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with PeakRSS() as rss:
        step(m, T)
    return dict(peak_bytes=rss.bytes, seconds=time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--child')
    ap.add_argument('--out', default=str(ROOT/'bench'/'sinks_memory.json'))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    samples = {case: [] for case in CASES}
    for _ in range(REPS):
        for case in CASES:
            res = subprocess.run([sys.executable, __file__, '--child', case], capture_output=True, text=True,
                                 check=True)
            samples[case].append(json.loads(res.stdout.strip().splitlines()[-1]))
    runs = {}
    for case, got in samples.items():
        runs[case] = dict(peak_bytes=statistics.median(s['peak_bytes'] for s in got),
                          seconds=statistics.median(s['seconds'] for s in got), samples=got)
        print(f"{case:15s} peak {runs[case]['peak_bytes'] / 2**20:7.1f} MiB   {runs[case]['seconds']:.2f} s "
              f"(medians of {REPS})")
    ratio = runs['sinks']['peak_bytes'] / runs['no_sinks']['peak_bytes']
    print(f"with sinks / without: {ratio:.2f}x (target <= 1.2); explicit path / without: "
          f"{runs['sinks_explicit']['peak_bytes'] / runs['no_sinks']['peak_bytes']:.1f}x")
    out = dict(**provenance(__file__), device='cpu', dtype='float32', threads=1,
               load_average_at_start=os.getloadavg()[0],
               shape=dict(batch=1, num_tokens=T, d_model=D_MODEL, num_heads=HEADS, num_kv_heads=KV_HEADS,
                          head_dim=D_MODEL // HEADS, causal=True, step='forward and backward'),
               runs=runs, ratio_sinks_to_no_sinks=ratio, repetitions=REPS)
    Path(args.out).write_text(json.dumps(out, indent=1) + '\n')
    print('wrote', os.path.relpath(args.out))


if __name__ == '__main__':
    main()
