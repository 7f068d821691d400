"""Benchmark: `generate`'s default on a CPU (`compile='auto'`) beside `compile=False` and `compile=True`, over a run
of calls as a user's session makes them.

    python bench/auto_compile.py [--calls 30] [--out bench/auto_compile.json]    # about 15 minutes

For each shape of bench/cpu_decode.py (GPT-2 small, the 200 M Llama shape), float32, one thread: `--calls` calls of
`generate`, each a 32-token prompt and 64 greedy new tokens, with each setting in a process of its own and an empty
Inductor cache (a new TORCHINDUCTOR_CACHE_DIR), so that a compile costs what it costs on a first run; the two
settings that compile run again in a new process on the cache the first filled (`..., a later run`), as a user's
next session would. Recorded for every call: its wall seconds (the prompt's step and any compile included) and whether its steps ended compiled; per
setting, the seconds of all the calls and the call at which the step was compiled. The tokens of every setting are
compared with `compile=False`'s (`tokens_equal`). Printed and written; nothing is asserted.
"""
import argparse, json, os, subprocess, sys, tempfile, time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {'eager (compile=False)': False, 'default (compile=\'auto\')': 'auto', 'compile=True': True}
PROMPT, NEW = 32, 64


def child(shape: str, setting: str, calls: int) -> dict:
    "One setting's run of calls, in this process (its own Inductor cache, set by the parent)."
    sys.path.insert(0, str(ROOT))
    from bench.cpu_decode import SHAPES, hf_model, ours_of
    from selfattn_nbdev import decoding
    from selfattn_nbdev.decoding import generate
    torch.set_num_threads(1)
    model = ours_of(hf_model(SHAPES[shape]))
    ids = torch.randint(0, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    seconds, compiled, tokens = [], [], None
    for _ in range(calls):
        start = time.perf_counter()
        out = generate(model, ids, NEW, stop_ids=[], compile=SETTINGS[setting])
        seconds.append(time.perf_counter() - start)
        graph = (torch.get_num_threads(), len(ids), False)  # threads, rows, padded: its graph
        compiled.append(graph in model.__dict__.get('_step_compiled_at', ()))
        tokens = out[0, PROMPT:].tolist() if tokens is None else tokens
    return dict(seconds=seconds, compiled=compiled, tokens=tokens, total_s=sum(seconds),
                compiled_at_call=next((i + 1 for i, c in enumerate(compiled) if c), None),
                threshold_s=decoding.COMPILE_AFTER_SECONDS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--calls', type=int, default=30)
    parser.add_argument('--out', default=str(ROOT / 'bench' / 'auto_compile.json'))
    parser.add_argument('--child', nargs=2, metavar=('SHAPE', 'SETTING'), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.calls))); return
    sys.path.insert(0, str(ROOT))
    import transformers
    from bench.benchmark import provenance
    from bench.cpu_decode import SHAPES
    result = dict(provenance(__file__), transformers=transformers.__version__, threads=1, dtype='float32',
                  prompt_tokens=PROMPT, new_tokens=NEW, calls=args.calls, shapes={})
    for shape in SHAPES:
        runs = {}
        for setting in SETTINGS:
            with tempfile.TemporaryDirectory(prefix='auto_compile_') as cache:
                # a compiling setting runs twice on one cache: a user's first run, then a later one
                for name in ([setting] if SETTINGS[setting] is False else [setting, setting + ', a later run']):
                    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS='1')
                    got = subprocess.run([sys.executable, __file__, '--calls', str(args.calls), '--child', shape,
                                          setting], env=env, capture_output=True, text=True, cwd=ROOT)
                    if got.returncode: raise RuntimeError(got.stderr[-3000:])
                    runs[name] = json.loads(got.stdout.strip().splitlines()[-1])
                    print(shape, name, f"{runs[name]['total_s']:.1f} s, compiled at call "
                          f"{runs[name]['compiled_at_call']}", flush=True)
        reference = runs['eager (compile=False)']['tokens']
        for run in runs.values(): run['tokens_equal'] = run.pop('tokens') == reference
        result['shapes'][shape] = runs
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    print('wrote', args.out)


if __name__ == '__main__':
    main()
