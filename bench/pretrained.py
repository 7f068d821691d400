"""Benchmark: greedy generation of GPT-2 and Llama built from the package's modules, beside transformers' `generate`.

    python bench/pretrained.py            # writes bench/pretrained.json

For each model (random weights from a transformers config: 4 blocks, width 256, 8 query heads, Llama with 2
key/value heads and rope_theta 500,000, 1,000 tokens), the package's model is loaded from the transformers model's
state dict (`gpt2_from_hf`, `llama_from_hf`); both write 256 tokens greedily after the same 16-token prompt, each
with its own KV cache, taking turns within each of 5 rounds after one warm-up each. Recorded: the median tokens/s of
each and whether their tokens are the same. CPU, torch's default thread count. Printed and saved, never asserted.
"""
import argparse, datetime, json, os, platform, shlex, statistics, sys, time
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev.generation import generate  # noqa: E402
from selfattn_nbdev.pretrained import gpt2_from_hf, llama_from_hf  # noqa: E402

VOCAB, PROMPT, NEW, ROUNDS = 1000, 16, 256, 5


def models() -> dict:
    "name: (transformers model, ours), random weights, seed 0."
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=256, n_layer=4, n_head=8,
                                      initializer_range=0.1, bos_token_id=None, eos_token_id=None)).eval()
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                         max_position_embeddings=512, rope_theta=500000.0, initializer_range=0.1,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    return {'GPT-2': (gpt2, gpt2_from_hf(gpt2.state_dict(), gpt2.config.to_dict())),
            'Llama': (llama, llama_from_hf(llama.state_dict(), llama.config.to_dict()))}


def timed(fn) -> tuple:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(out: Path) -> dict:
    hf_logging.set_verbosity_error()
    result = {'prompt_tokens': PROMPT, 'new_tokens': NEW, 'rounds': ROUNDS, 'torch': torch.__version__,
              'transformers': transformers.__version__, 'threads': torch.get_num_threads(),
              'machine': platform.machine(), 'load_average_at_start': os.getloadavg()[0], 'models': {}}
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    for name, (theirs, ours) in models().items():
        run_ours = lambda: generate(ours, prompt, NEW)
        run_theirs = lambda: theirs.generate(prompt, max_new_tokens=NEW, do_sample=False)
        run_ours(); run_theirs()  # warm-up
        times = {'ours': [], 'transformers': []}
        for _ in range(ROUNDS):
            mine, t = timed(run_ours); times['ours'].append(t)
            ref, t = timed(run_theirs); times['transformers'].append(t)
        result['models'][name] = {
            'ours_tokens_per_s': NEW / statistics.median(times['ours']),
            'transformers_tokens_per_s': NEW / statistics.median(times['transformers']),
            'seconds': times, 'same_tokens': torch.equal(mine, ref)}
        r = result['models'][name]
        print(f"{name}: ours {r['ours_tokens_per_s']:.0f} tokens/s, transformers "
              f"{r['transformers_tokens_per_s']:.0f} tokens/s, same tokens: {r['same_tokens']}")
    result.update({'date': datetime.date.today().isoformat(),
                   'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])})
    out.write_text(json.dumps(result, indent=1) + '\n')
    return result


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', type=Path, default=Path(__file__).with_name('pretrained.json'))
    main(parser.parse_args().out)
