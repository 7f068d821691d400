"""Benchmark: the tiny GPT of the generation page with grouped-query heads, a sliding window and RoPE.

    python bench/modern.py            # writes bench/modern.json

For each variant of `TinyGPT` (the page's configuration: d_model 64, 4 heads, 2 blocks, context 512):
- trained on the Zen of Python on the same budget as the generation page (300 AdamW steps of 32 windows of
  64 characters, seed 0, same data order); recorded: the loss at every step and its mean over the last 50;
- parameters, and KV-cache bytes per token (keys + values, every block, float32);
- the time to write 400 tokens greedily with the KV cache after a 12-character prompt, the variants taking
  turns within each of 5 rounds; the median per variant and its ratio to the baseline's median.
Then one MultiHeadAttention layer (d 64, 4 heads) generates 4,000 tokens with and without window=64, and the
cache's length and storage are recorded every 100 tokens. Printed and saved, never asserted.
"""
import argparse, datetime, json, os, platform, shlex, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev import KVCache, MultiHeadAttention  # noqa: E402
from selfattn_nbdev.generation import CharTokenizer, TinyGPT, train_tiny_gpt, zen_of_python  # noqa: E402
from selfattn_nbdev.decoding import generate  # noqa: E402

VARIANTS = {'baseline': {}, 'GQA, 2 kv heads': dict(num_kv_heads=2), 'window 16': dict(window=16),
            'RoPE': dict(rope=True),
            'all three': dict(num_kv_heads=2, window=16, rope=True)}
CONFIG = dict(context_length=512, d_model=64, num_heads=4, num_layers=2)


def cache_bytes_per_token(model: TinyGPT) -> int:
    "Keys and values of one token, over every block, in the model's dtype."
    per_block = [2 * b.attn.num_kv_heads * b.attn.head_dim for b in model.blocks]
    return sum(per_block) * next(model.parameters()).element_size()


def main(out: Path) -> dict:
    text = zen_of_python()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    prompt = tokenizer.encode('Beautiful is')[None]
    models, result = {}, {'config': CONFIG, 'torch': torch.__version__, 'threads': torch.get_num_threads(),
                          'machine': platform.machine(), 'load_average_at_start': os.getloadavg()[0],
                          'variants': {}}
    for name, options in VARIANTS.items():
        torch.manual_seed(0)
        model = TinyGPT(len(tokenizer), **CONFIG, **options)
        start = time.perf_counter()
        losses = train_tiny_gpt(model, data)
        seconds = time.perf_counter() - start
        models[name] = model.eval()
        result['variants'][name] = {
            'options': options, 'losses': losses, 'final_loss': statistics.mean(losses[-50:]),
            'train_seconds': seconds, 'parameters': sum(p.numel() for p in model.parameters()),
            'cache_bytes_per_token': cache_bytes_per_token(model),
            'sample': tokenizer.decode(generate(model, prompt, 60)[0])}
        print(f"{name:<16} loss {result['variants'][name]['final_loss']:.3f} (last 50 steps)  "
              f"{result['variants'][name]['parameters']:,} parameters  "
              f"{result['variants'][name]['cache_bytes_per_token']} cache bytes/token  trained in {seconds:.1f} s")
    times = {name: [] for name in VARIANTS}
    with torch.no_grad():
        for name, model in models.items(): generate(model, prompt, 20)            # warm-up
        for _ in range(5):
            for name, model in models.items():
                start = time.perf_counter()
                generate(model, prompt, 400)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times['baseline'])
    for name in VARIANTS:
        v = result['variants'][name]
        v['generate_400_seconds'] = statistics.median(times[name])
        v['generate_ratio_to_baseline'] = v['generate_400_seconds'] / base
        print(f"{name:<16} 400 tokens in {v['generate_400_seconds']:.3f} s ({v['generate_ratio_to_baseline']:.2f}x baseline)")

    torch.manual_seed(0)
    track = {}
    for window in [None, 64]:
        layer = MultiHeadAttention(64, 64, 4096, num_heads=4, window=window).eval()
        cache, lengths, storage = KVCache(), [], []
        with torch.no_grad():
            for t in range(1, 4001):
                layer(torch.randn(1, 1, 64), cache=cache)
                if t % 100 == 0:
                    lengths.append(len(cache)); storage.append(cache._keys.shape[2])
        track['none' if window is None else str(window)] = {'tokens': list(range(100, 4001, 100)),
                                                            'cached': lengths, 'storage': storage}
    result['long_generation'] = track
    result.update({'date': datetime.date.today().isoformat(),
                   'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])})
    print(f"after 4,000 tokens: {track['none']['cached'][-1]} cached without a window "
          f"(storage {track['none']['storage'][-1]}), {track['64']['cached'][-1]} with window=64 "
          f"(storage {track['64']['storage'][-1]}, the most at any point: {max(track['64']['storage'])})")
    out.write_text(json.dumps(result, indent=1) + '\n')
    return result


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', type=Path, default=Path(__file__).with_name('modern.json'))
    main(ap.parse_args().out)
