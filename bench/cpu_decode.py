"""Benchmark: decoding on a CPU one token at a time, against the memory limit, the package beside transformers and
llama.cpp. The measuring step of "Decoding on a CPU at the memory limit": where a decode step's time goes today.

    python bench/cpu_decode.py [--llamacpp-python PATH] [--out bench/cpu_decode.json]    # about 30 minutes

float32, greedy, random weights of two shapes (SHAPES: GPT-2 small, and a 200 M Llama shape with 16/4 heads), built
by transformers and read by the package's `from_hf`, so that both decode the same weights and must write the same
tokens (`tokens_equal`, recorded: random weights can tie). A token's rate is of the decode steps only (the prompt's step left out), as
llama.cpp's is. Recorded:

- `bandwidth`: the read rate of one and two threads over 1 GiB (torch's sum and numpy's in ordinary memory, of
  4 KiB pages, and torch's in memory advised for 2 MiB pages, `torch_sum_huge_pages`), and the rate at which
  torch's matrix-vector product reads each shape's weights (`gemv`), row-major as the modules hold them and
  column-major, and oneDNN's (`gemv_onednn`, row-major), the weights in 2 MiB pages as `generate` puts them; the
  limit of a shape is the best read rate over the bytes a token reads (`bytes_a_token`: every
  weight but the input embeddings, of which a token reads one row; a tied table is read whole as the head);
- `huge_pages`: per shape, `weights_in_huge_pages` on the model as `generate`'s first call runs it: the bytes it
  moved, its seconds, and the bytes Linux then reports in 2 MiB pages (AnonHugePages of their mappings);
- `compile`: per shape and thread count, the first `generate(compile=True)` (its decode step compiled) against the
  next call, which reuses the graphs: the compile's seconds, paid once a process for each thread count (Dynamo
  guards on torch's thread count: the first call at another count compiles again), with an empty kernel cache
  (TORCHINDUCTOR_CACHE_DIR, a new folder unless set), as on a first run; and `later_process`, the same first call
  in a new process once that cache holds the kernels, as on a user's next run (its `compile_s` holds
  `compiled_gemv_kernel`'s probe too, which a new process measures again);
- `gemv_kernel`: per shape and thread count, the kernel the package's `gemv_kernel` chose for one token's products
  (the BLAS behind F.linear, or oneDNN), `gemm_kernel` for a prompt's and `compiled_gemv_kernel` for a compiled
  step's one row (Inductor's loop, row_dot, or, where it wins clearly, the kernel `gemv_kernel` chose), and the
  seconds each measurement took (the last includes its compile, with an empty kernel cache);
- `prefill_ms`: per shape and thread count, one forward over a 512-token prompt with the measured kernels and with
  every product by the BLAS, medians of twice the rounds, in turns, each first in half of them;
- `peers`: 1 and 2 threads, a 32-token prompt and 64 new tokens at batch 1, rounds interleaving the package's
  `generate` (growing caches; its products by the kernel `gemv_kernel` chose), the same with every product by the
  BLAS (`package generate (BLAS)`: what `generate` did before it measured), `generate(static=True)` and
  `generate(compile=True)` (on a CPU, Inductor's calls between kernels in C++: `cpp_wrapper`) and the same
  compiled with those calls in Python (`package compiled (Python wrapper)`: what `compile=True` did before),
  `generate` eager and compiled with the weights left in ordinary memory (`... (4 KiB pages)`: what both did
  before `weights_in_huge_pages`; stacked, as `generate` stacks them),
  transformers' `generate`
  (dynamic and static cache), `bare step (no package)` (`headroom`'s row-major step, in the rounds: what an eager
  step reaches with nothing but the arithmetic; its tokens are compared apart, `tokens_equal_bare_step`, since its
  sums run in another order) and llama.cpp (skipped without `--llamacpp-python`, a Python with llama-cpp-python
  and gguf: see bench/llamacpp_child.py); medians of the rounds. Each round also measures the read rate again
  (`round_read_rate`: torch's sum over 1 GiB of 2 MiB pages, beside the systems, since a machine's rate drifts
  within a run): `limit_tok_s` and `fraction_of_limit` are over its median (`read_rate_each_round`), and
  `limit_at_start_tok_s` is the limit by `bandwidth` above;
- `head_to_head`: per shape and thread count, `generate(compile=True)` and llama.cpp alone, in close turns,
  HEAD_TO_HEAD rounds, each first in half of them: medians, their ratio and each round's (skipped without
  llama.cpp);
- `costs`: at 1 thread, contexts of 32, 512 and the longest the shape takes less the new tokens (1,984 for the
  Llama shape, 960 for GPT-2's 1,024) at batch 1, and batches of 4 and 16 at 32: the package's eager `generate`
  and its compiled step (`compiled`: `compile=True`, a graph per batch, and from a second storage size on one of any
  capacity, as `generate` makes them, compiled before the rounds), each
  with the bytes a step reads over its time and that rate over the one-thread read rate measured in the same rounds
  (`fraction_of_limit`, `read_rate_each_round`), and
  beside them transformers (dynamic and static cache) and llama.cpp (batch 1: llama-cpp-python decodes one
  sequence); medians of the rounds, the systems in turns within each (`runs`);
- `profile`: one decode step of each shape at 1 thread under torch's profiler, its time by kind of work, and the
  time outside torch's operators (Python and dispatch); `profile_compiled` the compiled step's, and
  `profile_compiled (4 KiB pages)` the same with the weights in ordinary memory;
- `headroom`: a bare decode step written against the same weights (no checks, no masks, fused projections: what
  gpt-fast writes), with the weights row-major and column-major, to show what the step could reach;
- `large`: a 1 B Llama shape (Llama 3.2 1B's sizes, 4.9 GB in float32) at 1 and 2 threads, the eager step over 16
  new tokens and the compiled one over 32 (`compiled`, its first call's seconds too), against the read rate
  measured just before and after them (`read_rate_around`); `--large-only` measures it again into `--out`, with
  its own date and command.
Printed and written; nothing is asserted.
"""
import argparse, collections, contextlib, datetime, json, os, platform, shlex, statistics, subprocess, sys, tempfile, time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev import decoding  # noqa: E402
from selfattn_nbdev.decoding import generate, onednn_linear  # noqa: E402
from selfattn_nbdev.pretrained import from_hf  # noqa: E402

SHAPES = {'gpt2': dict(model_type='gpt2', vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
          'llama': dict(model_type='llama', vocab_size=32000, hidden_size=1024, num_hidden_layers=12,
                        num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816,
                        max_position_embeddings=2048)}
LARGE = dict(model_type='llama', vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=2048, tie_word_embeddings=True,
             head_dim=64)
PROMPT, NEW = 32, 64
PREFILL = 512  # the prompt whose one forward `prefill_ms` times
HEAD_TO_HEAD = 7  # rounds of the compiled step against llama.cpp alone
KINDS = [('weights (linear)', ('addmm', 'aten::mm', 'linear', 'matmul', 'aten::mv', 'addmv')),
         ('attention', ('scaled_dot_product', 'softmax', 'bmm')),
         ('norms', ('layer_norm', 'rms_norm', 'rsqrt', 'pow', 'mean')),
         ('activations and residuals', ('gelu', 'silu', 'mul', 'tanh', 'aten::add')),
         ('cache writes', ('copy_', 'aten::cat', 'index_copy', 'slice_scatter')),
         ('choosing the token', ('argmax', 'aten::max')),
         ('embedding', ('embedding', 'index_select'))]


def hf_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**config, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation='sdpa').eval()


def ours_of(hf):
    "The package's model of transformers' `hf`, through a checkpoint in a folder removed after (from_hf reads it all)."
    with tempfile.TemporaryDirectory(prefix='cpu_decode_') as folder:
        hf.save_pretrained(folder)
        return from_hf(folder).eval()


def bytes_a_token(model) -> int:
    "Every weight a token reads: all parameters but the position table and the untied input embedding."
    emb, head = model.token_emb.weight, model.head.weight
    skip = {id(model.pos_emb.weight)} if model.pos_emb is not None else set()
    if emb is not head: skip.add(id(emb))
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in skip or id(p) in seen: continue
        seen.add(id(p)); total += p.numel() * p.element_size()
    return total


def read_rates(threads: int) -> dict:
    """Bytes a second of a sum over 1 GiB: torch's and numpy's in ordinary (4 KiB-page) memory, torch's in memory
    advised for 2 MiB pages (`huge_page_buffer`: where the weights of `generate` lie)."""
    torch.set_num_threads(threads)
    x, y, best = torch.ones(256 * 2**20), np.ones(256 * 2**20, np.float32), {}
    z = decoding.huge_page_buffer(2**30).view(torch.float32).fill_(1.0)
    for name, f in [('torch_sum', x.sum), ('numpy_sum', y.sum), ('torch_sum_huge_pages', z.sum)]:
        times = []
        for _ in range(5):
            start = time.perf_counter(); f(); times.append(time.perf_counter() - start)
        best[name] = x.nbytes / min(times)
    return best


def round_read_rate(pages) -> float:
    """Bytes a second of torch's sum over `pages` (1 GiB advised for 2 MiB pages, made once), best of 3 at the thread
    count set: the limit measured again beside each round's systems, since the machine's rate drifts within a run."""
    times = []
    for _ in range(3):
        start = time.perf_counter(); pages.sum(); times.append(time.perf_counter() - start)
    return pages.nbytes / min(times)


def gemv_rate(model, column_major: bool, onednn: bool = False) -> float:
    "Bytes per second of torch.mv (or oneDNN's product) over every matrix a token reads, in turn (all larger than the caches together)."
    mats = [p.detach() for p in model.parameters() if p.dim() == 2 and p is not getattr(model.pos_emb, 'weight', 0)]
    if column_major: mats = [m.t().contiguous().t() for m in mats]
    xs = {m.shape[1]: torch.randn(m.shape[1]) for m in mats}
    if onednn: xs = {n: x[None] for n, x in xs.items()}
    product = onednn_linear if onednn else torch.mv
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for m in mats: product(xs[m.shape[1]], m) if onednn else product(m, xs[m.shape[1]])
        times.append(time.perf_counter() - start)
    return sum(m.nbytes for m in mats) / min(times)


def ours_rate(model, ids, new, static=None, compile=False, kernel=None) -> tuple:  # static None: generate's
    "Tokens a second of the decode steps, and the new tokens; `kernel` 'blas': every product by F.linear's BLAS."
    steps, measured = [], decoding.rows_kernel
    if kernel is not None: decoding.rows_kernel = lambda model, rows, linears=None: kernel
    try: out = generate(model, ids, new, step_times=steps, static=static, stop_ids=[], compile=compile)
    finally: decoding.rows_kernel = measured
    return (new - 1) * ids.shape[0] / sum(steps[1:]), out[:, ids.shape[1]:]


def chosen_kernel(model) -> dict:
    """What `gemv_kernel` (one row), `gemm_kernel` (a prompt's rows) and `compiled_gemv_kernel` (a compiled step's
    one row: the loop, or gemv_kernel's) choose at this thread count (kept after), and the seconds each took; on the
    matrices `generate` multiplies by (inside `stacked`: q, k, v one product, gate and up one)."""
    with decoding.stacked(model):
        start = time.perf_counter(); kernel = decoding.gemv_kernel(model); gemv_s = time.perf_counter() - start
        start = time.perf_counter(); prompt = decoding.gemm_kernel(model); gemm_s = time.perf_counter() - start
        start = time.perf_counter(); compiled = decoding.compiled_gemv_kernel(model)
        loop_s = time.perf_counter() - start
    return dict(kernel=kernel, seconds=gemv_s, prompt_kernel=prompt, prompt_seconds=gemm_s,
                compiled_kernel=compiled, compiled_seconds=loop_s)


def prefill_ms(model, ids, kernel=None) -> float:
    "Milliseconds of one forward over a prompt (no cache), its products by `kernel` (None: the measured ones)."
    with torch.no_grad(), decoding.faster_products(model, kernel):
        start = time.perf_counter(); model(ids)
        return (time.perf_counter() - start) * 1e3


BARE = 'bare step (no package)'  # bare_step below: the arithmetic alone, eagerly (the ceiling of an eager step)
SMALL_PAGES = ' (4 KiB pages)'  # a system's name with its weights where PyTorch's allocator put them (not moved)


@contextlib.contextmanager
def small_pages(model, storages):
    "Within: the model's weights in `storages` (ordinary memory, stacked as `generate` stacks), and not moved."
    params, moving = list(model.parameters()), decoding.weights_in_huge_pages
    held = [p.data for p in params]
    for p, d in zip(params, storages): p.data = d
    decoding.weights_in_huge_pages = lambda model, min_bytes=None: 0
    try: yield
    finally:
        decoding.weights_in_huge_pages = moving
        for p, d in zip(params, held): p.data = d


def ordinary_storages(model) -> list:
    "The model's weights stacked in ordinary memory, kept aside before `generate` moves them to 2 MiB pages."
    with torch.no_grad(), decoding.stacked(model): pass
    return [p.data for p in model.parameters()]


def moved_to_huge_pages(model) -> dict:
    "Move the weights (as `generate` does on its first call), timed, and what Linux says now lies in 2 MiB pages."
    with torch.no_grad(), decoding.stacked(model):
        start = time.perf_counter(); moved = decoding.weights_in_huge_pages(model); seconds = time.perf_counter() - start
    return dict(on=decoding.huge_pages_on(), moved_bytes=moved, seconds=seconds,
                in_huge_pages_bytes=decoding.huge_page_bytes(*model.parameters()))


PYTHON_WRAPPER = dict(fullgraph=True, dynamic=False)  # compile=True's options on a CPU, less its C++ wrapper


def compile_seconds(model, ids, new) -> dict:
    "The first `generate(compile=True)` of a model, whose step compiles, against the next, which reuses it."
    times = []
    for _ in range(2):
        start = time.perf_counter()
        generate(model, ids, new, stop_ids=[], compile=True)
        times.append(time.perf_counter() - start)
    return dict(first_call_s=times[0], next_call_s=times[1], compile_s=times[0] - times[1])


def quiet_transformers():
    "transformers, its warnings and progress bars off (this file prints what it measures); returned."
    import transformers
    transformers.logging.set_verbosity_error(); transformers.utils.logging.disable_progress_bar()
    return transformers


def later_process_compile(name: str, threads: int) -> dict:
    """The first `generate(compile=True)` of shape `name` again, in a new process that finds this run's Inductor cache
    (TORCHINDUCTOR_CACHE_DIR, which the compiles before filled): what a user's next run of the same shape pays. In a
    new process the first call also measures `compiled_gemv_kernel` (its loop's kernel from the cache too), so its
    `compile_s` holds that probe as well."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), '--later-compile', name, str(threads)],
                         capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def later_compile_child(name: str, threads: int) -> None:
    "`later_process_compile`'s process: build the shape, time its first and next `generate(compile=True)`, print them."
    quiet_transformers()
    model = ours_of(hf_model(SHAPES[name]))
    torch.set_num_threads(threads)
    ids = torch.randint(3, SHAPES[name]['vocab_size'], (1, PROMPT))
    with torch.no_grad(): print(json.dumps(compile_seconds(model, ids, NEW)))


def hf_rate(hf, ids, new, static=False) -> tuple:
    options = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new, pad_token_id=0)
    if static: options['cache_implementation'] = 'static'
    start = time.perf_counter(); hf.generate(ids, **{**options, 'min_new_tokens': 1, 'max_new_tokens': 1})
    first = time.perf_counter() - start
    start = time.perf_counter(); out = hf.generate(ids, **options); whole = time.perf_counter() - start
    return (new - 1) * ids.shape[0] / (whole - first), out[:, ids.shape[1]:]


def cost_entry(runs: dict, read: int, batch: int, bandwidth: float) -> dict:
    """One context and batch of `costs`: the medians of `runs` (tok/s, every row's tokens); for the package's eager
    step (`package`) and compiled one (`package compiled`, if timed), the `read` bytes a step reads over its time
    (GB/s) and that rate over `bandwidth` (bytes/s, one thread)."""
    median = lambda k: statistics.median(runs[k]) if runs.get(k) else None
    def package(rate):
        step_s = batch / rate  # a step writes one token to each row
        return dict(tok_s=rate, read_gb_s=read / step_s / 1e9, fraction_of_limit=read / step_s / bandwidth)
    entry = dict(package(median('package')), bytes_a_step=read,
                 others={k: median(k) for k in ('transformers dynamic', 'transformers static', 'llama.cpp')},
                 runs=dict(runs))
    if runs.get('package compiled'): entry['compiled'] = package(median('package compiled'))
    return entry


def llamacpp_rate(python, path, threads, prompt=PROMPT) -> float:
    got = subprocess.run([python, str(ROOT/'bench'/'llamacpp_child.py'), 'time', path, str(threads), str(prompt),
                          str(NEW)], capture_output=True, text=True, check=True)
    return json.loads(got.stdout.strip().splitlines()[-1])['tok_s']


def timed_and_profiled(step, warm: int, n: int) -> tuple:
    "Seconds of one step(next_ids) and the greedy choice, plain and under torch's profiler (mean of n, after warm)."
    from torch.profiler import ProfilerActivity, profile
    nxt, seconds = torch.tensor([[5]]), []
    for _ in range(warm): step(nxt)[:, -1].argmax(-1)
    for profiled in (False, True):
        with profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext() as prof:
            start = time.perf_counter()
            for _ in range(n): step(nxt)[:, -1].argmax(-1)
            seconds.append((time.perf_counter() - start) / n)
    return seconds[0], seconds[1], prof


def profile_step(model, kernel=None) -> dict:
    "One decode step as `generate` runs it (stacked products, `faster_products`), by kind; `kernel` 'blas': BLAS's."
    ids, caches, n = torch.randint(3, model.vocab_size, (1, PROMPT)), model.new_caches(), 20
    with torch.no_grad(), decoding.stacked(model), decoding.faster_products(model, kernel):
        model(ids, caches)
        plain, profiled, prof = timed_and_profiled(lambda nxt: model(nxt, caches), 5, n)
    kinds, ops, calls = collections.Counter(), 0.0, 0
    for e in prof.key_averages():
        if not e.key.startswith(('aten::', 'mkldnn::')): continue
        ops += e.self_cpu_time_total; calls += e.count
        kind = next((k for k, keys in KINDS if any(s in e.key for s in keys)), 'other operators (views, masks)')
        kinds[kind] += e.self_cpu_time_total
    ms = {k: v / n / 1e3 for k, v in kinds.most_common()}
    ms['Python and dispatch (outside operators)'] = max(profiled * 1e3 - ops / n / 1e3, 0.0)
    return dict(step_ms=plain * 1e3, profiled_step_ms=profiled * 1e3, operator_calls=calls // n, ms=ms,
                kernel=kernel or decoding.gemv_kernel(model))


COMPILED_KINDS = [('the graph: weight products, norms, RoPE, element-wise (fused kernels)', ('## Call CompiledFxGraph',)),
                  ('weight products by the BLAS or oneDNN (called from the graph)', ('aten::mm', 'aten::addmm',
                                                                                     'mkldnn::')),
                  ('attention (SDPA, called from the graph)', ('scaled_dot_product',)),
                  ("guards (Dynamo's cache lookup)", ('TorchDynamo Cache Lookup',)),
                  ('the runtime around the graph', ('Torch-Compiled Region', 'AOTDispatcher', 'Pregraph'))]


def profile_compiled_step(model) -> dict:
    "One decode step as `generate(compile=True)` runs it (static caches, the step compiled once), by kind."
    ids, n = torch.randint(3, model.vocab_size, (1, PROMPT)), 20
    with torch.no_grad(), decoding.stacked(model), decoding.faster_products(model, compiled=True):
        # a column more than the steps fill: a full cache would take a graph of its own, as generate's never is
        caches, step = model.new_caches(PROMPT + 8 + 2 * n + 1), decoding._decode_step(model, True)
        model(ids, caches)  # the warm-up compiles the step (or finds it compiled)
        alone = decoding._STEPS_ALONE.set(True)  # generate's loop: guards checked once
        try: plain, profiled, prof = timed_and_profiled(lambda nxt: step(nxt, caches), 8, n)
        finally: decoding._STEPS_ALONE.reset(alone)
    kinds, seen = collections.Counter(), 0.0
    for e in prof.key_averages():
        kind = next((k for k, keys in COMPILED_KINDS if any(s in e.key for s in keys)),
                    'other operators (choosing the token, views)' if e.key.startswith('aten::') else None)
        if kind is None: continue
        kinds[kind] += e.self_cpu_time_total; seen += e.self_cpu_time_total
    ms = {k: kinds[k] / n / 1e3 for k, _ in COMPILED_KINDS + [('other operators (choosing the token, views)', ())]}
    ms['Python (the host\'s half of the step)'] = max(profiled * 1e3 - seen / n / 1e3, 0.0)
    return dict(step_ms=plain * 1e3, profiled_step_ms=profiled * 1e3, ms=ms)


def bare_step(model, column_major: bool):
    "A decode step with nothing but the arithmetic (gpt-fast's shape of step), for GPT-2 or Llama: f(token, pos)."
    lay = (lambda w: w.detach().t().contiguous().t()) if column_major else (lambda w: w.detach())
    blocks, gpt2 = model.blocks, model.pos_emb is not None
    a0 = blocks[0].attn
    H, KV, hd = a0.num_heads, a0.num_kv_heads, a0.head_dim
    K = torch.zeros(len(blocks), KV, 2048, hd); V = torch.zeros_like(K)
    W = [dict(qkv=lay(torch.cat([b.attn.W_query.weight, b.attn.W_key.weight, b.attn.W_value.weight])),
              o=lay(b.attn.out_proj.weight),
              up=lay(b.mlp[0].weight) if gpt2 else lay(torch.cat([b.mlp.gate.weight, b.mlp.up.weight])),
              down=lay(b.mlp[2].weight) if gpt2 else lay(b.mlp.down.weight)) for b in blocks]
    bias = [torch.cat([b.attn.W_query.bias, b.attn.W_key.bias, b.attn.W_value.bias]) if gpt2 else None
            for b in blocks]
    head, D = lay(model.head.weight), model.token_emb.weight.shape[1]
    cos, sin = (None, None) if gpt2 else a0._rope_table(2048, K)
    def turn(t, p):  # RoPE at position p, (heads, hd)
        half = hd // 2
        return t * cos[p] + torch.cat([-t[:, half:], t[:, :half]], -1) * sin[p]
    def step(token, p):
        x = model.token_emb.weight[token] + (model.pos_emb.weight[p] if gpt2 else 0)
        for i, b in enumerate(blocks):
            if gpt2: h = F.layer_norm(x, (D,), b.norm1.weight, b.norm1.bias, b.norm1.eps)
            else: h = F.rms_norm(x, (D,), b.norm1.weight, b.norm1.eps)
            qkv = torch.addmv(bias[i], W[i]['qkv'], h) if gpt2 else torch.mv(W[i]['qkv'], h)
            q, k, v = qkv.split([H * hd, KV * hd, KV * hd])
            q, k, v = q.view(H, hd), k.view(KV, hd), v.view(KV, hd)
            if not gpt2: q, k = turn(q, p), turn(k, p)
            K[i, :, p], V[i, :, p] = k, v
            keys, values = K[i, :, :p + 1], V[i, :, :p + 1]                    # (KV, S, hd)
            scores = torch.bmm(q.view(KV, H // KV, hd) * hd ** -0.5, keys.transpose(1, 2))
            o = torch.bmm(scores.softmax(-1), values).reshape(H * hd)
            x = x + b.attn.out_proj.bias + torch.mv(W[i]['o'], o) if gpt2 else x + torch.mv(W[i]['o'], o)
            if gpt2:
                h = F.layer_norm(x, (D,), b.norm2.weight, b.norm2.bias, b.norm2.eps)
                u = F.gelu(torch.addmv(b.mlp[0].bias, W[i]['up'], h), approximate='tanh')
                x = torch.addmv(x + b.mlp[2].bias, W[i]['down'], u)
            else:
                gate, up = torch.mv(W[i]['up'], F.rms_norm(x, (D,), b.norm2.weight, b.norm2.eps)).chunk(2)
                x = x + torch.mv(W[i]['down'], F.silu(gate) * up)
        x = (F.layer_norm(x, (D,), model.norm.weight, model.norm.bias, model.norm.eps) if gpt2
             else F.rms_norm(x, (D,), model.norm.weight, model.norm.eps))
        return torch.mv(head, x)
    return step


def bare_rate(model, column_major: bool, ids) -> tuple:
    step, tokens = bare_step(model, column_major), ids[0].tolist()
    with torch.no_grad():
        for p, t in enumerate(tokens): logits = step(t, p)
        new, start = [], None
        for i in range(NEW):
            if i == 1: start = time.perf_counter()
            new.append(int(logits.argmax())); logits = step(new[-1], len(tokens) + i)
        return (NEW - 1) / (time.perf_counter() - start), new


def large_runs(pages, bandwidth: dict) -> dict:
    """The 1 B Llama shape at 1 and 2 threads: `generate`'s eager step (the default's until it compiles) over 16 new
    tokens, then the compiled step (its first call timed: the compile) over 32, both against the read rate measured
    just before and after them; `bandwidth` (the run's read rates) gives the limit at the run's start too."""
    from selfattn_nbdev.models import Llama, llama_config
    torch.manual_seed(0)
    big = Llama(**llama_config(LARGE)).eval()
    read, runs = bytes_a_token(big), {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        at_start = max(bandwidth[f'{threads}_thread{"s" * (threads > 1)}'].values()) / read
        ids = torch.randint(3, LARGE['vocab_size'], (1, PROMPT))
        around = [round_read_rate(pages)]  # the limit, measured just before and just after
        with torch.no_grad():
            rate, tokens = ours_rate(big, ids, 16)
            start = time.perf_counter(); generate(big, ids, 2, stop_ids=[], compile=True)
            compile_s = time.perf_counter() - start
            compiled, compiled_tokens = ours_rate(big, ids, 32, compile=True)
        around.append(round_read_rate(pages)); limit = statistics.mean(around) / read
        runs[f'{threads}'] = dict(tok_s=rate, limit_tok_s=limit, fraction_of_limit=rate / limit,
                                  read_rate_around=around, limit_at_start_tok_s=at_start,
                                  compiled=dict(tok_s=compiled, fraction_of_limit=compiled / limit,
                                                first_call_s=compile_s,
                                                tokens_equal=bool(torch.equal(compiled_tokens[:, :16], tokens))))
        print('large', threads, runs[f'{threads}'], flush=True)
    return dict(config=LARGE, bytes_a_token=read, runs=runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--llamacpp-python', help="a Python with llama-cpp-python and gguf; else llama.cpp is skipped")
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--out', default=str(ROOT/'bench'/'cpu_decode.json'))
    parser.add_argument('--no-large', action='store_true', help='leave out the 1 B shape')
    parser.add_argument('--large-only', action='store_true', help='measure the 1 B shape again, into --out')
    parser.add_argument('--later-compile', nargs=2, metavar=('SHAPE', 'THREADS'), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.later_compile: return later_compile_child(args.later_compile[0], int(args.later_compile[1]))
    # this run's files (GGUFs, Inductor's cache): removed when the run ends (the object's finalizer)
    scratch = tempfile.TemporaryDirectory(prefix='cpu_decode_')
    # a fresh cache for torch.compile's kernels (read when it compiles), so `compile` times a first run's compile
    os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', os.path.join(scratch.name, 'inductor'))
    command = 'python bench/cpu_decode.py' + (' ' + shlex.join(sys.argv[1:]) if sys.argv[1:] else '')
    if args.large_only:  # the rest of --out as it was; the 1 B shape with its own date and command
        result = json.loads(Path(args.out).read_text())
        pages = decoding.huge_page_buffer(2**30).view(torch.float32).fill_(1.0)
        result['large'] = dict(large_runs(pages, result['bandwidth']), date=datetime.date.today().isoformat(),
                               command=command)
        Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
        return print('wrote', args.out)
    transformers = quiet_transformers()
    load = [os.getloadavg()[0]]
    result = dict(command=command,
                  date=datetime.date.today().isoformat(), torch=torch.__version__,
                  transformers=transformers.__version__, machine=dict(
                      cpu_model=next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo')
                                      if l.startswith('model name')), platform.processor()),
                      cpu_count=os.cpu_count()), threads='1 and 2', dtype='float32', prompt_tokens=PROMPT, new_tokens=NEW,
                  rounds=args.rounds, llamacpp='skipped: no --llamacpp-python' if not args.llamacpp_python else
                  'llama-cpp-python ' + subprocess.run([args.llamacpp_python, '-c', 'import llama_cpp; print('
                                                        'llama_cpp.__version__)'], capture_output=True,
                                                       text=True).stdout.strip())
    result['bandwidth'] = {f'{t}_thread{"s" * (t > 1)}': read_rates(t) for t in (1, 2)}
    shapes, ggufs, small = {}, {}, {}
    for name, config in SHAPES.items():
        hf = hf_model(config)
        shapes[name] = (hf, ours_of(hf))
        small[name] = ordinary_storages(shapes[name][1])  # before generate moves them
        if args.llamacpp_python:
            ggufs[name] = os.path.join(scratch.name, f'{name}.gguf')
            subprocess.run([args.llamacpp_python, str(ROOT/'bench'/'llamacpp_child.py'), 'write', name,
                            ggufs[name]], check=True, capture_output=True)
    torch.set_num_threads(1)
    result['shapes'] = {}
    for name, (hf, ours) in shapes.items():
        read = bytes_a_token(ours)
        result['shapes'][name] = dict(config=SHAPES[name], bytes_a_token=read, huge_pages=moved_to_huge_pages(ours),
                                      gemv_row_major=gemv_rate(ours, False), gemv_column_major=gemv_rate(ours, True),
                                      gemv_onednn=gemv_rate(ours, False, onednn=True))
        chosen = {}
        decoding._MEASURED.clear(); decoding._LOOPED.clear()  # measured afresh, once a thread count: what
                                                               # every later call uses
        for threads in (1, 2):
            torch.set_num_threads(threads)
            chosen[f'{threads}'] = chosen_kernel(ours)
        torch.set_num_threads(1)
        result['shapes'][name]['gemv_kernel'] = chosen
        print(name, 'gemv_kernel', chosen, flush=True)
        prompt, prefill = torch.randint(3, SHAPES[name]['vocab_size'], (1, PREFILL)), {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times = collections.defaultdict(list)
            prefill_ms(ours, prompt)  # a warm-up
            for r in range(2 * args.rounds):  # each first in half the rounds: a call after another
                for kernel in (None, 'blas')[::1 - 2 * (r % 2)]:  # pays for what that one freed
                    times[kernel or 'measured'].append(prefill_ms(ours, prompt, kernel))
            prefill[f'{threads}'] = {k: statistics.median(v) for k, v in times.items()}
        torch.set_num_threads(1)
        result['shapes'][name]['prefill_ms'] = prefill
        print(name, f'prefill of {PREFILL} tokens, ms', prefill, flush=True)
    # peers, interleaved: rounds outermost, so every system sees the same moments of the machine
    for name, (hf, ours) in shapes.items():  # compiled before the rounds reuse it: once per thread count, since
        ids = torch.randint(3, SHAPES[name]['vocab_size'], (1, PROMPT))  # Dynamo guards on torch's thread count
        compiles = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                compiles[f'{threads}'] = compile_seconds(ours, ids, NEW)
                generate(ours, ids, NEW, stop_ids=[], compile=PYTHON_WRAPPER)  # its graphs too, before the rounds
            compiles[f'{threads}']['later_process'] = later_process_compile(name, threads)  # the cache now filled
        result['shapes'][name]['compile'] = compiles
        print(name, 'compile', compiles, flush=True)
    for name, (hf, ours) in shapes.items():  # and the step with its weights in ordinary memory, compiled too
        ids = torch.randint(3, SHAPES[name]['vocab_size'], (1, PROMPT))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad(), small_pages(ours, small[name]): generate(ours, ids, NEW, stop_ids=[], compile=True)
    systems = ['package generate', 'package generate' + SMALL_PAGES, 'package generate (BLAS)', 'package static',
               'package compiled', 'package compiled' + SMALL_PAGES, 'package compiled (Python wrapper)',
               'transformers dynamic', 'transformers static', BARE]
    if args.llamacpp_python: systems.append('llama.cpp')
    rates, equal = collections.defaultdict(list), collections.defaultdict(list)
    pages = decoding.huge_page_buffer(2**30).view(torch.float32).fill_(1.0)  # round_read_rate's
    read_in_rounds = collections.defaultdict(list)  # (shape, threads) -> bytes/s, each round
    for r in range(args.rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, (hf, ours) in shapes.items():
                ids = torch.randint(3, SHAPES[name]['vocab_size'], (1, PROMPT), generator=torch.Generator().manual_seed(r))
                read_in_rounds[name, threads].append(round_read_rate(pages))
                with torch.no_grad():
                    got = {'package generate': ours_rate(ours, ids, NEW),
                           'package generate (BLAS)': ours_rate(ours, ids, NEW, kernel='blas'),
                           'package static': ours_rate(ours, ids, NEW, True),
                           'package compiled': ours_rate(ours, ids, NEW, compile=True),
                           'package compiled (Python wrapper)': ours_rate(ours, ids, NEW, compile=PYTHON_WRAPPER),
                           'transformers dynamic': hf_rate(hf, ids, NEW), 'transformers static': hf_rate(hf, ids, NEW, True)}
                    with small_pages(ours, small[name]):
                        got['package generate' + SMALL_PAGES] = ours_rate(ours, ids, NEW)
                        got['package compiled' + SMALL_PAGES] = ours_rate(ours, ids, NEW, compile=True)
                    rate, tokens = bare_rate(ours, False, ids)
                    got[BARE] = rate, torch.tensor([tokens])
                first = got['package generate'][1].tolist()
                for k, (_, t) in got.items(): equal[name, k].append(t.tolist() == first)
                for k, (rate, _) in got.items(): rates[name, threads, k].append(rate)
                if args.llamacpp_python: rates[name, threads, 'llama.cpp'].append(
                    llamacpp_rate(args.llamacpp_python, ggufs[name], threads))
                print(f'round {r} {name} {threads} thread(s): ' + ', '.join(
                    f'{k} {rates[name, threads, k][-1]:.1f}' for k in systems), flush=True)
    for name in shapes:
        s = result['shapes'][name]
        s['peers'] = {}
        for threads in (1, 2):
            bw = result['bandwidth'][f'{threads}_thread{"s" * (threads > 1)}']
            at_start = max(bw.values()) / s['bytes_a_token']
            # the limit: the read rate measured in the rounds (its median), beside the systems it bounds
            in_rounds = read_in_rounds[name, threads]
            limit = statistics.median(in_rounds) / s['bytes_a_token']
            row = {k: statistics.median(rates[name, threads, k]) for k in systems}
            s['peers'][f'{threads}'] = dict(limit_tok_s=limit, tok_s=row,
                                            fraction_of_limit={k: v / limit for k, v in row.items()},
                                            read_rate_each_round=in_rounds, limit_at_start_tok_s=at_start,
                                            runs={k: rates[name, threads, k] for k in systems})
        s['tokens_equal_package_generate'] = {k: all(equal[name, k]) for k in systems if k not in ('llama.cpp', BARE)}
        s['tokens_equal_bare_step'] = all(equal[name, BARE])  # another order of sums: a tie may differ
    # the target's pair alone, in close turns: the compiled step against llama.cpp, HEAD_TO_HEAD rounds, each
    # first in half of them (two threads share two cores with whatever else the machine runs, which comes and goes)
    if args.llamacpp_python:
        for name, (hf, ours) in shapes.items():
            ids = torch.randint(3, SHAPES[name]['vocab_size'], (1, PROMPT), generator=torch.Generator().manual_seed(0))
            pairs = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                runs = collections.defaultdict(list)
                for r in range(HEAD_TO_HEAD):
                    for system in ('package compiled', 'llama.cpp')[::1 - 2 * (r % 2)]:
                        with torch.no_grad():
                            runs[system].append(ours_rate(ours, ids, NEW, compile=True)[0] if system != 'llama.cpp'
                                                else llamacpp_rate(args.llamacpp_python, ggufs[name], threads))
                median = {k: statistics.median(v) for k, v in runs.items()}
                pairs[f'{threads}'] = dict(tok_s=median, ratio=median['package compiled'] / median['llama.cpp'],
                                           ratio_each_round=[a / b for a, b in zip(runs['package compiled'],
                                                                                   runs['llama.cpp'])],
                                           runs=dict(runs))
                print(name, threads, 'head to head', pairs[f'{threads}']['tok_s'], flush=True)
            torch.set_num_threads(1)
            result['shapes'][name]['head_to_head'] = pairs
    # what a token costs along the context and the batch, the package at 1 thread
    torch.set_num_threads(1)
    for name, (hf, ours) in shapes.items():
        longest = SHAPES[name].get('n_positions', SHAPES[name].get('max_position_embeddings'))
        costs = {}
        for context, batch in [(32, 1), (512, 1), (min(2048, longest) - NEW, 1), (32, 4), (32, 16)]:
            ids = torch.randint(3, SHAPES[name]['vocab_size'], (batch, context))
            with torch.no_grad(): ours_rate(ours, ids, NEW, compile=True)  # its graphs, before the rounds
            runs = collections.defaultdict(list)  # the systems in turns, round by round: a moment of the
            in_rounds = []                        # machine is shared, and the medians are compared
            for r in range(args.rounds):
                in_rounds.append(round_read_rate(pages))  # the limit, measured beside them
                with torch.no_grad():
                    runs['package'].append(ours_rate(ours, ids, NEW)[0])
                    runs['package compiled'].append(ours_rate(ours, ids, NEW, compile=True)[0])
                    runs['transformers dynamic'].append(hf_rate(hf, ids, NEW)[0])
                    runs['transformers static'].append(hf_rate(hf, ids, NEW, True)[0])
                if args.llamacpp_python and batch == 1:  # llama-cpp-python decodes one sequence
                    runs['llama.cpp'].append(llamacpp_rate(args.llamacpp_python, ggufs[name], 1, context))
            kv = 2 * len(ours.blocks) * ours.blocks[0].attn.num_kv_heads * ours.blocks[0].attn.head_dim * 4
            read = result['shapes'][name]['bytes_a_token'] + batch * (context + NEW // 2) * kv   # a step's bytes
            entry = costs[f'context {context}, batch {batch}'] = cost_entry(runs, read, batch,
                                                                            statistics.median(in_rounds))
            entry['read_rate_each_round'] = in_rounds
            print(name, context, batch, f"{entry['tok_s']:.1f} tok/s, compiled {entry['compiled']['tok_s']:.1f}",
                  entry['others'], flush=True)
        result['shapes'][name]['costs'] = costs
        result['shapes'][name]['profile'] = profile_step(ours)
        result['shapes'][name]['profile_blas'] = profile_step(ours, 'blas')
        result['shapes'][name]['profile_compiled'] = profile_compiled_step(ours)
        with small_pages(ours, small[name]):
            result['shapes'][name]['profile_compiled' + SMALL_PAGES] = profile_compiled_step(ours)
        ids = torch.randint(3, SHAPES[name]['vocab_size'], (1, PROMPT))
        reference = ours_rate(ours, ids, NEW)[1][0].tolist()
        head = {}
        for layout in ('row-major', 'column-major'):
            rate, tokens = bare_rate(ours, layout == 'column-major', ids)
            head[layout] = dict(tok_s=rate, tokens_equal=tokens == reference)
        result['shapes'][name]['headroom'] = head
        print(name, 'profile', result['shapes'][name]['profile'], 'headroom', head, flush=True)
    if not args.no_large: result['large'] = large_runs(pages, result['bandwidth'])
    load.append(os.getloadavg()[0])
    result['load_average_1min'] = load
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    print('wrote', args.out)


if __name__ == '__main__':
    main()
