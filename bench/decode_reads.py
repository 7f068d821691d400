"""Benchmark: what a compiled decode step on a CPU gains by reading the columns seen rather than a bound above them.

    python bench/decode_reads.py [--out bench/decode_reads.json]    # about 8 minutes

On a CPU, `StaticKVCache.begin_step` hands the compiled step the columns seen, their number symbolic, so one graph
reads exactly those (`seen`). Before, and on a GPU still, where a CUDA graph replays fixed shapes, the host set a
bound, `decode_bound`: the next power of two, at least 256 (`bound`). This times both in one process, on the same
weights and caches: float32, batch 1, 1 thread, random weights of the shapes of bench/cpu_decode.py (GPT-2 small and
its Llama shape), with CONTEXT tokens cached. The step is `generate`'s compiled one (`_decode_step(model, True)`
inside `stacked` and `faster_products`, its weights in 2 MiB pages), every guard checked at every step; each round
runs STEPS steps one way, then the other (which goes first alternates), and rolls the caches back after each, so
every step reads the same length. Recorded
per shape and context: the milliseconds of a step each way (medians of the rounds, and every round's), the columns
each reads, the ratio bound / seen, and whether both steps' logits chose the same token. Printed and written;
nothing is asserted.
"""
import argparse, contextlib, datetime, json, os, statistics, sys, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev import decoding  # noqa: E402
from selfattn_nbdev.caches import StaticKVCache, decode_bound  # noqa: E402

from bench.benchmark import cpu_model  # noqa: E402
from bench.cpu_decode import SHAPES, hf_model, ours_of  # noqa: E402

CONTEXTS = {'gpt2': (32, 512, 960), 'llama': (32, 512, 1984)}
STEPS, ROUNDS = 16, 7


@contextlib.contextmanager
def bounded():
    "The compiled step as it was, and as it is on a GPU: every step reads decode_bound's columns, a graph per bound."
    rule = StaticKVCache._reads_a_bound
    StaticKVCache._reads_a_bound = lambda self: True
    try: yield
    finally: StaticKVCache._reads_a_bound = rule


def timed_steps(step, caches, nxt) -> tuple:
    "Milliseconds a step over STEPS steps, and the first step's logits; the caches rolled back after."
    start, first = time.perf_counter(), None
    for _ in range(STEPS):
        logits = step(nxt, caches)
        first = logits if first is None else first
    ms = (time.perf_counter() - start) / STEPS * 1e3
    for c in caches: c.step.sub_(STEPS); c.num_seen -= STEPS
    return ms, first


def measure(model, context: int) -> dict:
    "Both ways on one model and context, in alternating rounds."
    ids = torch.randint(3, model.vocab_size, (1, context))
    capacity = decode_bound(context + STEPS, model.context_length)
    caches, step = model.new_caches(capacity), decoding._decode_step(model, True)
    nxt, times, tokens = torch.tensor([[5]]), {'seen': [], 'bound': []}, {}
    model(ids, caches)
    for way in ('seen', 'bound'):  # compiles each graph before the rounds
        with bounded() if way == 'bound' else contextlib.nullcontext():
            tokens[way] = int(timed_steps(step, caches, nxt)[1][0, -1].argmax())
    for r in range(ROUNDS):
        for way in ('seen', 'bound')[::1 - 2 * (r % 2)]:
            with bounded() if way == 'bound' else contextlib.nullcontext():
                times[way].append(timed_steps(step, caches, nxt)[0])
    ms = {way: statistics.median(t) for way, t in times.items()}
    return dict(ms=ms, ms_each_round=times, ratio_bound_over_seen=ms['bound'] / ms['seen'],
                columns_read={'seen': context + 1, 'bound': decode_bound(context + 1, capacity)},
                same_token=tokens['seen'] == tokens['bound'])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--out', default=str(ROOT / 'bench' / 'decode_reads.json'))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    result = dict(date=datetime.date.today().isoformat(), command='python bench/decode_reads.py',
                  torch=torch.__version__, machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count()),
                  threads=1, dtype='float32', steps_a_round=STEPS, rounds=ROUNDS, shapes={})
    for name, contexts in CONTEXTS.items():
        model = ours_of(hf_model(SHAPES[name]))
        result['shapes'][name] = {}
        with torch.no_grad(), decoding.stacked(model), decoding.faster_products(model, compiled=True):
            decoding.weights_in_huge_pages(model)
            for context in contexts:
                entry = result['shapes'][name][f'context {context}'] = measure(model, context)
                print(name, context, {k: round(v, 2) for k, v in entry['ms'].items()},
                      f"bound/seen {entry['ratio_bound_over_seen']:.3f}", entry['columns_read'], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    print('wrote', args.out)


if __name__ == '__main__':
    main()
