"""Benchmark: the gated delta rule on a CPU, one layer, against transformers' torch implementation and softmax.

    OMP_NUM_THREADS=1 python bench/linear.py     # writes bench/linear.json (a few minutes)

Sizes: a Qwen3-Next layer at half its width (Qwen3-Next-80B: d_model 2,048, 16 query/key heads and 32 value heads of
128): d_model 1,024, 8 query/key heads, 16 value heads, d_k = d_v = 128; T = 4,096, batch 1, float32, q and k
l2-normalised in the kernel, gates drawn as the layer draws them (beta = sigmoid, g = -softplus). Three measurements,
each the best of REPS runs, the two sides taken in alternation:
- chunked: `chunk_gated_delta_rule` against transformers' `torch_chunk_gated_delta_rule` (chunks of 64), the
  forward under torch.inference_mode and forward + backward (the gradient of o.sum() to q, k, v, g and beta);
- decode: one cached step of a whole `GatedDeltaNet` layer after a prompt of 1,000 and of 16,000 tokens;
- crossing: the chunked kernel against SDPA's causal softmax attention over the same 16 heads of 128, by length;
  the crossing length is interpolated on log-log axes between the two measured lengths around it.
Printed and written, never asserted.
"""
import datetime, json, math, os, shlex, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev.linear import GatedDeltaNet, RecurrentCache, chunk_gated_delta_rule  # noqa: E402
from bench.benchmark import cpu_model  # noqa: E402

SIZES = dict(d_model=1024, num_k_heads=8, num_v_heads=16, head_k_dim=128, head_v_dim=128, T=4096)
REPS, DECODE_AT, LENGTHS = 3, (1000, 16000), (512, 1024, 2048, 4096, 8192)


def inputs(T: int, grad: bool = False) -> list:
    torch.manual_seed(0)
    s = SIZES
    q, k = torch.randn(2, 1, T, s['num_k_heads'], s['head_k_dim'])
    v = torch.randn(1, T, s['num_v_heads'], s['head_v_dim'])
    g = -F.softplus(torch.randn(1, T, s['num_v_heads']))
    beta = torch.randn(1, T, s['num_v_heads']).sigmoid()
    return [t.requires_grad_(grad) for t in (q, k, v, g, beta)]


def best_of(fns: dict, reps: int) -> dict:
    "Best seconds of each function, run in alternation `reps` times after one warm-up round."
    best = {name: math.inf for name in fns}
    for rep in range(reps + 1):
        for name, f in fns.items():
            start = time.perf_counter()
            f()
            if rep: best[name] = min(best[name], time.perf_counter() - start)
    return best


def chunked() -> dict:
    import transformers
    transformers.logging.set_verbosity_error()
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    kernels = {'ours': chunk_gated_delta_rule, 'hf': torch_chunk_gated_delta_rule}
    x = inputs(SIZES['T'])
    def fwd(f):
        with torch.inference_mode(): f(*x, use_qk_l2norm_in_kernel=True)
    fwd_s = best_of({n: (lambda f=f: fwd(f)) for n, f in kernels.items()}, REPS)
    xg = inputs(SIZES['T'], grad=True)
    def fwdbwd(f):
        o, _ = f(*xg, use_qk_l2norm_in_kernel=True)
        o.sum().backward()
    both_s = best_of({n: (lambda f=f: fwdbwd(f)) for n, f in kernels.items()}, REPS)
    res = {f'{n}_fwd_ms': fwd_s[n] * 1e3 for n in kernels} | {f'{n}_fwdbwd_ms': both_s[n] * 1e3 for n in kernels}
    res |= {'fwd_ratio': fwd_s['ours'] / fwd_s['hf'], 'fwdbwd_ratio': both_s['ours'] / both_s['hf']}
    print('chunked', {k: round(v, 3) for k, v in res.items()}, flush=True)
    return res


@torch.inference_mode()
def decode() -> dict:
    torch.manual_seed(0)
    s = SIZES
    layer = GatedDeltaNet(s['d_model'], s['num_k_heads'], s['num_v_heads'], s['head_k_dim'], s['head_v_dim']).eval()
    caches, x = {}, torch.randn(1, 1, s['d_model'])
    for n in DECODE_AT:
        caches[n] = RecurrentCache()
        layer(torch.randn(1, n, s['d_model']), cache=caches[n])
    steps = best_of({str(n): (lambda n=n: layer(x, cache=caches[n])) for n in DECODE_AT}, 10 * REPS)
    a, b = (str(n) for n in DECODE_AT)
    res = {'step_ms': {n: t * 1e3 for n, t in steps.items()}, 'ratio': steps[b] / steps[a],
           'cache_numbers': caches[DECODE_AT[0]].state.numel() + caches[DECODE_AT[0]].conv.numel()}
    print('decode', res, flush=True)
    return res


@torch.inference_mode()
def crossing() -> dict:
    h, d = SIZES['num_v_heads'], SIZES['head_v_dim']
    soft, lin = {}, {}
    for T in LENGTHS:
        torch.manual_seed(0)
        q, k, v = torch.randn(3, 1, h, T, d)
        g = -F.softplus(torch.randn(1, T, h))
        beta = torch.rand(1, T, h)
        t = best_of({'softmax': lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                     'linear': lambda: chunk_gated_delta_rule(
                         q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g, beta,
                         use_qk_l2norm_in_kernel=True)}, REPS)
        soft[T], lin[T] = t['softmax'] * 1e3, t['linear'] * 1e3
        print('crossing', T, f"softmax {soft[T]:.1f} ms, linear {lin[T]:.1f} ms", flush=True)
    cross = None
    for a, b in zip(LENGTHS, LENGTHS[1:]):
        ra, rb = math.log(lin[a] / soft[a]), math.log(lin[b] / soft[b])
        if ra > 0 >= rb:   # linear slower at a, not slower at b: interpolate log(T) where the ratio is 1
            cross = round(math.exp(math.log(a) + (math.log(b) - math.log(a)) * ra / (ra - rb)))
            break
    if cross is not None:
        summary = (f"the chunked gated delta rule overtakes SDPA's causal softmax at about {cross:,} tokens "
                   f"({h} heads of {d})")
    elif lin[LENGTHS[0]] <= soft[LENGTHS[0]]:
        summary = f"the chunked gated delta rule is already faster at {LENGTHS[0]:,} tokens ({h} heads of {d})"
    else:
        summary = f"SDPA's causal softmax stays faster up to {LENGTHS[-1]:,} tokens ({h} heads of {d})"
    return {'softmax_ms': {str(T): v for T, v in soft.items()}, 'linear_ms': {str(T): v for T, v in lin.items()},
            'crossing_T': cross, 'summary': summary}


def main(out: Path) -> dict:
    load = os.getloadavg()
    result = {'sizes': SIZES, 'dtype': 'float32', 'batch': 1, 'chunk_size': 64,
              'chunked': chunked(), 'decode': decode(), 'crossing': crossing(),
              'reps': REPS, 'statistic': 'min', 'device': 'cpu', 'gpu': 'unmeasured',
              'machine': {'cpu_model': cpu_model(), 'cpu_count': os.cpu_count()}, 'torch': torch.__version__,
              'transformers': __import__('transformers').__version__,
              'threads': torch.get_num_threads(), 'date': datetime.date.today().isoformat(),
              'command': ' '.join([*(f'OMP_NUM_THREADS={t}' for t in [os.environ.get('OMP_NUM_THREADS')] if t),
                                   *(shlex.quote(a) for a in ['python', *sys.argv])]),
              'load_average_at_start': load[0]}
    out.write_text(json.dumps(result, indent=1) + '\n')
    print(result['crossing']['summary'])
    return result


if __name__ == '__main__':
    main(Path(__file__).with_name('linear.json'))
