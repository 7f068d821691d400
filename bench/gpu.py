"""On a CUDA GPU: the masks of bench/masks.py (ours vs the best kernel for each) and GPT-2's decode step.

    python bench/gpu.py            # on a CUDA GPU: batch 8, d_model 1,024, 16 heads, bfloat16; writes bench/gpu.json
                                   # (keeping the fields added there by hand: probes, code, measured, cuda_tests)
    python bench/gpu.py --small    # anywhere (CPU too): tiny sizes, float32, a smoke test (writes to --out)

Cases (causal): no padding at T = 8,192 (ours vs projections + SDPA is_causal); 22 % key padding at T = 8,192 and
2,048 (ours vs varlen flash attention on the packed tokens); window 512 at T = 8,192 and 16,384, and window 512 with
4 key/value heads at 16,384 (ours vs compiled FlexAttention); each masked case also times SDPA with the dense
mask (what the fused path did before masks were functions), and each padded one FlexAttention too (padding
also at T = 4,096: where varlen starts to pay). Every contender runs from x: the projections, the kernel and
out_proj. Times are medians of synchronized calls after a
warm-up (which includes compiling); peak memory from torch.cuda.max_memory_allocated after that warm-up; and
`max_diff`, the largest difference between ours and the best kernel at the real positions. The JSON is written
after every case, so a run cut short keeps what it measured; a case that fails is recorded with its error.

Decode (`decode`): GPT-2 small's shape (`GPT2()`, random weights, bfloat16) writes 512 tokens greedily after a
random 32-token prompt, for a batch of 1 and of 8, three ways: by hand with growing `KVCache`s
(bench/decode.py's `greedy_kv_cache`), `generate` (eager, `StaticKVCache`s) and `generate(compile=True)` (the
decode step compiled once, replayed as a CUDA graph); and, if transformers imports, its GPT-2 (random weights
of its own, the same shapes) with `generate(cache_implementation='static')`. Each is warmed up, then timed
twice in turns (torch.cuda.synchronize before and after), its better time kept. Recorded per run: new tokens/s
over all rows (prefill included), whether its tokens equal the eager KVCache run's (None for transformers:
other weights), and the fraction reached of the memory-bandwidth limit batch * bandwidth / bytes_per_step,
where a step reads the weights once (2 bytes per parameter, tied ones counted once) and the keys and values at
the mean length prompt + new / 2 (num_layers * 2 * d_model * mean_tokens * 2 bytes * batch). A `StaticKVCache`
reads all its slots at every step, more than that: the limit is an upper bound. The bandwidth comes from
BANDWIDTH by the device's name (None, and no fractions, for a device not in it). The small run decodes with a
tiny `TinyGPT` in float32 and compiles with backend='eager'.

    python bench/gpu.py --part decode   # only the decode section (--part masks: only the masks)
"""
import argparse, datetime, json, shlex, statistics, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.masks import and_masks, causal, key_padding, sliding_window
from selfattn_nbdev.kernels import flex_attend, flex_mode, varlen_attend  # noqa: E402
from selfattn_nbdev.gqa_window_rope import repeat_kv  # noqa: E402
from selfattn_nbdev.multihead import MultiHeadAttention  # noqa: E402
from selfattn_nbdev.generation import TinyGPT  # noqa: E402
from selfattn_nbdev.pretrained import GPT2  # noqa: E402
from bench.decode import runs  # noqa: E402

# memory bandwidth, bytes/s, by a part of the device's name (an H100 SXM names itself 'H100 80GB HBM3')
BANDWIDTH = {'H200': 4.8e12, 'H100 SXM': 3.35e12, 'H100 80GB HBM3': 3.35e12}
GPT2_SMALL = dict(vocab_size=50257, context_length=1024, d_model=768, num_heads=12, num_layers=12)
TINY = dict(vocab_size=64, context_length=64, d_model=32, num_heads=4, num_layers=2)   # the small run's model


def timed(fn, reps, cuda):
    "Median seconds of fn() after one warm-up call, and the peak bytes it allocated."
    fn()
    if cuda: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn()
        if cuda: torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return statistics.median(times), peak


def bandwidth_of(name: str):
    "The memory bandwidth in bytes/s of the device called `name`, from BANDWIDTH; None for one not in it."
    return next((bandwidth for part, bandwidth in BANDWIDTH.items() if part in name), None)


def decode(model, device, dtype, batch, prompt_len, new_tokens, compile=True, bandwidth=None, hf_model=None,
           reps=2) -> dict:
    """Greedy decoding of `new_tokens` after a random `prompt_len`-token prompt in each of `batch` rows.

    The runs: bench/decode.py's three (`compile` is `generate`'s option for the compiled one, e.g.
    dict(backend='eager'); False leaves that run out) and, if given, `hf_model.generate` with a static cache
    (a failure there is recorded, not raised). `model` (the package's protocol) and `hf_model` are moved to
    `device` and `dtype`. `bandwidth` (bytes/s, or None) gives each run's fraction of the memory-bandwidth
    limit (see the top). Returns the limit and, per run, tokens/s, seconds, whether its tokens are the eager
    KVCache run's, and its fraction of the limit."""
    model = model.to(device, dtype).eval()
    cuda = torch.device(device).type == 'cuda'
    seeded = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.vocab_size, (batch, prompt_len), generator=seeded).to(device)
    fns = runs(model, prompt, new_tokens, compile)
    if compile is False: del fns['compiled, StaticKVCache']
    else: torch._dynamo.reset()                         # compiled afresh for these shapes (no dynamic batch)
    if hf_model is not None:
        hf_model = hf_model.to(device, dtype).eval()
        fns['transformers, static cache'] = lambda: hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, cache_implementation='static')

    def synced(fn):
        "Seconds of one call of fn, the GPU's work included, and what it returned."
        if cuda: torch.cuda.synchronize()
        start = time.perf_counter(); out = fn()
        if cuda: torch.cuda.synchronize()
        return time.perf_counter() - start, out

    tokens, failed = {}, {}
    for name, fn in list(fns.items()):                  # warm-up: compiling, recording CUDA graphs
        try:
            tokens[name] = fn()
        except Exception as e:                          # only transformers' run may fail: recorded
            if not name.startswith('transformers'): raise
            failed[name] = {'error': f'{type(e).__name__}: {e}'[:300]}
            del fns[name]
    best = dict.fromkeys(fns, float('inf'))
    for _ in range(reps):                               # in turns, so a disturbance hits them all
        for name, fn in fns.items():
            seconds, tokens[name] = synced(fn)
            best[name] = min(best[name], seconds)
    itemsize = torch.empty((), dtype=dtype).element_size()
    num_params = sum(p.numel() for p in model.parameters())   # a tied table once
    mean_tokens = prompt_len + new_tokens / 2
    kv_bytes = len(model.blocks) * 2 * model.token_emb.embedding_dim * mean_tokens * itemsize * batch
    bytes_per_step = itemsize * num_params + kv_bytes
    limit = None if bandwidth is None else batch * bandwidth / bytes_per_step
    rows = {}
    for name in fns:
        rate = batch * new_tokens / best[name]
        same = (None if name.startswith('transformers') else          # other weights: not comparable
                torch.equal(tokens[name], tokens['eager, KVCache']))
        rows[name] = {'tokens_per_s': rate, 'seconds': best[name], 'same_tokens': same,
                      'fraction_of_limit': None if limit is None else rate / limit}
    return {'batch': batch, 'prompt_tokens': prompt_len, 'new_tokens': new_tokens, 'num_params': num_params,
            'mean_tokens': mean_tokens, 'bytes_per_step': bytes_per_step, 'limit_tokens_per_s': limit,
            'runs': {**rows, **failed}}


def decode_section(cuda, device, dtype, device_name, save=lambda result: None) -> dict:
    """GPT-2 small's shape on CUDA (a tiny `TinyGPT` on the small run): `decode` for a batch of 1 and of 8;
    `save(result)` after each batch."""
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        transformers = None
    config = GPT2_SMALL if cuda else TINY
    prompt_len, new_tokens = (32, 512) if cuda else (8, 16)
    compile = True if cuda else dict(backend='eager', fullgraph=True)
    bandwidth = bandwidth_of(device_name) if cuda else None
    result = {'model': 'GPT2(), random weights' if cuda else 'TinyGPT (small run)', 'config': config,
              'dtype': str(dtype), 'bandwidth_bytes_per_s': bandwidth,
              'transformers': transformers and transformers.__version__, 'batches': {}}
    for batch in (1, 8):
        torch.manual_seed(0)
        model = GPT2(**config) if cuda else TinyGPT(**config)
        hf_model = None if transformers is None else GPT2LMHeadModel(GPT2Config(
            vocab_size=config['vocab_size'], n_positions=config['context_length'], n_embd=config['d_model'],
            n_layer=config['num_layers'], n_head=config['num_heads'], bos_token_id=None, eos_token_id=None))
        r = decode(model, device, dtype, batch, prompt_len, new_tokens, compile, bandwidth, hf_model)
        result['batches'][str(batch)] = r
        save(result)
        limit = f"{r['limit_tokens_per_s']:,.0f} tokens/s" if bandwidth else 'unknown'
        print(f'decode, batch {batch}: {new_tokens} tokens after {prompt_len}; bandwidth limit {limit}',
              flush=True)
        for name, row in r['runs'].items():
            if 'error' in row:
                print(f"  {name:<28} failed: {row['error']}"); continue
            fraction = row['fraction_of_limit']
            fraction = '' if fraction is None else f' ({fraction:.0%} of the limit)'
            print(f"  {name:<28} {row['tokens_per_s']:>10,.0f} tokens/s{fraction}, same tokens as eager "
                  f"KVCache: {row['same_tokens']}", flush=True)
        del model, hf_model
        if cuda: torch.cuda.empty_cache()
    return result


def masks_section(cuda, device, dtype, batch, d_model, heads, save) -> list:
    """The seven cases of the top, each as a row: ours (the module's fused path), the best kernel for the mask, and
    for a masked case SDPA with the dense mask (the fused path before masks were functions); times, peak memory,
    and the largest difference between ours and the best at the real positions. A case that fails is recorded
    with its error and the next one runs. `save(rows)` is called after every row."""
    scale = 1 if cuda else 64           # T = 8,192 becomes 128 on the small run
    reps = 20 if cuda else 2
    rows = []
    cases = [('causal', 8192, None, 0.0, None), ('padding 22%', 8192, None, 0.22, None),
             ('padding 22%', 4096, None, 0.22, None), ('padding 22%', 2048, None, 0.22, None), ('window 512', 8192, 512, 0.0, None),
             ('window 512', 16384, 512, 0.0, None), ('window 512, 4 kv heads', 16384, 512, 0.0, 4)]
    for name, T, window, padded, kv_heads in cases:
        T, window = T // scale, window and max(window // scale, 2)
        try:
            rows.append({'case': name, 'T': T, **mask_case(cuda, device, dtype, batch, d_model, heads, T, window,
                                                           padded, kv_heads, reps)})
        except Exception as e:                          # recorded, and the next case runs
            rows.append({'case': name, 'T': T, 'error': f'{type(e).__name__}: {e}'[:500]})
        if cuda: torch.cuda.empty_cache()
        print(rows[-1], flush=True)
        save(rows)
    return rows


def mask_case(cuda, device, dtype, batch, d_model, heads, T, window, padded, kv_heads, reps) -> dict:
    "One case of `masks_section`: ours, the best kernel, the dense mask (masked cases), and ours - best."
    torch.manual_seed(0)
    m = MultiHeadAttention(d_model, d_model, T, num_heads=heads, window=window,
                           num_kv_heads=kv_heads).to(device, dtype).eval()
    x = torch.randn(batch, T, d_model, device=device, dtype=dtype)
    pad = (torch.arange(T, device=device) >= int(T * (1 - padded))).expand(batch, T) if padded else None
    row = {}
    with torch.no_grad(), flex_mode('compiled' if cuda else 'eager'):
        ours_fn = lambda: m(x, key_padding_mask=pad)
        row['ours_s'], row['ours_peak_bytes'] = timed(ours_fn, reps, cuda)
        def projected(attend):  # x -> the projections -> attend(q, k, v) -> out_proj, all timed
            return m.out_proj(m._merge_heads(attend(*m._project(x))))
        if padded and cuda:
            best = lambda: projected(lambda q, k, v: varlen_attend(q, k, v, pad, True))
            row['best'] = 'varlen flash attention'
        elif window:
            best = lambda: projected(lambda q, k, v: flex_attend(q, k, v, sliding_window(window), ('w', window),
                                                                 compiled=cuda))
            row['best'] = 'FlexAttention' + (' compiled' if cuda else ' (uncompiled, small run)')
        else:
            best = lambda: projected(lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, attn_mask=None if pad is None else ~pad[:, None, None, :]))
            row['best'] = 'projections + SDPA'
        row['best_s'], row['best_peak_bytes'] = timed(best, reps, cuda)
        row['ratio'] = row['ours_s'] / row['best_s']
        real = slice(None) if pad is None else ~pad                     # the real positions
        row['max_diff'] = (ours_fn()[real].float() - best()[real].float()).abs().max().item()
        if padded or window:                                            # the dense mask, as before
            allowed = m._allowed(T, T, pad)                            # (b | 1, 1, T, T)
            groups = heads // m.num_kv_heads
            dense = lambda: projected(lambda q, k, v: F.scaled_dot_product_attention(
                q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=allowed))
            row['dense_s'], row['dense_peak_bytes'] = timed(dense, reps, cuda)
        if padded:                                                      # and FlexAttention for padding
            mask_mod = and_masks(causal, key_padding(pad))
            flex = lambda: projected(lambda q, k, v: flex_attend(q, k, v, mask_mod, compiled=cuda))
            row['flex_s'], row['flex_peak_bytes'] = timed(flex, reps, cuda)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--small', action='store_true'); ap.add_argument('--out', default=str(ROOT / 'bench' / 'gpu.json'))
    ap.add_argument('--part', choices=('all', 'masks', 'decode'), default='all')
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = 'cuda' if cuda else 'cpu'
    dtype = torch.bfloat16 if cuda else torch.float32
    batch, d_model, heads = (8, 1024, 16) if cuda else (2, 64, 4)
    device_name = torch.cuda.get_device_name() if cuda else f'CPU (small sizes, {torch.get_num_threads()} threads)'
    result = {'device': device_name, 'torch': torch.__version__, 'dtype': str(dtype), 'batch': batch,
              'd_model': d_model, 'heads': heads, 'rows': [], 'decode': None,
              'date': datetime.date.today().isoformat(),
              'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])}
    kept = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    kept = {k: v for k, v in kept.items() if k not in result}  # added by hand: probes, code...
    save = lambda: Path(args.out).write_text(json.dumps({**kept, **result}, indent=1) + '\n')  # a run
    if args.part != 'decode':                                                     # cut short keeps the rest
        masks_section(cuda, device, dtype, batch, d_model, heads, lambda rows: (result.update(rows=rows), save()))
    if args.part != 'masks':
        decode_section(cuda, device, dtype, device_name, lambda part: (result.update(decode=part), save()))
    save()


if __name__ == '__main__':
    main()
