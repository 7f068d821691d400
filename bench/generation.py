"""Benchmark: generating 1,024 tokens with and without the KV cache, on CPU.

    python bench/generation.py            # writes bench/generation.json

A `TinyGPT` (untrained: the timing does not depend on the weights) writes 1,024 tokens greedily after a
16-token prompt, once with a `KVCache` per block and once recomputing the whole prefix at every step. The two
runs must write the same tokens (the script aborts otherwise); the figure is the ratio of their total times,
measured in one run (the cached run first and last, its better time kept, so that a warm-up or a disturbance
does not favour the cache). Target: the cache at least 10x faster. Printed, never asserted.
"""
import argparse, datetime, json, platform, shlex, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev.generation import TinyGPT  # noqa: E402
from selfattn_nbdev.decoding import generate  # noqa: E402

CONFIG = dict(vocab_size=64, context_length=1040, d_model=128, num_heads=4, num_layers=4)
PROMPT, NEW_TOKENS, TARGET = 16, 1024, 10.0


def timed(model, prompt, use_cache):
    start = time.perf_counter()
    tokens = generate(model, prompt, NEW_TOKENS, use_cache=use_cache)
    return time.perf_counter() - start, tokens


def main(out: Path) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(**CONFIG).eval()
    prompt = torch.randint(0, CONFIG['vocab_size'], (1, PROMPT))
    generate(model, prompt, 32)                                  # warm-up
    cached_1, cached_tokens = timed(model, prompt, True)
    uncached, uncached_tokens = timed(model, prompt, False)
    cached_2, _ = timed(model, prompt, True)
    if not torch.equal(cached_tokens, uncached_tokens):
        sys.exit('the cached and uncached runs wrote different tokens: aborting')
    cached = min(cached_1, cached_2)
    ratio = uncached / cached
    result = {'config': CONFIG, 'prompt_tokens': PROMPT, 'new_tokens': NEW_TOKENS, 'torch': torch.__version__,
              'threads': torch.get_num_threads(), 'machine': platform.machine(),
              'seconds_with_cache': cached, 'seconds_without_cache': uncached, 'ratio': ratio,
              'same_tokens': True, 'target': TARGET, 'target_met': ratio >= TARGET,
              'date': datetime.date.today().isoformat(),
              'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])}
    print(f"generation of {NEW_TOKENS} tokens ({CONFIG['num_layers']} blocks, d_model {CONFIG['d_model']}): "
          f"{cached:.2f} s with the KV cache, {uncached:.2f} s without: {ratio:.1f}x "
          f"({'MET' if ratio >= TARGET else 'NOT MET'}: >= {TARGET:.0f}x); same tokens: yes")
    out.write_text(json.dumps(result, indent=1) + '\n')
    return result


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', type=Path, default=Path(__file__).with_name('generation.json'))
    main(ap.parse_args().out)
