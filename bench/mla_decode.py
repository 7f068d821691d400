"""Benchmark: one MLA decode step on CPU, through the latents (absorbed) against rebuilding every cached key and value.

    OMP_NUM_THREADS=1 python bench/mla_decode.py     # writes bench/mla_decode.json (about a minute)

One `LatentAttention` at DeepSeek-V3's per-head proportions (d_c 512, d_R 64, d_nope 128, d_v 128) with its heads
scaled down from 128 to 16 and d_model from 7,168 to 1,024 (V3's own layer would not leave room beside the other
work on this machine), float32, batch 1, untrained weights (the time does not depend on them). For each length the
cache is filled with random latent rows, then one new token is decoded at a time, the two forms taken in
alternation (`_absorbs` forced each way), REPS times each after a warm-up; the best time of each is kept. Each
step appends its token, so the cache grows by at most 2 * (REPS + 1) tokens over the length named. Also counted:
the FLOPs of one step by torch's FlopCounterMode, per cached token (the slope between the two shortest lengths).
Printed and written, never asserted; tests/test_mla_absorbed.py checks the counts on small sizes.
"""
import datetime, json, os, shlex, sys, time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev.generation import KVCache  # noqa: E402
from selfattn_nbdev.deepseek_v3 import LatentAttention  # noqa: E402
from bench.benchmark import cpu_model  # noqa: E402

SIZES = dict(d_model=1024, num_heads=16, kv_rank=512, rope_dim=64, nope_dim=128, v_dim=128, q_rank=384)
LENGTHS, REPS = (1024, 8192, 32768), 3
FORMS = {'absorbed': True, 'rebuilt': False}


def filled(S: int) -> KVCache:
    "A cache holding S random latent rows of d_c + d_R numbers, stored as the layer stores them: two halves."
    cache, half = KVCache(), torch.randn(1, 1, S, (SIZES['kv_rank'] + SIZES['rope_dim']) // 2)
    cache.append(half, half.clone())
    return cache


@torch.no_grad()
def main(out: Path) -> dict:
    load = os.getloadavg()
    torch.manual_seed(0)
    layer = LatentAttention(context_length=max(LENGTHS) + 64, **SIZES).eval()
    x = torch.randn(1, 1, SIZES['d_model'])
    times, flops = {}, {}
    for S in LENGTHS:
        cache, best = filled(S), {name: float('inf') for name in FORMS}
        for rep in range(REPS + 1):                    # rep 0 warms up (and grows the cache's storage once)
            for name, absorb in FORMS.items():
                layer._absorbs = lambda T, S, absorb=absorb: absorb
                start = time.perf_counter()
                layer(x, cache)
                if rep: best[name] = min(best[name], time.perf_counter() - start)
        times[S] = best
        for name, absorb in FORMS.items():
            layer._absorbs = lambda T, S, absorb=absorb: absorb
            with FlopCounterMode(display=False) as counter: layer(x, filled(S))
            flops.setdefault(name, {})[S] = counter.get_total_flops()
        print(S, {k: f'{v * 1e3:.2f} ms' for k, v in best.items()}, flush=True)
    del layer._absorbs
    a, b = LENGTHS[:2]
    result = {
        'sizes': SIZES, 'dtype': 'float32', 'batch': 1,
        'step_ms': {str(S): {k: v * 1e3 for k, v in t.items()} for S, t in times.items()},
        'step_flops': {k: {str(S): f for S, f in v.items()} for k, v in flops.items()},
        'flops_per_cached_token': {k: (v[b] - v[a]) / (b - a) for k, v in flops.items()},
        'reps': REPS, 'statistic': 'min', 'gpu': 'unmeasured',
        'machine': {'cpu_model': cpu_model(), 'cpu_count': os.cpu_count()}, 'torch': torch.__version__,
        'threads': torch.get_num_threads(), 'date': datetime.date.today().isoformat(),
        'command': ' '.join([*(f'OMP_NUM_THREADS={t}' for t in [os.environ.get('OMP_NUM_THREADS')] if t),
                             *(shlex.quote(a) for a in ['python', *sys.argv])]),
        'load_average_at_start': load[0]}
    out.write_text(json.dumps(result, indent=1) + '\n')
    print(json.dumps(result['flops_per_cached_token']))
    return result


if __name__ == '__main__':
    main(Path(__file__).with_name('mla_decode.json'))
