"""The host's share of a decode step: the package's eager step against a bare step on the same weights, per layer.

    python bench/host_overhead.py [--threads 1 2] [--out bench/host_overhead.json]

GPT-2 and Llama of 12 layers at tiny widths (64 numbers a token, 4 heads; Llama with 2 key/value heads), so that the
arithmetic is small and what remains is the work around it: checks, parts, the cache's bookkeeping, the calls between
modules. The bare step is `bench/cpu_decode.py`'s (`bare_step`: the arithmetic alone, gpt-fast's shape of step). Both
decode after a 32-token prompt, greedy; the package through its fast path (stacked projections, the faster product
for a row), as `generate` runs it. After a warm-up that is not kept, rounds alternate the two (5 rounds of 40
steps each, the median of the rounds); the figure is (package - bare) / layers, in microseconds. Nothing else should
run: it times the host.
"""
import argparse, datetime, json, os, platform, statistics, sys, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT/'bench'))

LAYERS = 12
TINY = dict(gpt2=dict(n_embd=64, n_head=4, vocab_size=512, n_layer=LAYERS),
            llama=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       vocab_size=512, num_hidden_layers=LAYERS))


def per_layer(name: str, rounds: int = 5, steps: int = 40) -> dict:
    "Milliseconds a step, package and bare, and the package's extra microseconds per layer."
    import cpu_decode as cd
    from selfattn_nbdev import decoding
    config = dict(cd.SHAPES[name]) | TINY[name]
    model = cd.ours_of(cd.hf_model(config)).eval()
    ids = torch.randint(3, model.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    nxt = torch.tensor([[5]])
    bare = cd.bare_step(model, False)
    times = {'package': [], 'bare': []}
    with torch.no_grad(), decoding.stacked(model), decoding.faster_products(model, None):
        for _ in range(rounds):
            for kind in times:
                if kind == 'package':
                    caches = model.new_caches(); model(ids, caches)
                    step = lambda i: model(nxt, caches)
                else:
                    for p in range(ids.shape[1]): bare(5, p)
                    step = lambda i: bare(5, ids.shape[1] + i)
                for i in range(5): step(i)
                start = time.perf_counter()
                for i in range(steps): step(5 + i)
                times[kind].append((time.perf_counter() - start) / steps * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    return dict(package_ms=round(ms['package'], 4), bare_ms=round(ms['bare'], 4),
                us_a_layer=round((ms['package'] - ms['bare']) / LAYERS * 1e3, 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--threads', type=int, nargs='*', default=[1, 2])
    parser.add_argument('--out', help='write the figures as JSON here')
    args = parser.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    result = dict(date=datetime.date.today().isoformat(), command='python bench/host_overhead.py --out '
                  'bench/host_overhead.json', torch=torch.__version__, machine=platform.processor() or
                  platform.machine(), layers=LAYERS, widths=TINY,
                  threads=' and '.join(map(str, args.threads)), by_threads={})
    with open('/proc/cpuinfo') as f:
        names = [l.split(':', 1)[1].strip() for l in f if l.startswith('model name')]
    result['machine'] = dict(cpu_model=names[0] if names else result['machine'], cpu_count=os.cpu_count())
    per_layer('gpt2', rounds=1, steps=20)  # a warm-up, not kept: a process's first steps run slow
    for threads in args.threads:
        torch.set_num_threads(threads)
        result['by_threads'][str(threads)] = {name: per_layer(name) for name in TINY}
        print(threads, 'thread(s):', result['by_threads'][str(threads)], flush=True)
    if args.out: Path(args.out).write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
