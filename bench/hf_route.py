"""transformers' models with the package's attention (`attn_implementation="selfattn_nbdev"`, page 17): every family
proved against eager attention, and prefill timed beside transformers' `sdpa`.

    python bench/hf_route.py [--rounds 10] [--families-only] [--out bench/hf_route.json]

Families: for each model type of FAMILIES, a random model of transformers built from its configuration, small (width
64, 2 to 4 blocks, 4 query heads of 16 and 2 key/value heads, windows of 8 tokens where the family has them, Llama 4's
chunks of 8, routed experts where it has them), in float32, and a batch of two rows of 24 tokens whose second row
has 7 pads on the left (`padded_batch`). `prove` runs the model with eager attention and with selfattn_nbdev:
- logits: the largest difference over the real tokens, over the largest logit there (relative);
- gradients: of one training step (cross entropy of the real tokens' next real token), for each parameter the largest
  difference over its largest gradient, the worst parameter (relative);
- same_tokens: 16 greedy tokens of `generate` from the padded batch and its attention_mask, equal.
`native` loads the families `from_hf` builds into the package's own models and compares one row of 24 tokens with
eager; `refusal` records why selfattn_nbdev refuses an encoder-decoder and an encoder.
tests/test_hf_route.py imports FAMILIES, `prove`, `native` and `refusal` from here and asserts the bounds.

Speed: prefill of a LlamaForCausalLM of width 512 (4 blocks, 8 heads of 64, a vocabulary of 4,096) over 2,048 tokens,
on the CPU in float32 with 2 threads and no gradients: batch 1 without padding, and batch 2 whose second row is half
padding on the left (25 % of the batch). `sdpa` and `selfattn_nbdev` take turns on the same model after a warm-up; the
ratio is the median over the rounds of ours over sdpa's in the same round (below 1: the package is faster), which
holds when the machine's speed drifts (on a machine shared with other jobs a pass's wall time varies by 2x and more);
the same ratio of the process's CPU time (both threads), which other jobs do not inflate, is kept beside it, with the
best wall time of each and every round's times. Last, one attention call without padding (batch 1, 8 heads of 64,
2,048 tokens), the package's hf_mask and hf_attention against transformers' sdpa_attention_forward, 30 rounds: what
the route itself costs where both run the same kernel. Printed and saved, never asserted.
"""
import argparse, datetime, json, os, shlex, statistics, sys, tempfile, time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
from transformers.utils import logging as hf_logging

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.hf import register  # noqa: E402
from selfattn_nbdev.pretrained import from_hf  # noqa: E402
from bench.benchmark import cpu_model  # noqa: E402

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
              eos_token_id=None)
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILIES = {  # model_type: what its small configuration sets beside COMMON
    'gpt2': dict(n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    'llama': {},
    'mistral': dict(sliding_window=8),
    'qwen2': dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    'qwen3': dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    'qwen3_moe': dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    'mixtral': dict(EXPERTS, sliding_window=8),
    'gpt_oss': dict(EXPERTS, sliding_window=8),  # sinks; windows in every other block
    'gemma2': dict(sliding_window=8, query_pre_attn_scalar=64, attn_logit_softcapping=2.0),  # scale 1/8, caps
    'gemma3_text': dict(sliding_window=8, layer_types=['sliding_attention', 'full_attention'],
                        query_pre_attn_scalar=64),
    'gemma4_text': dict(sliding_window=8, layer_types=['sliding_attention', 'full_attention'],
                        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=16),
    'llama4_text': dict(attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=96, num_hidden_layers=4),
    'olmo3': dict(sliding_window=8, num_hidden_layers=4),  # 3 windowed blocks, then a full one
    'smollm3': {},  # RoPE in 3 blocks of 4: none in the last
    'phi3': dict(sliding_window=8),
    # DeepSeek-V3 as published: dense first block, then routed and shared experts; MLA with values of another width
    'deepseek_v3': dict(num_key_value_heads=4, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                        topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12),
}
REFUSED = {  # model_type: the class that loads it, and its small configuration
    't5': (AutoModelForSeq2SeqLM, dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=1, num_heads=4)),
    'bert': (AutoModelForMaskedLM, dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=96)),
}


def tiny(model_type: str, attn: str = 'eager'):
    "A random float32 model of the family, in eval mode, seeded: the same weights every time."
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type]})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float().eval()


def padded_batch(T: int = 24, pads: int = 7) -> tuple:
    "Token ids (2, T) and their attention_mask: the second row starts with `pads` pads."
    ids = torch.randint(3, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, T, dtype=torch.long)
    attention_mask[1, :pads], ids[1, :pads] = 0, 0
    return ids, attention_mask


def training_step(model, ids, attention_mask) -> tuple:
    "Logits, and every parameter's gradient of the cross entropy of each real token's next real token."
    model.zero_grad()
    logits = model(ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    pairs = real[:, 1:] & real[:, :-1]                  # a real token and the real one after it
    F.cross_entropy(logits[:, :-1][pairs], ids[:, 1:][pairs]).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def relative(a, b) -> float:
    "Largest |a - b| over the largest |b|."
    return ((a - b).abs().max() / b.abs().max()).item()


def prove(model_type: str, implementation: str = 'selfattn_nbdev') -> dict:
    "Logits, gradients and 16 greedy tokens of `implementation` against eager attention, on the padded batch."
    register()
    model, (ids, attention_mask) = tiny(model_type), padded_batch()
    real = attention_mask.bool()
    model.train()  # attention dropout is 0 in every configuration: train mode changes nothing else here
    eager_logits, eager_grads = training_step(model, ids, attention_mask)
    model.set_attn_implementation(implementation)
    logits, grads = training_step(model, ids, attention_mask)
    if grads.keys() != eager_grads.keys():
        raise AssertionError(f'{model_type}: parameters with a gradient differ: {grads.keys() ^ eager_grads.keys()}')
    model.eval()
    tokens = {}
    for name in ('eager', implementation):
        model.set_attn_implementation(name)
        tokens[name] = model.generate(ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16)
    return dict(logits=relative(logits[real], eager_logits[real]),
                gradients=max(relative(grads[n], g) for n, g in eager_grads.items()),
                same_tokens=torch.equal(tokens['eager'], tokens[implementation]),
                new_tokens=tokens['eager'].shape[1] - ids.shape[1])


def native(model_type: str) -> float | str:
    "The family loaded by from_hf from a saved checkpoint: its logits against eager on one row; or why it refuses."
    model = tiny(model_type)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        try: ours = from_hf(folder)
        except ValueError as e: return "refused: " + str(e).split(": ", 1)[-1].split(". ")[0]  # the reason
        ids = padded_batch()[0][:1]
        with torch.no_grad(): return relative(ours(ids), model(ids).logits)


def refusal(model_type: str) -> str:
    "The message with which selfattn_nbdev refuses a model of REFUSED on its first call."
    register()
    auto, cfg = REFUSED[model_type]
    torch.manual_seed(0)
    model = auto.from_config(AutoConfig.for_model(model_type, **cfg), attn_implementation='selfattn_nbdev').eval()
    ids, attention_mask = padded_batch(8, 2)
    extra = dict(decoder_input_ids=ids) if auto is AutoModelForSeq2SeqLM else {}
    try:
        with torch.no_grad(): model(ids, attention_mask=attention_mask, **extra)
    except ValueError as e: return str(e)
    return ''


def speed(rounds: int) -> dict:
    "Prefill over 2,048 tokens of a Llama of width 512 with sdpa and with selfattn_nbdev, taking turns."
    register()
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    T, gen = 2048, torch.Generator().manual_seed(1)
    one, two = torch.randint(1, 4096, (1, T), generator=gen), torch.randint(1, 4096, (2, T), generator=gen)
    half_padded = torch.ones(2, T, dtype=torch.long)
    half_padded[1, :T // 2] = 0
    cases = {'plain': ('batch 1, no padding', one, None),
             'padded': ('batch 2, 25 % left padding', two, half_padded)}
    result = dict(config=dict(d_model=512, num_layers=4, num_heads=8, num_kv_heads=8, vocab_size=4096, tokens=T,
                              rounds=rounds), cases={})
    for key, (what, ids, attention_mask) in cases.items():
        wall, cpu, logits = {'sdpa': [], 'selfattn_nbdev': []}, {'sdpa': [], 'selfattn_nbdev': []}, {}
        with torch.no_grad():
            for r in range(rounds + 1):                     # the first round warms up
                for name in sorted(wall, reverse=r % 2 == 1):  # each first in turn
                    model.set_attn_implementation(name)
                    start, start_cpu = time.perf_counter(), time.process_time()
                    logits[name] = model(ids, attention_mask=attention_mask).logits
                    wall[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
        real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        paired = lambda t: statistics.median(o / s for o, s in zip(t['selfattn_nbdev'][1:], t['sdpa'][1:]))
        sdpa_s, ours_s, ratio = min(wall['sdpa'][1:]), min(wall['selfattn_nbdev'][1:]), paired(wall)
        result['cases'][key] = dict(what=what, sdpa_s=sdpa_s, ours_s=ours_s, ratio=ratio, cpu_ratio=paired(cpu),
                                    logits=relative(logits['selfattn_nbdev'][real], logits['sdpa'][real]),
                                    sdpa_rounds_s=wall['sdpa'][1:], ours_rounds_s=wall['selfattn_nbdev'][1:],
                                    sdpa_rounds_cpu_s=cpu['sdpa'][1:], ours_rounds_cpu_s=cpu['selfattn_nbdev'][1:])
        print(f"{what}: best of {rounds}: sdpa {sdpa_s * 1e3:,.0f} ms, selfattn_nbdev {ours_s * 1e3:,.0f} ms; "
              f"ours / sdpa's in the same round, the median: {ratio:.2f}x (CPU time {paired(cpu):.2f}x)",
              flush=True)
    result['cases']['call'] = attention_call(model.model.layers[0].self_attn, 3 * rounds)
    return result


def attention_call(module, rounds: int) -> dict:
    "One attention call without padding (1, 8 heads, 2,048 tokens, 64): hf_mask and hf_attention against sdpa's."
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import causal_mask_function
    from selfattn_nbdev.hf import hf_attention, hf_mask
    q, k, v = torch.randn(3, 1, 8, 2048, 64, generator=torch.Generator().manual_seed(2))
    calls = {'sdpa': lambda: sdpa_attention_forward(module, q, k, v, None, scaling=0.125)[0],
             'selfattn_nbdev': lambda: hf_attention(module, q, k, v, hf_mask(1, 2048, 2048, mask_function=(
                 causal_mask_function)), scaling=0.125, position_ids=None)[0]}
    wall, cpu, out = {n: [] for n in calls}, {n: [] for n in calls}, {}
    with torch.no_grad():
        for r in range(rounds + 1):
            for name in sorted(calls, reverse=r % 2 == 1):
                start, start_cpu = time.perf_counter(), time.process_time()
                out[name] = calls[name]()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    paired = lambda t: statistics.median(o / s for o, s in zip(t['selfattn_nbdev'][1:], t['sdpa'][1:]))
    r = dict(what='one attention call, no padding', sdpa_s=min(wall['sdpa'][1:]),
             ours_s=min(wall['selfattn_nbdev'][1:]), ratio=paired(wall), cpu_ratio=paired(cpu),
             same_output=torch.equal(out['sdpa'], out['selfattn_nbdev']))
    print(f"{r['what']}: {r['ratio']:.2f}x (CPU time {r['cpu_ratio']:.2f}x), the same output: {r['same_output']}")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--rounds', type=int, default=10)
    ap.add_argument('--families-only', action='store_true', help='the proofs, no timing (seconds)')
    ap.add_argument('--out', default=str(ROOT / 'bench' / 'hf_route.json'))
    a = ap.parse_args()
    hf_logging.set_verbosity_error(); hf_logging.disable_progress_bar()
    torch.set_num_threads(2)
    result = dict(machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count()), torch=torch.__version__,
                  transformers=transformers.__version__, threads=torch.get_num_threads(), device='cpu',
                  dtype='float32', date=datetime.date.today().isoformat(),
                  command=shlex.join(['python', 'bench/hf_route.py'] + sys.argv[1:]),
                  load_average_at_start=os.getloadavg()[0], families={}, native={}, refused={})
    for kind in FAMILIES:
        result['families'][kind] = r = prove(kind)
        print(f"{kind:<12} logits {r['logits']:.1e}  gradients {r['gradients']:.1e}  "
              f"same {r['new_tokens']} tokens: {r['same_tokens']}", flush=True)
    for kind in ('gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3_text', 'gemma4_text',
                 'deepseek_v3'):
        result['native'][kind] = native(kind)
    for kind in REFUSED:
        result['refused'][kind] = refusal(kind)
    if not a.families_only:
        result['speed'] = speed(a.rounds)
    elif Path(a.out).exists():  # keep the timing measured before, and say so
        before = json.loads(Path(a.out).read_text())
        result['speed'] = before.get('speed')
        result['command'] = f"{before['command'].split(', then')[0]}, then {result['command']} (the speed kept)"
    Path(a.out).write_text(json.dumps(result, indent=1) + '\n')
    print(f'wrote {a.out}')


if __name__ == '__main__':
    main()
