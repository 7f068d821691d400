"""The attention of this round on a CUDA GPU: the chunked gated delta rule against flash-linear-attention's kernel,
sinks through the log-sum-exp against the explicit path, and absorbed MLA decoding over a long cache.

    python bench/gpu_round.py --out gpu_round.json        # on a CUDA GPU, bfloat16 (about a minute and a half)
    python bench/gpu_round.py --small                     # anywhere (CPU too): tiny sizes, checks the script

Parts (each written to the JSON as soon as it is measured, so a run cut short keeps what it has):

- `linear`: `chunk_gated_delta_rule` (the package's, chunks of 64, in PyTorch) against flash-linear-attention's
  Triton `chunk_gated_delta_rule` (`fla.ops.gated_delta_rule`, if importable) and transformers'
  `torch_chunk_gated_delta_rule`, on a Qwen3-Next layer's heads (16 heads of 128 for q, k and v), batch 1,
  T = 4,096, bfloat16 inputs, q and k l2-normalised in the kernel; forward, and forward + backward of o.sum();
  the largest difference of each output from the package's, computed in float32.
- `sinks`: one causal `LlamaAttention` (d_model 1,024, 16 query heads and 4 key/value heads of 64, RoPE, gpt-oss's
  sinks) at T = 4,096, batch 1, bfloat16, forward + backward: the path it takes (on CUDA `sinks_by_sdpa`, SDPA with
  one more key per head; elsewhere the tiled kernel), the tiled kernel's log-sum-exp then `sink_after`, the same
  module forced onto the explicit path, and without sinks (SDPA);
  time and the peak of CUDA memory allocated above what the module and its input hold.
- `mla`: one `LatentAttention` decode step at DeepSeek-V3's per-head sizes (d_c 512, d_R 64, 16 heads of 128 + 64;
  d_model 1,024: bench/mla_decode.py's layer) over 1,024, 4,096 and 32,768 cached tokens, absorbed (through the
  latents) against rebuilding every cached key and value.
- `paged`: a decode step of the Llama-1B shape cut to 4 blocks (d_model 2,048, 32 query and 8 key/value heads of
  64), batch 8, every row at 1,024 and at 4,096 cached tokens, eager, as the serving Engine runs it: keys and
  values in a `BlockPool` of 16-token blocks read through `PagedKVCache` (each row's blocks scattered through the
  pool), against the contiguous `StaticKVCache` that `generate` uses; the logits of the two against each other,
  and the bytes of keys and values a step reads per second.

- `route`: transformers' `LlamaForCausalLM` (d_model 1,024, 4 blocks, 16 query and 4 key/value heads) at 4,096
  tokens with `attn_implementation="selfattn_nbdev"` (the mask as sdpa's tensor, the package's findings beside it)
  against `"sdpa"`, prefill, batch 1 unpadded and batch 2 with a quarter of padding; logits against eager.

Times are medians of CUDA-synchronised runs after warm-ups. Printed and written, never asserted.
"""
import argparse, datetime, json, shlex, statistics, sys, time, traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.generation import KVCache  # noqa: E402
from selfattn_nbdev.linear import chunk_gated_delta_rule  # noqa: E402
from selfattn_nbdev.deepseek_v3 import LatentAttention  # noqa: E402
from selfattn_nbdev.llama_attention import LlamaAttention  # noqa: E402
from bench.gpu_decode import run_parts  # noqa: E402


def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize(device)


def timed(fn, device, reps=10, warm=2) -> float:
    "Median seconds of `fn()` over `reps` synchronised runs, after `warm` runs."
    for _ in range(warm): fn()
    sync(device); ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); sync(device); ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def peak_above(fn, device) -> int:
    "Bytes of CUDA memory allocated at the peak of `fn()` above what was allocated before it (0 on a CPU)."
    if device.type != 'cuda': fn(); return 0
    sync(device); torch.cuda.reset_peak_memory_stats(device); before = torch.cuda.memory_allocated(device)
    fn(); sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def linear_part(device, dtype, T, result, save):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    kernels = {'ours': chunk_gated_delta_rule, 'transformers (torch)': torch_chunk_gated_delta_rule}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        import fla; kernels['flash-linear-attention (Triton)'] = fla_chunk; result['fla'] = fla.__version__
    except Exception as e: result['fla'] = f'not importable: {type(e).__name__}: {e}'[:300]
    g = torch.Generator(device='cpu').manual_seed(0)
    H, D = 16, 128
    make = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)
    q, k, v = make(1, T, H, D), make(1, T, H, D), make(1, T, H, D)
    g_log = -torch.nn.functional.softplus(make(1, T, H).float()).to(dtype)
    beta = torch.sigmoid(make(1, T, H).float()).to(dtype)
    leaves = [q, k, v, g_log, beta]
    rows, ref = {}, None
    result['linear'] = dict(T=T, batch=1, heads=H, d_k=D, d_v=D, chunk_size=64, rows=rows)
    for name, fn in kernels.items():
        r = rows[name] = {}
        try:
            call = lambda: fn(q, k, v, g_log, beta, use_qk_l2norm_in_kernel=True)[0]
            with torch.no_grad(): o = call()
            ref = o.float() if ref is None else ref
            r['max_abs_diff_vs_ours'] = (o.float() - ref).abs().max().item()
            with torch.no_grad(): r['forward_ms'] = timed(call, device) * 1e3
            save()
            def train():
                xs = [t.detach().requires_grad_() for t in leaves]
                fn(*xs, use_qk_l2norm_in_kernel=True)[0].float().sum().backward()
            r['forward_backward_ms'] = timed(train, device, reps=5) * 1e3
        except Exception as e:   # a kernel may refuse its backward (fla on Triton < 3.7.1 on Hopper)
            r['error'] = f'{type(e).__name__}: {e}'[:500]; traceback.print_exc()
        print(f"linear {name}: {r}", flush=True)
        save()
    ours = rows['ours']
    for name, r in rows.items():
        for key in ('forward_ms', 'forward_backward_ms'):
            if name != 'ours' and key in r and key in ours: r[f'ours / this, {key[:-3]}'] = ours[key] / r[key]
    save()


def sinks_part(device, dtype, T, result, save, d_model=1024, heads=16, kv_heads=4):
    rows = {}
    for case in ('sinks, the path it takes', 'sinks, through the log-sum-exp', 'sinks, explicit',
                 'no sinks (SDPA)'):
        r = rows[case] = {}
        try:
            torch.manual_seed(0)
            m = LlamaAttention(d_model, T, num_heads=heads, num_kv_heads=kv_heads,
                               sinks=not case.startswith('no')).to(device, dtype)
            if case == 'sinks, explicit': m._sinks_tiled = lambda num_tokens: False
            if case == 'sinks, through the log-sum-exp':   # the tiled kernel, not SDPA with one more key
                m._sinks_by_sdpa = lambda queries, score_mod: False
            gen = torch.Generator(device='cpu').manual_seed(1)
            x = torch.randn(1, T, d_model, generator=gen).to(device, dtype).requires_grad_()
            w = torch.randn(1, T, d_model, generator=gen).to(device, dtype)
            def step():
                m.zero_grad(set_to_none=True); x.grad = None
                out = m(x); (out.float() * w).sum().backward()
                return out
            out = step()
            r['peak_bytes_above'] = peak_above(step, device)
            r['forward_backward_ms'] = timed(step, device, reps=5) * 1e3
            rows[case + ' output'] = out.detach().float()
            print(f"sinks {case}: {r}", flush=True)
            del m
        except Exception as e:
            r['error'] = f'{type(e).__name__}: {e}'[:500]; traceback.print_exc()
    taken, a, b = (rows.pop(f'sinks, {n} output', None) for n in ('the path it takes', 'through the log-sum-exp',
                                                                     'explicit'))
    rows.pop('no sinks (SDPA) output', None)
    gap = lambda x, y: (x - y).abs().max().item() if x is not None and y is not None else None
    result['sinks'] = dict(T=T, batch=1, d_model=d_model, heads=heads, kv_heads=kv_heads, rows=rows,
                           path_taken='sinks_by_sdpa on CUDA, else the tiled kernel',
                           max_abs_diff_lse_vs_explicit=gap(a, b), max_abs_diff_taken_vs_explicit=gap(taken, b))
    save()


def mla_part(device, dtype, lengths, result, save):
    "mla_one at each cached length: absorbed against rebuilt."
    result['mla_by_length'] = {}
    for S in lengths:
        one = {}
        mla_one(device, dtype, S, one, lambda: None)
        result['mla_by_length'][str(S)] = one['mla']
        if S == max(lengths): result['mla'] = one['mla']
        save()


def mla_one(device, dtype, S, result, save):
    sizes = dict(d_model=1024, num_heads=16, kv_rank=512, rope_dim=64, nope_dim=128, v_dim=128, q_rank=384)
    torch.manual_seed(0)
    layer = LatentAttention(context_length=S + 64, **sizes).to(device, dtype).eval()
    x = torch.randn(1, 1, sizes['d_model'], device=device, dtype=dtype)
    half = torch.randn(1, 1, S, (sizes['kv_rank'] + sizes['rope_dim']) // 2, device=device, dtype=dtype)
    rows, outs = {}, {}
    for name, absorb in {'absorbed': True, 'rebuilt': False}.items():
        try:
            layer._absorbs = lambda T, S, absorb=absorb: absorb
            def step():
                cache = KVCache(); cache.append(half, half)     # the same S cached rows every call
                return layer(x, cache)
            with torch.no_grad():
                outs[name] = step().float()
                fill = timed(lambda: KVCache().append(half, half), device)
                rows[name] = dict(step_ms=(timed(step, device) - fill) * 1e3)
            print(f'mla {name}: {rows[name]}', flush=True)
        except Exception as e:
            rows[name] = dict(error=f'{type(e).__name__}: {e}'[:500]); traceback.print_exc()
    del layer._absorbs
    if len(outs) == 2: rows['absorbed / rebuilt'] = rows['absorbed']['step_ms'] / rows['rebuilt']['step_ms']
    result['mla'] = dict(cached_tokens=S, sizes=sizes, batch=1, rows=rows,
                         max_abs_diff=(outs['absorbed'] - outs['rebuilt']).abs().max().item() if len(outs) == 2
                         else None)
    save()


def paged_part(device, dtype, lengths, result, save, batch=8, blocks=4, block_size=16, steps=12):
    "A decode step on a paged cache against a contiguous one (see the top): same weights, same prompt."
    import random
    import transformers
    from selfattn_nbdev.pretrained import from_hf
    from selfattn_nbdev.serving import BlockPool, PagedKVCache, Sequence
    small = device.type != 'cuda'
    d, heads, kv_heads, ffn = (64, 4, 2, 128) if small else (2048, 32, 8, 8192)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=d, intermediate_size=ffn,
                                   num_hidden_layers=blocks, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=8192, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(cfg).eval()
    model = from_hf(theirs.state_dict(), cfg.to_dict(), dtype=dtype, device=device); del theirs
    rows = result.setdefault('paged', dict(model=f'Llama-1B width, {blocks} blocks', batch=batch,
                                           block_size=block_size, rows={}))['rows']
    for L in lengths:
        r = rows[str(L)] = {}
        try:
            gen = torch.Generator().manual_seed(L)
            prompt = torch.randint(0, 32000, (batch, L), generator=gen).to(device)
            per_row = -(-(L + steps + 4) // block_size)
            pool = BlockPool(batch * per_row + 8, block_size)
            order = list(range(pool.num_blocks)); random.Random(0).shuffle(order)
            pool.free.clear(); pool.free.extend(order)                  # each row's blocks scattered
            seqs = [Sequence(prompt[i].cpu(), steps + 4, i) for i in range(batch)]
            paged = [PagedKVCache(pool, i) for i in range(len(model.blocks))]
            def paged_step(ids):                     # what Engine._forward does, after _grow
                for s in seqs:
                    more = -(-(s.length + ids.shape[1]) // block_size) - len(s.blocks)
                    s.blocks += [pool.allocate() for _ in range(more)]
                for c in paged: c.rows = seqs
                out = model(ids, paged)
                for s in seqs: s.length += ids.shape[1]
                return out[:, -1]
            static = model.new_caches(L + steps + 4)
            static_step = lambda ids: model(ids, static)[:, -1]
            with torch.no_grad():
                ids = static_step(prompt).argmax(-1)[:, None]; paged_step(prompt)
                one = {'paged': paged_step(ids).float(), 'contiguous': static_step(ids).float()}
                big = one['contiguous'].abs().max()
                r['logits_paged_vs_contiguous'] = ((one['paged'] - one['contiguous']).abs().max() / big).item()
                for name, fn in (('paged', paged_step), ('contiguous', static_step)):
                    r[name + '_step_ms'] = timed(lambda: fn(ids), device, reps=8, warm=1) * 1e3
            r['paged / contiguous'] = r['paged_step_ms'] / r['contiguous_step_ms']
            kv = 2 * blocks * batch * kv_heads * (d // heads) * (L + 8) * torch.finfo(dtype).bits // 8
            r['kv_bytes_read'] = kv
            for name in ('paged', 'contiguous'): r[name + '_kv_bytes_per_s'] = kv / r[name + '_step_ms'] * 1e3
            print(f'paged {L}: {r}', flush=True)
        except Exception as e:
            r['error'] = f'{type(e).__name__}: {e}'[:500]; traceback.print_exc()
        if device.type == 'cuda': torch.cuda.empty_cache()
        save()


def route_part(device, dtype, T, result, save):
    "transformers' Llama with attn_implementation='selfattn_nbdev' against 'sdpa': prefill, unpadded and padded."
    import transformers
    from selfattn_nbdev.hf import register
    register(); transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=T,
                                   pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device, dtype).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32000, (2, T), generator=gen).to(device)
    padded = torch.ones(2, T, dtype=torch.long, device=device); padded[1, :T // 2] = 0
    rows = {}
    for case, (x, mask) in {'batch 1, no padding': (ids[:1], None),
                            'batch 2, 25 % left padding': (ids, padded)}.items():
        r = rows[case] = {}
        with torch.no_grad():
            logits = {}
            for name in ('sdpa', 'selfattn_nbdev', 'eager'):
                model.set_attn_implementation(name)
                run = lambda: model(x, attention_mask=mask).logits
                logits[name] = run().float()
                if name != 'eager': r[f'{name}_ms'] = timed(run, device, reps=10) * 1e3
            real = (torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool())
            big = logits['eager'][real].abs().max()
            r['ours_over_sdpa'] = r['selfattn_nbdev_ms'] / r['sdpa_ms']
            r['logits_vs_eager'] = ((logits['selfattn_nbdev'] - logits['eager'])[real].abs().max() / big).item()
            r['sdpa_logits_vs_eager'] = ((logits['sdpa'] - logits['eager'])[real].abs().max() / big).item()
        print(f'route {case}: {r}', flush=True)
    result['route'] = dict(T=T, d_model=1024, layers=4, heads=16, kv_heads=4, rows=rows)
    save()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--small', action='store_true')
    ap.add_argument('--out', default=None)
    ap.add_argument('--part', default='linear,sinks,mla')
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.small
    device = torch.device('cuda' if cuda else 'cpu')
    dtype = torch.bfloat16 if cuda else torch.float32
    result = dict(device=torch.cuda.get_device_name() if cuda else 'cpu', dtype=str(dtype).replace('torch.', ''),
                  torch=torch.__version__, date=datetime.date.today().isoformat(),
                  command=shlex.join(['python', 'bench/gpu_round.py'] + sys.argv[1:]))
    try:
        import transformers; result['transformers'] = transformers.__version__
    except ImportError: pass
    out = Path(a.out) if a.out else None
    save = lambda: out and out.write_text(json.dumps(result, indent=1) + '\n')
    runs = {'linear': lambda: linear_part(device, dtype, 4096 if cuda else 256, result, save),
            'sinks': lambda: sinks_part(device, dtype, 4096 if cuda else 128, result, save),
            'mla': lambda: mla_part(device, dtype, (1024, 4096, 32768) if cuda else (128, 512), result, save),
            'paged': lambda: paged_part(device, dtype, (1024, 4096) if cuda else (40, 100), result, save),
            'route': lambda: route_part(device, dtype, 4096 if cuda else 256, result, save)}
    run_parts(runs, a.part.split(','), result, save, out)


if __name__ == '__main__':
    main()
