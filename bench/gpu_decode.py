"""Decoding at the memory limit, on a CUDA GPU: tokens/s against the bandwidth limit, a step against the cache's
capacity, and FlashDecoding's bandwidth on a long cache.

    python bench/gpu_decode.py --out bench/gpu_decode.json     # on a CUDA GPU, bfloat16
    python bench/gpu_decode.py --small                         # anywhere (CPU too): tiny shapes, checks the script

Parts (each written to the JSON as soon as it is measured, so a run cut short keeps what it has):

- `decode`: for three shapes with random weights (GPT-2 small; a Llama-1B shape: 16 blocks, d 2,048, 32 heads, 8
  key/value heads, FFN 8,192, vocabulary 32,000; a Llama-2-7B shape: 32 blocks, d 4,096, 32 heads, FFN 11,008,
  vocabulary 32,000), transformers' model is made and the package's model loaded from its state dict with
  `from_hf` (the same weights). Batch 1, a 32-token prompt, 256 new tokens, greedy. The package runs
  `generate(compile=True)` (the decode step compiled once per bound, CUDA graphs); transformers runs its documented
  fast path, `generate(cache_implementation='static')`, which compiles the forward itself on a GPU (two runs to warm
  up, then two timed). A step's time is the decode loop's time over its
  steps (synchronised at both ends), the better of two runs after a first that compiles; tokens/s is its inverse. The bandwidth limit is bandwidth / bytes read per step,
  where a step reads every weight once (the input embedding table only one row, so it is not counted unless tied)
  and its keys and values; the fraction of it reached is the figure of merit. Tokens are compared with the
  package's eager `generate` (bfloat16 rounding may legitimately part them after a near tie: the first differing
  step is recorded).
  For GPT-2 and the Llama-1B shape, torch.profiler then records the CUDA time by kernel over 20 compiled steps.
- `stacked`: for each shape, the compiled step with q, k, v (and Llama's gate and up) as separate products and as
  one product each (`stacked`, which `generate` holds), the same weights, in one run; the ratio of their steps and
  whether they write the same tokens; then torch.profiler over 20 stacked steps: how many kernels a step runs and
  their time, and the 12 longest. The other parts run stacked, as `generate` does. With `--cpu`, the real shapes
  run on the CPU in float32, compiled by inductor, 64 new tokens.
- `capacity`: the Llama-1B shape, 1,024 tokens in the cache, a compiled step at capacity 1,088 and at 32,768.
- `graphs`: where the time between kernels goes. For GPT-2 and the Llama-1B shape, the same compiled step two ways,
  in one run on one set of caches (rewound between runs): `generate(compile=True)`'s (CUDA graphs by PyTorch's
  cudagraph trees, which check the step's inputs on the host at every replay) and the step compiled without CUDA
  graphs, captured by hand in one `torch.cuda.CUDAGraph` per decode bound, each step one `replay()`. The difference is
  host time that the GPU waits for. Tokens must be the same both ways.
- `flash_decoding`: one layer of the Llama-1B shape's attention at batch 1 over a 32,768-token cache:
  `split_kv_attention` (eager and compiled, several splits) against SDPA; the KV bytes read per second.
"""
import argparse, contextlib, datetime, json, shlex, statistics, sys, time, traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.decoding import _decode_step, decode_bound, generate, stacked  # noqa: E402
from selfattn_nbdev.pretrained import from_hf  # noqa: E402
from selfattn_nbdev.ring import split_kv_attention  # noqa: E402

BANDWIDTH = {'H200': 4.8e12, 'H100 SXM': 3.35e12, 'H100 80GB HBM3': 3.35e12, 'H100': 3.35e12}
SHAPES = {  # name: (transformers family, config)
    'GPT-2 small': ('gpt2', dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)),
    'Llama-1B shape': ('llama', dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                     max_position_embeddings=32768)),
    'Llama-2-7B shape': ('llama', dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                       max_position_embeddings=4096)),
}
SMALL = {
    'GPT-2 tiny': ('gpt2', dict(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)),
    'Llama tiny': ('llama', dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)),
}


def cpu_name() -> str:
    "The CPU's model name and the threads torch uses: CPU figures differ between machines."
    try: name = next(l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name'))
    except (OSError, StopIteration): name = 'cpu'
    return f'{name} ({torch.get_num_threads()} threads)'


def bandwidth(device_name: str):
    return next((bw for key, bw in BANDWIDTH.items() if key in device_name), None)


def hf_model(family: str, config: dict, device, dtype):
    import transformers
    common = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == 'gpt2': cfg, cls = transformers.GPT2Config(**config, **common), transformers.GPT2LMHeadModel
    else: cfg, cls = transformers.LlamaConfig(**config, **common), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        old = torch.get_default_dtype(); torch.set_default_dtype(dtype)
        try: model = cls(cfg)
        finally: torch.set_default_dtype(old)
    return model.eval(), cfg.to_dict()


def ours_and_prompt(family: str, config: dict, device, dtype, prompt_len: int):
    "The package's model on transformers' random weights (from_hf), and a random prompt (1, prompt_len)."
    theirs, cfg = hf_model(family, config, device, dtype)
    ours = from_hf(theirs.state_dict(), cfg, dtype=dtype, device=device)
    prompt = torch.randint(0, cfg['vocab_size'], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    return ours, prompt.to(device)


def weight_bytes(model) -> int:
    "Bytes a step reads of the weights: all of them, but of an untied input embedding table one row."
    seen, total = set(), 0
    head = getattr(model, 'head', None)
    for name, p in model.named_parameters():
        if p.data_ptr() in seen: continue
        seen.add(p.data_ptr())
        untied_table = (name.endswith('tok_emb.weight') or name.endswith('pos_emb.weight')) and (
            head is None or head.weight.data_ptr() != p.data_ptr())
        if not untied_table: total += p.numel() * p.element_size()
    return total


def kv_bytes_per_step(model, tokens: int, dtype) -> int:
    "Keys and values read by a step at `tokens` cached, every block."
    total = 0
    for block in model.blocks:
        attn = block.attn
        kv_heads = getattr(attn, 'num_kv_heads', attn.num_heads)
        total += 2 * kv_heads * attn.head_dim * tokens
    return total * torch.finfo(dtype).bits // 8


def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize(device)


def profile_steps(step_fn, model, prompt, new, device, steps=20) -> list:
    "CUDA (or CPU) time by kernel over `steps` compiled decode steps, top 12, per step."
    caches = model.new_caches(prompt.shape[1] + 3 + steps)  # room for every token it writes
    with torch.no_grad():
        ids = model(prompt, caches)[:, -1].argmax(-1)[:, None]
        for _ in range(3): ids = step_fn(ids, caches)[:, -1].argmax(-1)[:, None]
        sync(device)
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == 'cuda' else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps): ids = step_fn(ids, caches)[:, -1].argmax(-1)[:, None]
            sync(device)
    key = 'device_time_total' if device.type == 'cuda' else 'cpu_time_total'
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:12]
    print(prof.key_averages().table(sort_by=key, row_limit=12), flush=True)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    every = [dict(name='every CUDA kernel', calls_per_step=len(kernels) / steps,
                  us_per_step=sum(e.time_range.elapsed_us() for e in kernels) / steps)] if kernels else []
    return every + [dict(name=e.key[:90], calls_per_step=e.count / steps,
                         us_per_step=getattr(e, key, 0) / steps) for e in rows]


def decode_loop(model, step_fn, prompt, caches, new, device, stack=True):
    """Prefill, then new - 1 greedy steps: the tokens written (b, new), and a step's seconds (synchronised at both
    ends). With `stack`, inside `stacked(model)` as `generate` runs: q, k, v (and gate, up) one product each."""
    with stacked(model) if stack else contextlib.nullcontext(), torch.no_grad():
        ids = model(prompt, caches)[:, -1].argmax(-1)[:, None]
        sync(device); start = time.perf_counter(); written = [ids]
        for _ in range(new - 1):
            ids = step_fn(ids, caches)[:, -1].argmax(-1)[:, None]; written.append(ids)
        sync(device)
    return torch.cat(written, 1), (time.perf_counter() - start) / (new - 1)


def decode_part(shapes, device, dtype, prompt_len, new, compile_arg, result, save, profile_shapes=()):
    bw = bandwidth(result['device'])
    for name, (family, config) in shapes.items():
        r = result['decode'][name] = {}
        try:
            theirs, cfg = hf_model(family, config, device, dtype)
            ours = from_hf(theirs.state_dict(), cfg, dtype=dtype, device=device)
            gen = torch.Generator().manual_seed(1)
            prompt = torch.randint(0, cfg['vocab_size'], (1, prompt_len), generator=gen).to(device)
            n_check = min(32, new)
            eager = generate(ours, prompt, n_check)
            step_fn = _decode_step(ours, compile_arg)       # one compiled step for every run
            def run():
                written, step = decode_loop(ours, step_fn, prompt, ours.new_caches(prompt_len + new), new, device)
                return torch.cat([prompt, written], 1), step
            t0 = time.perf_counter(); run(); r['first_call_s'] = time.perf_counter() - t0
            out, step = min((run() for _ in range(2)), key=lambda o: o[1])
            with torch.no_grad():  # teacher-forced eager logits: where a token differs, how near a tie
                full = ours(out[:, :-1])[:, prompt_len - 1:].float()          # (1, new, vocab)
            chosen = full.gather(-1, out[:, prompt_len:, None])[..., 0]
            gap = (full.amax(-1) - chosen) / full.abs().amax(-1)               # 0 where argmax
            r['steps_not_eager_argmax'] = int((gap > 0).sum())
            r['largest_relative_gap_where_not'] = gap.max().item()
            if name in profile_shapes:
                with stacked(ours): r['profile'] = profile_steps(step_fn, ours, prompt, new, device)
            same = out[:, :prompt_len + n_check].eq(eager).all().item()
            diff = (out[0, prompt_len:prompt_len + n_check] != eager[0, prompt_len:]).nonzero()
            hf_times = []
            def hf_run():   # transformers' documented fast path: a static cache, which generate compiles itself
                return theirs.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                       cache_implementation='static')
            t0 = time.perf_counter(); hf_run(); sync(device); r['transformers_first_call_s'] = time.perf_counter() - t0
            hf_run(); sync(device)                           # warmed up: a second run after the compiling one
            for _ in range(2):
                sync(device); t = time.perf_counter(); hf_out = hf_run(); sync(device)
                hf_times.append(time.perf_counter() - t)
            w, kv = weight_bytes(ours), kv_bytes_per_step(ours, prompt_len + new // 2, dtype)
            r.update(parameters=sum(p.numel() for p in ours.parameters()), weight_bytes=w, kv_bytes_mean=kv,
                     step_ms=step * 1e3, tokens_per_s=1 / step,
                     transformers_static_tokens_per_s=new / min(hf_times),
                     same_first_tokens_as_eager=same, tokens_compared=n_check, first_differing_step=(diff[0, 0].item() if len(diff) else None),
                     same_tokens_as_transformers=bool(hf_out[0, :prompt_len + new].eq(out[0]).all().item()))
            if bw:
                r['limit_tokens_per_s'] = bw / (w + kv)
                r['fraction_of_bandwidth'] = (w + kv) / step / bw
            print(f"{name}: {r['tokens_per_s']:.0f} tokens/s ({r.get('fraction_of_bandwidth', float('nan')):.0%} of "
                  f"the limit), transformers {r['transformers_static_tokens_per_s']:.0f}; first call "
                  f"{r['first_call_s']:.0f} s; same tokens as eager {same}", flush=True)
            del ours, theirs
        except Exception as e:
            r['error'] = f'{type(e).__name__}: {e}'[:800]; traceback.print_exc()
        if device.type == 'cuda': torch.cuda.empty_cache()
        save()


def hand_graphed(model, device, options):
    """The decode step compiled without CUDA graphs, captured in one torch.cuda.CUDAGraph per decode bound (and set of
    caches), replayed: on the host, a step is a copy of its token and a replay."""
    inner = _decode_step(model, options)          # counts the tokens, sets the bound, runs the compiled step
    graphs = {}
    def step(token_ids, caches):
        bound = decode_bound(caches[0].num_seen + token_ids.shape[1], caches[0].capacity)
        key = (bound, caches[0]._keys.data_ptr())
        if key not in graphs:
            static = token_ids.clone()
            side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):          # warm up (compiles), then undo what it wrote
                for _ in range(2):
                    inner(static, caches)
                    for c in caches: c.num_seen -= token_ids.shape[1]; c.step.sub_(token_ids.shape[1])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph): out = inner(static, caches)
            for c in caches: c.num_seen -= token_ids.shape[1]   # the capture ran no kernel
            graphs[key] = (graph, static, out)
        graph, static, out = graphs[key]
        for c in caches: c.num_seen += token_ids.shape[1]; c.bound = bound
        static.copy_(token_ids); graph.replay()
        return out
    return step


def graphs_part(shapes, device, dtype, prompt_len, new, result, save):
    "generate(compile=True)'s step against the same compiled step captured by hand (see the top)."
    bw = bandwidth(result['device'])
    cuda = device.type == 'cuda'
    for name in [n for n in shapes if n in ('GPT-2 small', 'Llama-1B shape', 'Llama tiny')]:
        family, config = shapes[name]
        r = result.setdefault('graphs', {})[name] = {}
        try:
            ours, prompt = ours_and_prompt(family, config, device, dtype, prompt_len)
            caches = ours.new_caches(prompt_len + new)
            steps = {'cudagraph trees': _decode_step(ours, True if cuda else dict(backend='eager')),
                     'by hand': hand_graphed(ours, device, dict(fullgraph=True, dynamic=False)) if cuda
                     else _decode_step(ours, dict(backend='eager'))}
            def run(step_fn):
                for c in caches:                   # rewind: the same storage, so the same graphs
                    c.num_seen = 0
                    if c.step is not None: c.step.zero_()
                return decode_loop(ours, step_fn, prompt, caches, new, device)
            outs = {}
            for how, fn in steps.items():
                t0 = time.perf_counter(); run(fn); r[how + ' first_call_s'] = time.perf_counter() - t0
                outs[how], r[how + ' step_ms'] = min((run(fn) for _ in range(2)), key=lambda o: o[1])
                r[how + ' step_ms'] *= 1e3
            w, kv = weight_bytes(ours), kv_bytes_per_step(ours, prompt_len + new // 2, dtype)
            r['same_tokens'] = bool(torch.equal(*outs.values()))
            for how in steps:
                r[how + ' tokens_per_s'] = 1e3 / r[how + ' step_ms']
                if bw: r[how + ' fraction_of_bandwidth'] = (w + kv) / (r[how + ' step_ms'] / 1e3) / bw
            print(name, r, flush=True)
            del ours, caches
        except Exception as e:
            r['error'] = f'{type(e).__name__}: {e}'[:800]; traceback.print_exc()
        if cuda: torch.cuda.empty_cache()
        save()


def stacked_part(shapes, device, dtype, prompt_len, new, compile_arg, result, save):
    """The compiled step with q, k, v (and Llama's gate and up) as separate products and stacked into one, on the
    same weights in one run: each way compiled and run once, then timed twice in turns, its better run kept."""
    bw = bandwidth(result['device'])
    for name, (family, config) in shapes.items():
        r = result.setdefault('stacked', {})[name] = {}
        try:
            ours, prompt = ours_and_prompt(family, config, device, dtype, prompt_len)
            step_fn = _decode_step(ours, compile_arg)
            run = lambda stack: decode_loop(ours, step_fn, prompt, ours.new_caches(prompt_len + new), new, device,
                                            stack=stack)
            ways, best = {'separate': False, 'stacked': True}, {}
            for how, stack in ways.items():
                t0 = time.perf_counter(); run(stack); r[how + ' first_call_s'] = time.perf_counter() - t0
            for _ in range(2):
                for how, stack in ways.items():
                    out = run(stack)
                    if how not in best or out[1] < best[how][1]: best[how] = out
            w, kv = weight_bytes(ours), kv_bytes_per_step(ours, prompt_len + new // 2, dtype)
            for how, (_, step) in best.items():
                r[how + ' step_ms'], r[how + ' tokens_per_s'] = step * 1e3, 1 / step
                if bw: r[how + ' fraction_of_bandwidth'] = (w + kv) / step / bw
            r['stacked / separate'] = best['stacked'][1] / best['separate'][1]
            apart, together = best['separate'][0], best['stacked'][0]
            r['same_tokens'] = bool(torch.equal(apart, together))
            differ = (apart != together).nonzero()
            r['first_differing_step'] = differ[0, 1].item() if len(differ) else None
            print(name, r, flush=True); save()
            with stacked(ours):  # where the stacked step's time goes, kernel by kernel (after the figures)
                r['profile stacked'] = profile_steps(step_fn, ours, prompt, new, device)
            del ours
        except Exception as e:
            r['error'] = f'{type(e).__name__}: {e}'[:800]; traceback.print_exc()
        if device.type == 'cuda': torch.cuda.empty_cache()
        save()


def capacity_part(shapes, device, dtype, compile_arg, used, capacities, result, save):
    family, config = shapes['Llama-1B shape'] if 'Llama-1B shape' in shapes else shapes['Llama tiny']
    config = config | dict(num_hidden_layers=4)       # the 1B's width, 4 blocks: quicker to compile
    theirs, cfg = hf_model(family, config, device, dtype)
    model = from_hf(theirs.state_dict(), cfg, dtype=dtype, device=device)
    prompt = torch.randint(0, cfg['vocab_size'], (1, used), device=device)
    out, step = {}, _decode_step(model, compile_arg)
    for capacity in capacities:
        caches = model.new_caches(capacity)
        with torch.no_grad():
            ids = model(prompt, caches)[:, -1].argmax(-1)[:, None]
            times = []
            for i in range(24):
                sync(device); t = time.perf_counter()
                ids = step(ids, caches)[:, -1].argmax(-1)[:, None]
                sync(device); times.append(time.perf_counter() - t)
        out[str(capacity)] = statistics.median(times[8:]) * 1e3
        print(f'capacity {capacity}: {out[str(capacity)]:.3f} ms a step with {used} tokens', flush=True)
    lo, hi = min(capacities), max(capacities)
    result['capacity'] = dict(model='the Llama-1B shape with 4 blocks', tokens_in_cache=used, step_ms=out,
                              ratio=out[str(hi)] / out[str(lo)])
    save()


def flash_decoding_part(device, dtype, S, result, save, kv_heads=8, heads=32, hd=64):
    torch.manual_seed(0)
    q = torch.randn(1, heads, 1, hd, device=device, dtype=dtype)
    k, v = torch.randn(2, 1, kv_heads, S, hd, device=device, dtype=dtype).unbind(0)
    kv_bytes = 2 * kv_heads * S * hd * k.element_size()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    def timed(fn, reps=50):
        fn(); sync(device)
        ts = []
        for _ in range(reps):
            sync(device); t = time.perf_counter(); fn(); sync(device); ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    rows = {}
    contenders = {'sdpa (enable_gqa)': lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    for n in (16, 64, 128):
        contenders[f'split_kv_attention, {n} splits'] = (lambda n=n: split_kv_attention(q, k, v, n))
    compiled = torch.compile(split_kv_attention, fullgraph=True)
    for n in (64, 128):
        contenders[f'split_kv_attention compiled, {n} splits'] = (lambda n=n: compiled(q, k, v, n))
    bw = bandwidth(result['device'])
    for name, fn in contenders.items():
        try:
            err = (fn().float() - ref).abs().max().item()
            t = timed(fn)
            rows[name] = dict(us=t * 1e6, kv_bytes_per_s=kv_bytes / t, max_abs_diff_vs_fp32=err,
                              fraction_of_bandwidth=(kv_bytes / t / bw) if bw else None)
            print(f'{name}: {t * 1e6:.1f} us, {kv_bytes / t / 1e9:.0f} GB/s', flush=True)
        except Exception as e:
            rows[name] = dict(error=f'{type(e).__name__}: {e}'[:500]); traceback.print_exc()
    result['flash_decoding'] = dict(cache_tokens=S, kv_heads=kv_heads, heads=heads, head_dim=hd,
                                    kv_bytes=kv_bytes, rows=rows)
    save()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--small', action='store_true')
    ap.add_argument('--out', default=None)
    ap.add_argument('--part', default='decode,flash,capacity')
    ap.add_argument('--shapes', default='', help='comma-separated names (default: all)')
    ap.add_argument('--tuned', action='store_true', help="inductor's coordinate-descent tuning (gpt-fast's)")
    ap.add_argument('--cpu', action='store_true', help='the real shapes on the CPU, compiled by inductor, float32')
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.small and not a.cpu
    device = torch.device('cuda' if cuda else 'cpu')
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SHAPES if not a.small else SMALL
    if a.tuned:  # gpt-fast's setting: inductor tunes each kernel's launch; longer first call
        torch._inductor.config.coordinate_descent_tuning = True
    compile_arg = True if cuda or a.cpu else dict(backend='eager', fullgraph=True)
    out = Path(a.out) if a.out else None
    result = dict(device=torch.cuda.get_device_name() if cuda else cpu_name(), dtype=str(dtype).replace('torch.', ''),
                  torch=torch.__version__, date=datetime.date.today().isoformat(),
                  command=shlex.join(['python', 'bench/gpu_decode.py'] + sys.argv[1:]),
                  bandwidth_bytes_per_s=bandwidth(torch.cuda.get_device_name()) if cuda else None,
                  config=dict(batch=1, prompt_tokens=32, new_tokens=16 if a.small else 64 if a.cpu else 256,
                              coordinate_descent_tuning=a.tuned), decode={})
    try:
        import transformers; result['transformers'] = transformers.__version__
    except ImportError: pass
    save = lambda: out and out.write_text(json.dumps(result, indent=1) + '\n')
    parts = a.part.split(',')
    only = [n for n in shapes if not a.shapes or n in a.shapes.split(',')]
    runs = {'decode': lambda: decode_part({n: shapes[n] for n in only}, device, dtype, 32,
                                          result['config']['new_tokens'], compile_arg, result, save,
                                          profile_shapes=('GPT-2 small', 'Llama-1B shape', 'Llama tiny')),
            'stacked': lambda: stacked_part({n: shapes[n] for n in only}, device, dtype, 32,
                                            result['config']['new_tokens'], compile_arg, result, save),
            'graphs': lambda: graphs_part(shapes, device, dtype, 32, result['config']['new_tokens'], result, save),
            'flash': lambda: flash_decoding_part(device, dtype, 32768 if cuda else 1024, result, save),
            'capacity': lambda: capacity_part(shapes, device, dtype, compile_arg, 1024 if cuda else 100,
                                              (1088, 32768) if cuda else (128, 2048), result, save)}
    run_parts(runs, parts, result, save, out)


def run_parts(runs: dict, parts: list, result: dict, save, out) -> None:
    "Run each named part in turn, timed; one that raises leaves its error in `result` and the others still run."
    for part in parts:
        t = time.perf_counter()
        try: runs[part]()
        except Exception as e:
            result[part + '_error'] = f'{type(e).__name__}: {e}'[:800]; traceback.print_exc(); save()
        print(f'-- {part}: {time.perf_counter() - t:.0f} s', flush=True)
    save()
    if out: print(f'wrote {out}')


if __name__ == '__main__':
    main()
