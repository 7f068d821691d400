"""Prefill and decode of every family `from_hf` loads, beside transformers on the same weights, on the CPU.

    python bench/families.py [--small] [--rounds 5] [--out bench/families.json]
    python bench/families.py --device cuda --dtype bfloat16 --out bench/families_gpu.json   # on a GPU

For each family (GPT-2, Llama with llama3 RoPE, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, DeepSeek-V3 with
its latent attention and dense layers) a random model of
transformers with 4 blocks of width 512 (8 query heads of 64, 2 key/value heads where the family has them, a vocabulary
of 4,096) is saved with `save_pretrained` and loaded with `from_hf`. Then, batch 1, in float32, without gradients:

- prefill: one forward pass over 512 tokens;
- decode: 128 new tokens written greedily after a 32-token prompt, each with its own KV cache (the package's `generate`
  with `KVCache`, transformers' `generate` with its default cache).

The two take turns within each round after a warm-up; the ratio is transformers' median time over the package's (above
1: the package is faster). Also recorded: the largest logit difference over the largest logit, and whether the 128
tokens are the same. Printed and saved, never asserted. On a GPU (`--device cuda`, in `--dtype bfloat16`) every time
is taken after `torch.cuda.synchronize()`, the device's name is recorded, and a family that fails is recorded with its
error rather than stopping the others; in half precision the tokens may legitimately part after a near tie.
"""
import argparse, datetime, json, os, shlex, statistics, sys, tempfile, time
from pathlib import Path

import torch
import transformers
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config,
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
try: from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
except ImportError: DeepseekV3Config = DeepseekV3ForCausalLM = None  # recorded as a failed family
from transformers.utils import logging as hf_logging

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.decoding import generate  # noqa: E402
from selfattn_nbdev.pretrained import from_hf  # noqa: E402
from bench.benchmark import cpu_model  # noqa: E402


def families(d: int, layers: int, vocab: int, context: int) -> dict:
    "name: a function that builds transformers' random model of that family."
    heads, kv, hd = d // 64, 2, 64
    common = dict(vocab_size=vocab, hidden_size=d, intermediate_size=int(2.75 * d), num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=context,
                  initializer_range=0.02, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    llama3 = dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=context // 4)
    gemma3_rope = {'sliding_attention': dict(rope_type='default', rope_theta=1e4),
                   'full_attention': dict(rope_type='default', rope_theta=1e6)}
    return {
        'GPT-2': lambda: GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=context, n_embd=d, n_layer=layers,
                                                    n_head=heads, bos_token_id=None, eos_token_id=None)),
        'Llama 3.1 (llama3 RoPE)': lambda: LlamaForCausalLM(LlamaConfig(**common, rope_parameters=llama3)),
        'Mistral (window 256)': lambda: MistralForCausalLM(MistralConfig(**common, sliding_window=256, head_dim=hd)),
        'Qwen2 (q/k/v biases)': lambda: Qwen2ForCausalLM(Qwen2Config(**common)),
        'Qwen3 (QK-norm)': lambda: Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hd)),
        'Gemma 2 (soft-capped)': lambda: Gemma2ForCausalLM(Gemma2Config(**common, head_dim=hd, sliding_window=256,
                                                                         query_pre_attn_scalar=hd)),
        'Gemma 3 (5 local : 1 global)': lambda: Gemma3ForCausalLM(Gemma3TextConfig(
            **common | dict(num_hidden_layers=max(layers, 6)), head_dim=hd, sliding_window=256,
            query_pre_attn_scalar=hd, rope_parameters=gemma3_rope)),
        # DeepSeek-V3's proportions (kv_lora_rank = 4 head widths, q_lora_rank = 3/2 of it, RoPE part of 32), dense
        'DeepSeek-V3 (MLA)': lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
            **common | dict(num_key_value_heads=heads), kv_lora_rank=4 * hd, q_lora_rank=6 * hd,
            qk_rope_head_dim=hd // 2, qk_nope_head_dim=hd, v_head_dim=hd, first_k_dense_replace=layers)),
    }


def timed(fn, device: str) -> tuple:
    "fn's result and its seconds, the device's queue drained before and after."
    sync = torch.cuda.synchronize if device.startswith('cuda') else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def measure(make, tokens, prompt, new: int, rounds: int, device: str, dtype) -> dict:
    "One family: saved, loaded with from_hf, compared, then prefill and decode timed in turns."
    torch.manual_seed(0)
    theirs = make().eval()
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = from_hf(folder, dtype=dtype, device=device)
    theirs = theirs.to(device=device, dtype=dtype)
    with torch.no_grad():
        a_logits, b_logits = ours(tokens).float(), theirs(tokens).logits.float()
        r = dict(logits_relative_difference=((a_logits - b_logits).abs().max() / b_logits.abs().max()).item())
        runs = {'prefill': (lambda: ours(tokens), lambda: theirs(tokens)),
                'decode': (lambda: generate(ours, prompt, new),
                           lambda: theirs.generate(prompt, max_new_tokens=new, do_sample=False))}
        for kind, (mine_fn, their_fn) in runs.items():
            mine_fn(); their_fn()                                   # warm-up
            t_ours, t_theirs = [], []
            for _ in range(rounds):
                mine, t = timed(mine_fn, device); t_ours.append(t)
                ref, t = timed(their_fn, device); t_theirs.append(t)
            r[kind] = dict(ours_s=statistics.median(t_ours), transformers_s=statistics.median(t_theirs),
                           ratio=statistics.median(t_theirs) / statistics.median(t_ours))
            if kind == 'decode': r['same_tokens'] = torch.equal(mine, ref)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--small', action='store_true', help='width 128, 2 blocks, 64 tokens: checks the script')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--out', default=None)
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    hf_logging.set_verbosity_error(); hf_logging.disable_progress_bar()
    d, layers, vocab, T, prompt_len, new = (128, 2, 512, 64, 8, 16) if a.small else (512, 4, 4096, 512, 32, 128)
    rounds = 2 if a.small else a.rounds
    out = Path(a.out) if a.out else (None if a.small else ROOT/'bench'/'families.json')
    cpu = cpu_model()
    result = dict(machine=dict(cpu_model=cpu, cpu_count=os.cpu_count()), torch=torch.__version__,
                  device=torch.cuda.get_device_name() if a.device.startswith('cuda') else 'cpu', dtype=a.dtype,
                  transformers=transformers.__version__, threads=torch.get_num_threads(),
                  date=datetime.date.today().isoformat(),
                  command=shlex.join(['python', 'bench/families.py'] + sys.argv[1:]),
                  load_average_at_start=os.getloadavg()[0],
                  config=dict(d_model=d, num_layers=layers, vocab_size=vocab, prefill_tokens=T,
                              prompt_tokens=prompt_len, new_tokens=new, rounds=rounds), families={})
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (1, T), generator=gen).to(a.device)
    prompt = tokens[:, :prompt_len]
    for name, make in families(d, layers, vocab, 2 * T).items():
        try: result['families'][name] = r = measure(make, tokens, prompt, new, rounds, a.device, dtype)
        except Exception as e:   # another transformers version may lack a family: say so, go on
            result['families'][name] = dict(error=f'{type(e).__name__}: {e}'[:500])
            print(f'{name:<30} failed: {type(e).__name__}: {e}'[:300], flush=True)
            continue
        print(f"{name:<30} logits {r['logits_relative_difference']:.1e}  prefill "
              f"{r['prefill']['ours_s'] * 1e3:7.1f} ms "
              f"(transformers {r['prefill']['transformers_s'] * 1e3:7.1f}, {r['prefill']['ratio']:.2f}x)  decode "
              f"{new / r['decode']['ours_s']:6.0f} tokens/s (transformers {new / r['decode']['transformers_s']:6.0f}, "
              f"{r['decode']['ratio']:.2f}x)  same tokens {r['same_tokens']}", flush=True)
    if out:
        out.write_text(json.dumps(result, indent=1) + '\n')
        print(f'wrote {out}')


if __name__ == '__main__':
    main()
