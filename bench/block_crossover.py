"""Where the tiled kernel ('block') beats the explicit path for a score function with a backward pass, on CPU.

    python bench/block_crossover.py       # writes bench/block_crossover.json and prints the ratios (~1 min)

FlexAttention has no backward pass on a CPU and SDPA takes no score function, so a training step with one (ALiBi
here) runs either the explicit path, the (T, T) scores in memory, or tiled_attention, which keeps one tile of scores
and loops over tiles in Python. This times one forward and backward of each, causal ALiBi, batch 1, 4 heads of 64,
float32, one torch thread, at several lengths; each figure is the best of REPS runs, the two paths taking turns.
Where tiled_attention starts to win is masks.BLOCK_MIN_PAIRS (2,048 tokens, 2,048² pairs): below it the module's
kernel choice keeps the explicit path, from it the tiled one (and its memory for one tile). Ratios are printed from
one run; nothing here is asserted.
"""
import argparse, json, math, os, sys, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.benchmark import provenance  # noqa: E402
from selfattn_nbdev.kernels import BLOCK_MIN_PAIRS  # noqa: E402
from selfattn_nbdev.tiled import alibi, alibi_slopes, tiled_attention  # noqa: E402

HEADS, HEAD_DIM, LENGTHS, REPS = 4, 64, (512, 1024, 2048, 3072), 3
ALIBI = alibi(alibi_slopes(HEADS))


def explicit(q, k, v):
    "The scores in memory: QK^T / sqrt(d), ALiBi, the causal mask, softmax, the weighted sum."
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    idx = torch.arange(T)
    scores = ALIBI(scores, torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(HEADS)[:, None, None],
                   idx[:, None], idx[None])
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(scores, -1) @ v


def tiled(q, k, v):
    return tiled_attention(q, k, v, causal=True, score_mod=ALIBI)


def step_seconds(fn, T: int) -> float:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, T, HEAD_DIM, requires_grad=True) for _ in range(3))
    start = time.perf_counter()
    fn(q, k, v).sum().backward()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--out', default=str(ROOT/'bench'/'block_crossover.json'))
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = {}
    for T in LENGTHS:
        best = {'explicit': math.inf, 'tiled': math.inf}
        for _ in range(REPS):
            for name, fn in (('explicit', explicit), ('tiled', tiled)):
                best[name] = min(best[name], step_seconds(fn, T))
        runs[T] = dict(explicit_ms=best['explicit'] * 1e3, tiled_ms=best['tiled'] * 1e3,
                       tiled_over_explicit=best['tiled'] / best['explicit'])
        print(f"T={T:5d}  explicit {runs[T]['explicit_ms']:8.1f} ms   tiled {runs[T]['tiled_ms']:8.1f} ms   "
              f"tiled / explicit {runs[T]['tiled_over_explicit']:.2f}")
    out = dict(**provenance(__file__), device='cpu', dtype='float32', threads=1,
               shape=dict(batch=1, num_heads=HEADS, head_dim=HEAD_DIM, causal=True, score_mod='ALiBi',
                          step='forward and backward'),
               block_min_pairs=BLOCK_MIN_PAIRS, repetitions=REPS, best_of='each length: the fastest of the runs',
               runs={str(T): r for T, r in runs.items()})
    Path(args.out).write_text(json.dumps(out, indent=1) + '\n')
    print('wrote', os.path.relpath(args.out))


if __name__ == '__main__':
    main()
