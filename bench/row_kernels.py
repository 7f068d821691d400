"""Benchmark: the kernel of each number of rows, and what it does for decoding a batch on a CPU.

    python bench/row_kernels.py [--rounds 3] [--out bench/row_kernels.json]    # about 5 minutes

`faster_products` multiplies a product of r rows (tokens) by the kernel `rows_kernel` measured for r's bucket (1, 2,
4, ..., 64 rows; more take 64's), the BLAS behind F.linear or oneDNN. Before, every product of up to 16 rows took the
kernel measured for one row, and every longer one the kernel measured for 64 rows. On the two shapes of
bench/cpu_decode.py (GPT-2 small; a 200 M Llama shape with 16/4 heads), random weights read by `from_hf`, float32, at
1 and 2 threads, this records:

- `choices`: the kernel `rows_kernel` chose for each bucket, on the matrices `generate` multiplies by (inside
  `stacked`), and the seconds each measurement took (the first in the process for that bucket and thread count);
- `decode`: greedy decoding of a 32-token prompt and 32 new tokens at batch 1, 4 and 16: tokens a second of the decode
  steps (the prompt's step left out) with the kernels chosen by rows (`by rows`) and by the rule before (`before`),
  in turns within each round, each first in half of them; medians of the rounds, the ratio, and whether both wrote
  the same tokens;
- `caches`: this machine's cache sizes (Linux's sysfs): where the last level holds 64 MB, the probe reads from it.

Printed and written; nothing is asserted. Nothing else should run on the machine meanwhile.
"""
import argparse, datetime, json, os, statistics, sys, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / 'bench'))
from selfattn_nbdev import decoding  # noqa: E402
from selfattn_nbdev.decoding import GEMM_PROBE_ROWS, GEMV_ROWS, generate  # noqa: E402
from bench.benchmark import cpu_model  # noqa: E402
from cold_ops import caches  # noqa: E402
from cpu_decode import SHAPES, hf_model, ours_of  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BATCHES, PROMPT, NEW = (1, 4, 16), 32, 32


def choices(model) -> dict:
    "The kernel of each bucket, measured as generate's block measures it, and the seconds each took."
    out = {}
    with decoding.stacked(model):
        for rows in BUCKETS:
            start = time.perf_counter()
            kernel = decoding.rows_kernel(model, rows)
            out[str(rows)] = dict(kernel=kernel, seconds=time.perf_counter() - start)
    return out


def rate(model, batch: int, before: bool) -> tuple:
    "Tokens a second of the decode steps at `batch`, and the new tokens; `before`: the rule before, 1 or 64 rows."
    ids = torch.randint(3, model.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    real, steps = decoding.rows_kernel, []
    if before:
        decoding.rows_kernel = lambda m, rows, linears=None: real(m, 1 if rows <= GEMV_ROWS else GEMM_PROBE_ROWS,
                                                                  linears)
    try: out = generate(model, ids, NEW + 1, step_times=steps, stop_ids=[])
    finally: decoding.rows_kernel = real
    return NEW * batch / sum(steps[1:]), out[:, PROMPT:].tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--out', default=str(ROOT / 'bench' / 'row_kernels.json'))
    args = parser.parse_args()
    default = args.out == parser.get_default('out')  # the command as run, less the default
    result = dict(command='python bench/row_kernels.py' + ('' if default else f' --out {args.out}'),
                  date=datetime.date.today().isoformat(), torch=torch.__version__,
                  machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count()), caches=caches(),
                  threads='1 and 2', dtype='float32', prompt_tokens=PROMPT, new_tokens=NEW, rounds=args.rounds,
                  shapes={})
    threads_before = torch.get_num_threads()
    for name, config in SHAPES.items():
        model = ours_of(hf_model(config)).eval()
        shape = result['shapes'][name] = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            at = shape[str(threads)] = dict(choices=choices(model), decode={})
            print(name, threads, 'thread(s):', {r: c['kernel'] for r, c in at['choices'].items()}, flush=True)
            for batch in BATCHES:
                runs, tokens = {'by rows': [], 'before': []}, {}
                for r in range(args.rounds):
                    for way in (('by rows', 'before') if r % 2 == 0 else ('before', 'by rows')):
                        tok_s, tokens[way] = rate(model, batch, way == 'before')
                        runs[way].append(tok_s)
                med = {way: statistics.median(v) for way, v in runs.items()}
                at['decode'][str(batch)] = dict(tok_s=med, ratio=med['by rows'] / med['before'], runs=runs,
                                                tokens_equal=tokens['by rows'] == tokens['before'])
                print(f"  batch {batch}: {med['by rows']:.1f} tok/s by rows, {med['before']:.1f} before "
                      f"({med['by rows'] / med['before']:.2f}x)", flush=True)
    torch.set_num_threads(threads_before)
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    print('wrote', args.out)


if __name__ == '__main__':
    main()
