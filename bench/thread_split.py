"""Benchmark: how a decode step's weight products share two threads, measured apart from everything else.

    python bench/thread_split.py [--llamacpp-python PATH] [--out bench/thread_split.json]    # about 10 minutes

The question: at two threads, does it matter that Inductor's loops give each thread an even, fixed share of each
product's rows (`#pragma omp for`), where llama.cpp's threads take small pieces as they finish? bench/thread_split.c
runs the weight products of one step of a shape (cpu_decode.py's SHAPES, each nn.Linear of the package's model as
`generate` reads it: q, k and v one product, gate and up one) and nothing else, in one OpenMP region as Inductor writes
a graph, the rows shared three ways: `even` (as Inductor shares them), `dynamic` (pieces of 16 rows taken as threads
finish) and `guided` (pieces that shrink). At each thread count (1 and 2 unless `--threads`), in each round, in turns:
torch's sum over 1 GiB of 2 MiB pages (the read rate, as cpu_decode.py measures it), the three loops, the package's
compiled decode step (`generate(compile=True)`, 32-token prompt, 64 new tokens), and llama.cpp (skipped without
`--llamacpp-python`). tok/s of the loops is one over the median pass over every product. After the rounds of a thread
count, `profile_compiled`: the compiled step under torch's profiler, its milliseconds by kind (cpu_decode.py's
`profile_compiled_step`: the graph, which holds the products, against the guards, the runtime and Python around it).
Needs gcc with OpenMP. Printed and written; nothing is asserted.
"""
import argparse, datetime, json, os, platform, shlex, statistics, subprocess, sys, tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
import cpu_decode as cd  # noqa: E402
from selfattn_nbdev import decoding  # noqa: E402

SCHEDULES = ('even', 'dynamic', 'guided')


def products(model) -> list:
    "'ROWSxCOLS*COUNT' of every weight product of one decode step: `_step_weights`, as `generate` stacks them."
    shapes = {}
    with decoding.stacked(model):  # q, k, v one matrix; gate and up one
        weights, _ = decoding._step_weights(decoding._linears(model), 2**62)  # all of them
        for w in weights:
            key = f'{w.shape[0]}x{w.shape[1]}'
            shapes[key] = shapes.get(key, 0) + 1
    return [f'{k}*{n}' for k, n in shapes.items()]


def build(folder) -> str:
    "bench/thread_split.c compiled with gcc, -O3 for this CPU, OpenMP."
    binary = os.path.join(folder, 'thread_split')
    subprocess.run(['gcc', '-O3', '-march=native', '-fopenmp', str(ROOT / 'bench' / 'thread_split.c'), '-o', binary],
                   check=True)
    return binary


def loop_rate(binary, schedule, threads, shapes, reps=20) -> float:
    "Tokens a second of the products alone: one over the median of `reps` passes over every product."
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND='false')
    out = subprocess.run([binary, schedule, str(reps), *shapes], capture_output=True, text=True, check=True, env=env)
    return 1.0 / float(out.stdout.strip())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--llamacpp-python', help="a Python with llama-cpp-python and gguf; else llama.cpp is skipped")
    parser.add_argument('--shape', default='gpt2', choices=sorted(cd.SHAPES))
    parser.add_argument('--threads', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--rounds', type=int, default=6, help='rounds at each thread count')
    parser.add_argument('--out', default=str(ROOT / 'bench' / 'thread_split.json'))
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix='thread_split_')
    cd.quiet_transformers()
    binary = build(scratch.name)
    hf = cd.hf_model(cd.SHAPES[args.shape]); model = cd.ours_of(hf); del hf
    read, shapes = cd.bytes_a_token(model), products(model)
    gguf = None
    if args.llamacpp_python:
        gguf = os.path.join(scratch.name, f'{args.shape}.gguf')
        subprocess.run([args.llamacpp_python, str(ROOT / 'bench' / 'llamacpp_child.py'), 'write', args.shape, gguf],
                       check=True, capture_output=True)
    ids = torch.randint(3, cd.SHAPES[args.shape]['vocab_size'], (1, cd.PROMPT))
    pages = decoding.huge_page_buffer(2**30).view(torch.float32).fill_(1.0)
    systems = [*SCHEDULES, 'package compiled'] + (['llama.cpp'] if gguf else [])
    by_threads = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        cd.ours_rate(model, ids, 8, compile=True)  # compiled once a thread count, before its rounds
        kernel = decoding.compiled_gemv_kernel(model)  # the one-row products it chose (kept: no new probe)
        rounds = []
        for r in range(args.rounds):
            got = {'read rate (GB/s)': cd.round_read_rate(pages) / 1e9}
            for name in systems[r % len(systems):] + systems[:r % len(systems)]:  # each first in turn
                if name in SCHEDULES: got[name] = loop_rate(binary, name, threads, shapes)
                elif name == 'llama.cpp': got[name] = cd.llamacpp_rate(args.llamacpp_python, gguf, threads)
                else: got[name] = cd.ours_rate(model, ids, cd.NEW, compile=True)[0]
            got['limit tok/s'] = got['read rate (GB/s)'] * 1e9 / read
            rounds.append(got)
            print(threads, r, {k: round(v, 1) for k, v in got.items()}, flush=True)
        profile = cd.profile_compiled_step(model)  # the compiled step's ms by kind, after the rounds
        print(threads, 'profile', {k: round(v, 2) for k, v in profile['ms'].items()}, flush=True)
        median = lambda k: statistics.median(g[k] for g in rounds)
        by_threads[str(threads)] = dict(
            compiled_gemv_kernel=kernel, rounds=rounds, profile_compiled=profile,
            median_tok_s={k: median(k) for k in systems},
            median_read_rate_gb_s=median('read rate (GB/s)'),
            of_even_each_round={k: [g[k] / g['even'] for g in rounds] for k in systems if k != 'even'},
            fraction_of_limit_each_round={k: [g[k] / g['limit tok/s'] for g in rounds] for k in systems})
    result = dict(
        command='python bench/thread_split.py' + (' ' + shlex.join(sys.argv[1:]) if sys.argv[1:] else ''),
        date=datetime.date.today().isoformat(), torch=torch.__version__,
        machine=dict(cpu_model=next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo')
                                     if l.startswith('model name')), platform.processor()),
                     cpu_count=os.cpu_count()),
        compiler=subprocess.run(['gcc', '--version'], capture_output=True, text=True).stdout.splitlines()[0],
        shape=args.shape, dtype='float32', bytes_a_token=read, products=shapes, prompt_tokens=cd.PROMPT,
        new_tokens=cd.NEW, llamacpp='skipped: no --llamacpp-python' if not gguf else 'measured',
        threads=' and '.join(map(str, args.threads)), by_threads=by_threads)
    print(json.dumps({t: v['median_tok_s'] for t, v in by_threads.items()}, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
