"""Benchmark: a compiled decode step of a small batch, its products by Inductor's loop (row_dot) or by the library.

    python bench/row_loop.py [--rounds 5] [--out bench/row_loop.json]    # about 10 minutes

A decode step of b rows multiplies every weight matrix by b vectors. With one row, `compiled_gemv_kernel` has long
chosen between Inductor's loop (`row_dot`, one streaming pass over each weight) and the library's kernel (oneDNN or
the BLAS). A batch of 2 to LOOP_ROWS rows now gets the same choice: `row_dot` lays the sum out the other way,
(d_out, rows), so each weight row is read once for every row of the batch while it is in the cache, and its input
and output in row-major order, so that the loop runs along the weight's rows. Before, every step of more than one
row called the library. This times both rules in one process: float32, greedy, a PROMPT-token prompt and NEW new
tokens at batch 2, 3 and 4, random weights of bench/cpu_decode.py's shapes (GPT-2 small and its Llama shape), at 1
and 2 threads, the step compiled (`compile=True`). `before` sets LOOP_ROWS to 1, the rule before; `loop` is
`generate` as it is. Each round makes one call each way (which goes first alternates); a call's step time is the
median of its steps after the first two. Recorded per shape, thread count and batch: ms a step each way (medians of
the rounds, and every round's), the ratio before / loop (above 1: the loop is faster), tokens a second, whether both
wrote the same tokens, the seconds of each way's first call (its compile, and for `loop` the probe's), and what
`compiled_gemv_kernel` chose for the batch. Printed and written; nothing is asserted. Nothing else should run.
"""
import argparse, datetime, json, os, statistics, sys, time, warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev import decoding  # noqa: E402
from selfattn_nbdev.decoding import generate  # noqa: E402

from bench.benchmark import cpu_model  # noqa: E402
from bench.cpu_decode import SHAPES, hf_model, ours_of  # noqa: E402

PROMPT, NEW, BATCHES = 32, 32, (2, 3, 4)
RULES = {'before': 1, 'loop': decoding.LOOP_ROWS}  # the most rows row_dot may multiply


def call(model, ids, rule: str) -> tuple:
    "One compiled generate call under a rule: its tokens and the seconds of each step."
    times, kept = [], decoding.LOOP_ROWS
    decoding.LOOP_ROWS = RULES[rule]
    try: return generate(model, ids, NEW, compile=True, step_times=times), times
    finally: decoding.LOOP_ROWS = kept


def measure(model, ids, rounds: int) -> dict:
    "Both rules on one model and batch at the current thread count: a first call each, then alternating rounds."
    tokens, first = {}, {}
    for rule in RULES:
        start = time.perf_counter(); tokens[rule] = call(model, ids, rule)[0]
        first[rule] = time.perf_counter() - start
    ms = {rule: [] for rule in RULES}
    for r in range(rounds):
        for rule in list(RULES)[::1 - 2 * (r % 2)]:
            ms[rule].append(statistics.median(call(model, ids, rule)[1][2:]) * 1e3)
    median = {rule: statistics.median(t) for rule, t in ms.items()}
    batch = len(ids)
    return dict(ms=median, ms_each_round=ms, ratio_before_over_loop=median['before'] / median['loop'],
                tok_s={rule: batch * 1e3 / m for rule, m in median.items()}, first_call_s=first,
                same_tokens=bool(torch.equal(tokens['before'], tokens['loop'])),
                chosen=chosen(model, batch))


def chosen(model, batch: int) -> str:
    "What `compiled_gemv_kernel` chose for the batch's rows in `generate` (kept by the linears it routed)."
    loops = [m.__dict__.get('_routed', {}) for m in model.modules()]
    return 'loop' if any(frozenset({batch}) in kept for kept in loops) else 'library'


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--out', default=str(ROOT / 'bench' / 'row_loop.json'))
    args = ap.parse_args()
    warnings.filterwarnings('ignore', message='generate.compile=...')  # a new thread count compiles again
    result = dict(date=datetime.date.today().isoformat(), command='python bench/row_loop.py',
                  torch=torch.__version__, machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count()),
                  threads='1 and 2', dtype='float32', prompt_tokens=PROMPT, new_tokens=NEW, rounds=args.rounds,
                  loop_rows=decoding.LOOP_ROWS, shapes={})
    for name in ('gpt2', 'llama'):
        model = ours_of(hf_model(SHAPES[name]))
        result['shapes'][name] = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            at = result['shapes'][name][f'{threads} thread{"s" * (threads > 1)}'] = {}
            for batch in BATCHES:
                ids = torch.randint(3, model.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(0))
                entry = at[f'batch {batch}'] = measure(model, ids, args.rounds)
                print(name, threads, batch, {k: round(v, 2) for k, v in entry['ms'].items()},
                      f"before/loop {entry['ratio_before_over_loop']:.3f}", 'same tokens', entry['same_tokens'],
                      'chosen', entry['chosen'], 'first calls', {k: round(v, 1) for k, v in entry['first_call_s'].items()},
                      flush=True)
        del model
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    print('wrote', args.out)


if __name__ == '__main__':
    main()
