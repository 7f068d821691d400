"""Benchmark: the decode loop on CPU, eager with growing caches, eager with fixed-shape caches, and compiled.

    python bench/decode.py            # writes bench/decode.json (about a minute)

A `TinyGPT` (untrained: the timing does not depend on the weights) writes 256 tokens greedily after a random
32-token prompt, for a batch of 1 and of 8 prompts, three ways: by hand with a growing `KVCache` per block
(`greedy_kv_cache`: the prompt at once, then one token per step, argmax), with `generate` (a `StaticKVCache`
per block, eager) and with `generate(compile=True)` (the decode step compiled once, fullgraph). Each is warmed
up first (the compiled one compiled afresh for each batch's shapes: its figure leaves compiling out), then
timed twice in turns, its better time kept; the three must write the same tokens (the script aborts
otherwise). Rates are new tokens per second over all rows, prefill included. Also recorded: the seconds of the
first compiled call after `torch._dynamo.reset()` (compiling included, inductor's caches on disk disabled) and
the graphs compiled during it (`torch._dynamo.utils.counters['stats']['unique_graphs']`: 1 means the 255 steps
reused one graph). Printed, never asserted; tests/test_decode_bench.py checks the layout of the JSON.
"""
import argparse, datetime, json, platform, shlex, sys, time, warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev.generation import TinyGPT  # noqa: E402
from selfattn_nbdev.decoding import generate  # noqa: E402

CONFIG = dict(vocab_size=64, context_length=320, d_model=64, num_heads=4, num_layers=2)
PROMPT, NEW_TOKENS, BATCHES, REPS = 32, 256, (1, 8), 2
RUNS = ('eager, KVCache', 'eager, StaticKVCache', 'compiled, StaticKVCache')


@torch.no_grad()
def greedy_kv_cache(model, prompt, new_tokens):
    "Greedy decoding by hand with growing `KVCache`s: the prompt at once (prefill), then one token per step."
    caches = model.new_caches()                                    # capacity None: growing caches
    logits = model(prompt, caches)[:, -1]                          # (b, vocab)
    new = []
    for i in range(new_tokens):
        new.append(logits.argmax(-1))                              # (b,)
        if i + 1 < new_tokens: logits = model(new[-1][:, None], caches)[:, -1]
    return torch.cat([prompt, torch.stack(new, 1)], dim=1)         # (b, T + new_tokens)


def runs(model, prompt, new_tokens, compile=True) -> dict:
    "name: a function of no arguments that decodes `new_tokens` after `prompt` that way (see RUNS)."
    return {'eager, KVCache': lambda: greedy_kv_cache(model, prompt, new_tokens),
            'eager, StaticKVCache': lambda: generate(model, prompt, new_tokens, static=True),
            'compiled, StaticKVCache': lambda: generate(model, prompt, new_tokens, compile=compile)}


def timed(fn) -> tuple:
    "Seconds of one call of fn, and what it returned."
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(out: Path) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(**CONFIG).eval()
    prompts = {b: torch.randint(0, CONFIG['vocab_size'], (b, PROMPT)) for b in BATCHES}
    # the first compiled call from scratch (no caches on disk either): its seconds include compiling; count
    # the graphs it compiled
    torch._dynamo.reset(); torch._dynamo.utils.counters.clear()
    warnings.filterwarnings('ignore', 'dynamo_pgo force disabled')      # what force_disable_caches means
    with torch._inductor.config.patch(force_disable_caches=True):
        compile_seconds, _ = timed(runs(model, prompts[1], NEW_TOKENS)['compiled, StaticKVCache'])
    compilations = torch._dynamo.utils.counters['stats']['unique_graphs']
    rates = {}
    for b in BATCHES:
        fns = runs(model, prompts[b], NEW_TOKENS)
        torch._dynamo.reset()                                      # a graph for this batch's shapes alone
        tokens = {name: fn() for name, fn in fns.items()}          # warm-up: compiling included
        best = dict.fromkeys(RUNS, float('inf'))
        for _ in range(REPS):                                      # in turns, so a disturbance hits all three
            for name, fn in fns.items():
                seconds, tokens[name] = timed(fn)
                best[name] = min(best[name], seconds)
        if not all(torch.equal(tokens[name], tokens[RUNS[0]]) for name in RUNS):
            sys.exit(f'batch {b}: the three runs wrote different tokens: aborting')
        rates[str(b)] = {name: b * NEW_TOKENS / best[name] for name in RUNS}
    result = {'cpu': rates, 'compile_seconds': compile_seconds, 'compilations': compilations,
              'same_tokens': True, 'config': CONFIG, 'prompt_tokens': PROMPT, 'new_tokens': NEW_TOKENS,
              'torch': torch.__version__, 'threads': torch.get_num_threads(), 'machine': platform.machine(),
              'date': datetime.date.today().isoformat(),
              'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])}
    print(f"decode of {NEW_TOKENS} tokens after {PROMPT} ({CONFIG['num_layers']} blocks, d_model "
          f"{CONFIG['d_model']}, {torch.get_num_threads()} threads): new tokens/s over all rows, "
          f"best of {REPS}")
    print(f"{'run':<26}" + ''.join(f'{"batch " + str(b):>12}' for b in BATCHES))
    for name in RUNS:
        print(f'{name:<26}' + ''.join(f'{rates[str(b)][name]:>12,.0f}' for b in BATCHES))
    print(f'first compiled call (compiling included): {compile_seconds:.1f} s, {compilations} graph(s) '
          f'compiled; same tokens: yes')
    out.write_text(json.dumps(result, indent=1) + '\n')
    return result


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', type=Path, default=Path(__file__).with_name('decode.json'))
    main(ap.parse_args().out)
