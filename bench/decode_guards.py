"""Benchmark: what Dynamo's guards cost a compiled decode step on a CPU, and what `generate` saves by checking them
once a call.

    python bench/decode_guards.py [--out bench/decode_guards.json]    # about 4 minutes

Before each call of a compiled function Dynamo checks its guards: that the model, its caches and the global state
are what the graph was made for. Between two steps of `generate` nothing runs but the package's own code, so after
a call's first step (every guard checked) it leaves Dynamo only the guards that tell its graphs apart
(`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`) for as long as the host's state (the bound, the thread
count, the caches) is that step's. `generate_stream` hands every token to its caller, whose code may change the
model, and checks every guard at every step. This times both in one process: float32, batch 1, a PROMPT-token
prompt and NEW new tokens, greedy, random weights of bench/cpu_decode.py's shapes (GPT-2 small and its Llama
shape), at 1 and 2 threads, the step compiled (compile=True). Each round makes one call each way (which goes first
alternates); a call's step time is the median of its steps after the first two (the prompt's, and the first
decode step, which checks every guard either way). Recorded per shape and thread count: milliseconds a step each
way (medians of the rounds, and every round's), the ratio stream / generate, whether both ways wrote the same
tokens, and the step graph's guards: all of them (`checked`) and those Dynamo keeps when the host checks the rest
(`kept`). Printed and written; nothing is asserted.
"""
import argparse, datetime, json, os, statistics, sys, time, warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.decoding import generate, generate_stream  # noqa: E402

from bench.benchmark import cpu_model  # noqa: E402
from bench.cpu_decode import NEW, PROMPT, SHAPES, hf_model, ours_of  # noqa: E402

ROUNDS = 7


def stream_times(model, ids) -> tuple:
    "The tokens of one generate_stream call, and the seconds between its yields (the first: the prompt's)."
    new, times, start = [], [], time.perf_counter()
    for t in generate_stream(model, ids, NEW, compile=True):
        times.append(time.perf_counter() - start); new.append(t); start = time.perf_counter()
    return torch.cat([ids, torch.stack(new, 1)], 1), times


def generate_times(model, ids) -> tuple:
    "The tokens of one generate call, and the seconds of each of its steps (step_times)."
    times = []
    return generate(model, ids, NEW, compile=True, step_times=times), times


WAYS = {'generate': generate_times, 'generate_stream': stream_times}


def leaf_guards(node) -> int:
    "The checks under one of Dynamo's guard managers (a tree: attribute, item and dict managers, each with leaves)."
    if node is None: return 0
    kids = list(node.get_child_managers())
    if hasattr(node, 'get_key_value_managers'):
        kids += [m for pair in node.get_key_value_managers().values() for m in pair]
    return len(node.get_leaf_guards()) + sum(leaf_guards(k) for k in kids)


def guards_of_last_graph(model) -> dict:
    "Of the graph Dynamo ran last for the model's forward: its guards, and those kept when the host checks the rest."
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    entry = _debug_get_cache_entry_list(type(model).forward.__code__)[0]   # the last one used comes first
    manager = entry.guard_manager
    return dict(checked=leaf_guards(manager.root), kept=leaf_guards(manager.diff_guard_root))


def measure(model, ids) -> dict:
    "Both ways on one model at the current thread count, in alternating rounds, after one call each (compiles)."
    tokens = {way: fn(model, ids)[0] for way, fn in WAYS.items()}
    ms = {way: [] for way in WAYS}
    for r in range(ROUNDS):
        for way in list(WAYS)[::1 - 2 * (r % 2)]:
            ms[way].append(statistics.median(WAYS[way](model, ids)[1][2:]) * 1e3)
    median = {way: statistics.median(t) for way, t in ms.items()}
    return dict(ms=median, ms_each_round=ms, ratio_stream_over_generate=median['generate_stream'] / median['generate'],
                same_tokens=bool(torch.equal(tokens['generate'], tokens['generate_stream'])),
                guards=guards_of_last_graph(model))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--out', default=str(ROOT / 'bench' / 'decode_guards.json'))
    args = ap.parse_args()
    warnings.filterwarnings('ignore', message='generate.compile=...')  # a new thread count compiles again
    result = dict(date=datetime.date.today().isoformat(), command='python bench/decode_guards.py',
                  torch=torch.__version__, machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count()),
                  threads='1 and 2', dtype='float32', prompt_tokens=PROMPT, new_tokens=NEW, rounds=ROUNDS, shapes={})
    for name in ('gpt2', 'llama'):
        model = ours_of(hf_model(SHAPES[name]))
        ids = torch.randint(3, model.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
        result['shapes'][name] = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            entry = result['shapes'][name][f'{threads} thread{"s" * (threads > 1)}'] = measure(model, ids)
            print(name, threads, {k: round(v, 2) for k, v in entry['ms'].items()},
                  f"stream/generate {entry['ratio_stream_over_generate']:.3f}", 'same tokens', entry['same_tokens'],
                  'guards', entry['guards'],
                  flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    print('wrote', args.out)


if __name__ == '__main__':
    main()
