"""Benchmark: top-k sparse attention (DeepSeek Sparse Attention) against dense causal SDPA on CPU.

    python bench/sparse.py     # writes bench/sparse.json (about two minutes on two cores)

The shape is MLA's as DeepSeek-V3.2 runs DSA: queries absorbed into the latent, so every head attends over one
shared key head of d_c + d_R = 576 numbers (DeepSeek-V3's 512 + 64), values of d_c = 512; 16 query heads (V3.2
has 128: 16 is what one of 8 tensor-parallel ranks holds), batch 1, float32, k = 512 kept keys per query.
Dense: F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) on the same tensors. Sparse:
sparse_attention over indices from topk_indices of random index scores (the attention's time does not depend on
which keys are kept). Each length runs once after a warm-up at a small length (one run: the dense side takes
seconds at 8,192). The crossing is the shortest length measured at which sparse is faster, refined by
interpolating log time against log length between the two lengths around it. The indexer (lightning_indexer +
topk_indices with 64 heads of 128, as V3.2, but float32 where the paper uses FP8) is timed once at 8,192: the
price of choosing, which sparse attention does not replace. Printed and written, never asserted.
"""
import datetime, json, math, os, shlex, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev.sparse import lightning_indexer, sparse_attention, topk_indices  # noqa: E402
from bench.benchmark import cpu_model  # noqa: E402

SIZES = dict(num_heads=16, key_width=576, value_width=512, k=512, index_heads=64, index_dim=128)
LENGTHS = (512, 1024, 2048, 4096, 8192)


def timed(fn) -> float:
    "Seconds of one call."
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def main(out: Path) -> dict:
    load = os.getloadavg()
    torch.manual_seed(0)
    h, dk, dv, k = (SIZES[n] for n in ('num_heads', 'key_width', 'value_width', 'k'))

    def tensors(T):
        q = torch.randn(1, h, T, dk)
        latent = torch.randn(1, 1, T, dk)                # one shared key head: the latents
        indices = topk_indices(torch.randn(1, T, T), k)  # (1, T, k)
        return q, latent, latent[..., :dv], indices

    runs = {
        'dense': lambda q, kk, v, i: F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True),
        'sparse': lambda q, kk, v, i: sparse_attention(q, kk, v, i),
    }
    warm = tensors(256)
    for fn in runs.values(): fn(*warm)
    ms = {}
    for T in LENGTHS:
        args = tensors(T)
        ms[T] = {name: timed(lambda: fn(*args)) * 1e3 for name, fn in runs.items()}
        print(T, {n: f'{v:,.1f} ms' for n, v in ms[T].items()}, flush=True)
    faster = [T for T in LENGTHS if ms[T]['sparse'] < ms[T]['dense']]
    crossing = None
    if faster and faster[0] != LENGTHS[0]:
        a, b = LENGTHS[LENGTHS.index(faster[0]) - 1], faster[0]
        gap = lambda T: math.log(ms[T]['dense']) - math.log(ms[T]['sparse'])   # > 0: sparse faster
        t = gap(a) / (gap(a) - gap(b))
        crossing = round(math.exp(math.log(a) + t * (math.log(b) - math.log(a))))
    T = LENGTHS[-1]
    H, d_I = SIZES['index_heads'], SIZES['index_dim']
    iq, ik, iw = torch.randn(1, H, T, d_I), torch.randn(1, 1, T, d_I), torch.randn(1, T, H)
    blocks = range(0, T, 512)  # 512 queries at a time: (H, 512, T) scores, 1 GiB
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    indexer_ms = timed(lambda: [topk_indices(lightning_indexer(iq[:, :, s:s + 512], ik, iw[:, s:s + 512]), k,
                                             causal[s:s + 512]) for s in blocks]) * 1e3
    print(f'indexer at {T}: {indexer_ms:,.1f} ms; crossing near T = {crossing}', flush=True)
    result = {
        'what': 'one layer: dense causal SDPA against top-k sparse attention by gather (MLA shape, absorbed)',
        'sizes': SIZES, 'dtype': 'float32', 'batch': 1, 'device': 'cpu',
        'ms': {str(T): v for T, v in ms.items()},
        'ratio_dense_over_sparse': {str(T): v['dense'] / v['sparse'] for T, v in ms.items()},
        'crossing_T': crossing, 'indexer_ms': indexer_ms, 'indexer_T': T,
        'runs': 1, 'statistic': 'one run after a warm-up', 'gpu': 'unmeasured',
        'machine': {'cpu_model': cpu_model(), 'cpu_count': os.cpu_count()}, 'torch': torch.__version__,
        'threads': torch.get_num_threads(), 'date': datetime.date.today().isoformat(),
        'command': ' '.join([*(f'OMP_NUM_THREADS={t}' for t in [os.environ.get('OMP_NUM_THREADS')] if t),
                             *(shlex.quote(a) for a in ['python', *sys.argv])]),
        'load_average_at_start': load[0]}
    out.write_text(json.dumps(result, indent=1) + '\n')
    return result


if __name__ == '__main__':
    main(Path(__file__).with_name('sparse.json'))
