"""Benchmark: what a compiled CPU decode step pays for reading storage of any capacity in one graph.

    python bench/any_capacity.py [--out bench/any_capacity.json]    # about 2 minutes

On a CPU, once a model's compiled steps of a batch have met a second capacity (a longer text takes a larger cache:
decode_bound's 256, 512, 1024, ...), `generate` sets `any_capacity` on its new caches, and
`StaticKVCache.begin_step` marks their storage dynamic along its columns, so one more graph serves every capacity
after instead of one graph each (seconds each). That graph addresses the storage through a symbol for its capacity
rather than a constant. This times both kinds of graph in one process, on the same weights: float32, batch 1, 1
thread, random weights of bench/cpu_decode.py's shapes, CONTEXTS tokens cached, every product as `generate`'s
compiled step has it (`stacked`, `faster_products`, weights in 2 MiB pages, Inductor with its C++ wrapper). `fixed`
is a graph traced for the storage's capacity, `any` the graph of any capacity (its caches' `any_capacity` set); each
has its own compiled function and caches, and each round runs decode_reads.STEPS steps one way, then the other
(which goes first alternates), rolling the caches back after each. Recorded per shape and context: ms a step each
way (medians of the rounds, and every round's), the ratio any / fixed, the storage's capacity, and whether both
chose the same token. Printed and written; nothing is asserted. Nothing else should run.
"""
import argparse, json, statistics, sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev import decoding  # noqa: E402

from bench import decode_reads  # noqa: E402
from bench.benchmark import provenance  # noqa: E402
from bench.cpu_decode import SHAPES, hf_model, ours_of  # noqa: E402

CONTEXTS = (32, 512)
ROUNDS = 7  # of decode_reads.STEPS steps each way, timed by its timed_steps
WAYS = ('fixed', 'any')


def hosted(compiled):
    "A compiled forward as generate's step runs it: the host's half (begin_step) first."
    def step(token_ids, caches):
        for cache in caches: cache.begin_step(token_ids.shape[1])
        return compiled(token_ids, caches)
    return step


def measure(model, steps: dict, context: int) -> dict:
    "Both kinds of graph at one context, in alternating rounds, each on caches of its own."
    ids = torch.randint(3, model.vocab_size, (1, context))
    capacity = decoding.decode_bound(context + decode_reads.STEPS, model.context_length)
    caches, token, tokens = {way: model.new_caches(capacity) for way in WAYS}, torch.tensor([[5]]), {}
    for way in WAYS:
        for cache in caches[way]: cache.any_capacity = way == 'any'  # as generate sets it at a second capacity
        model(ids, caches[way])
        tokens[way] = int(decode_reads.timed_steps(steps[way], caches[way], token)[1][0, -1].argmax())  # compiles
    times = {way: [] for way in WAYS}
    for r in range(ROUNDS):
        for way in WAYS[::1 - 2 * (r % 2)]:
            times[way].append(decode_reads.timed_steps(steps[way], caches[way], token)[0])
    ms = {way: statistics.median(t) for way, t in times.items()}
    return dict(ms=ms, ms_each_round=times, ratio_any_over_fixed=ms['any'] / ms['fixed'], capacity=capacity,
                same_token=tokens['fixed'] == tokens['any'])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--out', default=str(ROOT / 'bench' / 'any_capacity.json'))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    result = dict(provenance(__file__), threads=1, dtype='float32', steps_a_round=decode_reads.STEPS, rounds=ROUNDS,
                  shapes={})
    options = dict(fullgraph=True, dynamic=False, options=dict(cpp_wrapper=True))  # compile=True's, on a CPU
    for name in SHAPES:
        model = ours_of(hf_model(SHAPES[name]))
        def fixed(ids, caches): return model(ids, caches)  # two functions: a graph cache each
        def any_capacity(ids, caches): return model(ids, caches)
        steps = dict(fixed=hosted(torch.compile(fixed, **options)), any=hosted(torch.compile(any_capacity, **options)))
        result['shapes'][name] = {}
        with torch.no_grad(), decoding.stacked(model), decoding.faster_products(model, compiled=True, rows=(1, 32)):
            decoding.weights_in_huge_pages(model)
            for context in CONTEXTS:
                entry = result['shapes'][name][f'context {context}'] = measure(model, steps, context)
                print(name, context, {k: round(v, 2) for k, v in entry['ms'].items()},
                      f"any/fixed {entry['ratio_any_over_fixed']:.3f}", 'capacity', entry['capacity'], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    print('wrote', args.out)


if __name__ == '__main__':
    main()
