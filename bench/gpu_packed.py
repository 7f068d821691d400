"""On a CUDA GPU: packed documents against varlen flash attention, and training without padding (`unpad`).

    python bench/gpu_packed.py --out bench/gpu_packed.json   # on a CUDA GPU, bfloat16; merged into bench/gpu.json
    python bench/gpu_packed.py --small --out /tmp/p.json     # anywhere: tiny sizes, float32, checks the script
    python bench/gpu_packed.py --part unpad --out bench/cpu_unpad.json   # on a CPU: the padding-free part, float32,
                                                             # TinyGPT(4096, 1024, d_model 256, 4 heads, 4 blocks), batch 8

documents (`--part documents`): one causal `MultiHeadAttention` (d_model 2,048, 16 heads, batch 4, T = 8,192) on rows
packed with documents of random lengths (mean 1,024 tokens; they cross no row). Every contender runs from x: the
projections, the kernel and out_proj.
- ours: `m(x, document_ids=ids)`, the ids a tensor of the caller's (so the runs are found at every call);
- ours in a model: the same, with the ids as a model hands them to its blocks (`_share_across_blocks`): the runs are
  found once and kept while the copy is unwritten, so this is a block's cost inside a model;
- varlen: the same projections, `varlen_attn` on `cu_seqlens` computed once outside the timing, out_proj;
- flex: the same projections, compiled FlexAttention with `documents(ids)` and causal, its block mask built once
  outside the timing.
Forward under no_grad, and training: forward, then backward of a fixed random projection of the output.

padding-free (`--part unpad`): a GPT-2-small-shaped `TinyGPT` (12 blocks, d_model 768, 12 heads, vocabulary 32,000)
trained on a batch of 16 rows of 1,024 tokens, right-padded with random lengths (18 % padding on average), one step
(forward, cross-entropy over the real tokens, backward; no optimizer step):
- padded: `model(tokens)` over the whole batch, the loss on the real positions;
- unpad: `row = unpad(tokens, pad)`, `model(row.token_ids, document_ids=row.document_ids)`, the loss on
  `row.pack(targets)`: the unpadding and the search for the runs are inside the timing;
- hand-written: the same model's weights used by a loop written for packed tokens alone: embeddings of the packed
  tokens and positions, each block's norms, projections, `varlen_attn` on cu_seqlens computed once outside the
  timing, MLP; the head and the loss. On a CPU (no varlen kernel) both use SDPA run by run.
The losses of the three must agree (printed).

Times are medians of synchronized calls after a warm-up (which includes compiling); the JSON is written after every
case, so a run cut short keeps what it measured.
"""
import argparse, datetime, json, shlex, statistics, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from selfattn_nbdev.generation import TinyGPT  # noqa: E402
from selfattn_nbdev.masks import and_masks, causal, documents  # noqa: E402
from selfattn_nbdev.kernels import (_sdpa_by_run, _share_across_blocks, flex_mode,  # noqa: E402
                                    unpad, varlen_runs)
from selfattn_nbdev.multihead import MultiHeadAttention  # noqa: E402


def timed(fn, reps, cuda):
    "Median seconds of fn() after two warm-up calls."
    fn(); fn()
    if cuda: torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn()
        if cuda: torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel(cuda):
    "varlen_attn on CUDA; on a CPU (no varlen kernel there) the package's own form of it, SDPA run by run."
    if cuda:
        from torch.nn.attention.varlen import varlen_attn
    else: varlen_attn = _sdpa_by_run
    return lambda q, k, v, cu, longest: varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))


def document_ids(batch, T, mean, generator, device):
    "Rows of documents with lengths drawn around `mean`, each row cut at T."
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < T: lengths.append(int(torch.randint(mean // 4, 2 * mean, (1,), generator=generator)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:T])
    return torch.stack(rows).to(device)


def documents_part(cuda, device, dtype, small, save):
    batch, T, d, heads, mean = (4, 8192, 2048, 16, 1024) if not small else (2, 256, 64, 4, 32)
    reps = 20 if cuda else 2
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    m = MultiHeadAttention(d, d, T, num_heads=heads).to(device, dtype)
    x = torch.randn(batch, T, d, device=device, dtype=dtype, generator=None)
    ids = document_ids(batch, T, mean, g, device)
    runs = varlen_runs(None, ids)
    attend_varlen = kernel(cuda)
    hd = d // heads
    def projected(attend):
        q, k, v = m._project(x)                                      # (b, h, T, hd)
        pack = lambda t: t.transpose(1, 2).reshape(batch * T, heads, hd)
        out = attend(pack(q), pack(k), pack(v))                      # (b T, h, hd)
        return m.out_proj(out.view(batch, T, d))
    shared = _share_across_blocks(ids)      # as a model's blocks get them: the runs found once, then kept
    contenders = {
        'ours': lambda: m(x, document_ids=ids),
        'ours_in_a_model': lambda: m(x, document_ids=shared),
        'varlen': lambda: projected(lambda q, k, v: attend_varlen(q, k, v, runs.cu_seqlens, runs.longest)),
    }
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    block = create_block_mask(and_masks(causal, documents(ids)), batch, None, T, T, device=device)
    flex_kernel = torch.compile(flex_attention) if cuda else flex_attention
    def flex():                             # the block mask built once, outside the timing
        q, k, v = m._project(x)
        return m.out_proj(m._merge_heads(flex_kernel(q, k, v, block_mask=block)))
    contenders['flex'] = flex
    weight = torch.randn(batch, T, d, device=device, dtype=dtype)
    result = {'batch': batch, 'T': T, 'd_model': d, 'heads': heads, 'documents': int(runs.cu_seqlens.numel() - 1),
              'longest': runs.longest}
    with flex_mode('compiled' if cuda else 'eager'):
        with torch.no_grad():
            outs = {name: fn() for name, fn in contenders.items()}
            result['max_diff_vs_varlen'] = {name: (o.float() - outs['varlen'].float()).abs().max().item()
                                            for name, o in outs.items()}
            for name, fn in contenders.items():
                result[f'forward_{name}_s'] = timed(fn, reps, cuda)
                save(result)
        for name, fn in contenders.items():
            if name == 'flex' and not cuda: continue  # FlexAttention has no CPU backward
            def step(fn=fn):
                m.zero_grad(set_to_none=True)
                (fn() * weight).sum().backward()
            result[f'training_{name}_s'] = timed(step, reps, cuda)
            save(result)
    for phase in ('forward', 'training'):
        for name in ('ours', 'ours_in_a_model', 'flex'):
            if f'{phase}_{name}_s' in result: result[f'{phase}_{name}_over_varlen'] = result[f'{phase}_{name}_s'] / result[f'{phase}_varlen_s']
    save(result)
    return result


def hand_written(model, tokens, positions, cu, longest, targets, attend):
    "A training loss written for packed tokens alone, with the model's weights: (n,) in, a loss out."
    x = model.token_emb(tokens) + model.pos_emb(positions)                 # (n, d)
    for block in model.blocks:
        a = block.attn
        h = block.norm1(x)
        q, k, v = (w(h).view(len(h), a.num_heads, a.head_dim) for w in (a.W_query, a.W_key, a.W_value))
        x = x + a.out_proj(attend(q, k, v, cu, longest).reshape(len(h), -1))
        x = x + block.mlp(block.norm2(x))
    return F.cross_entropy(model.head(model.norm(x)), targets)


def unpad_part(cuda, device, dtype, small, save):
    vocab, T, d, heads, layers, batch = ((32000, 1024, 768, 12, 12, 16) if cuda else
                                         (64, 64, 32, 4, 2, 4) if small else (4096, 1024, 256, 4, 4, 8))
    reps = 10 if cuda else 2 if small else 5
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TinyGPT(vocab, T, d_model=d, num_heads=heads, num_layers=layers).to(device, dtype)
    lengths = T - torch.randint(0, int(0.36 * T) + 1, (batch,), generator=g)      # 18 % padding on average
    pad = (torch.arange(T) >= lengths[:, None]).to(device)
    tokens, targets = torch.randint(0, vocab, (2, batch, T), generator=g).to(device).unbind(0)
    real = ~pad
    def padded():
        logits = model(tokens)
        return F.cross_entropy(logits[real], targets[real])
    def unpadded():
        row = unpad(tokens, pad)
        logits = model(row.token_ids, document_ids=row.document_ids)
        return F.cross_entropy(logits[0], row.pack(targets)[0])
    row = unpad(tokens, pad)
    runs = varlen_runs(None, row.document_ids)
    packed_tokens, packed_positions, packed_targets = row.token_ids[0], row.positions[0], row.pack(targets)[0]
    attend = kernel(cuda)
    hand = lambda: hand_written(model, packed_tokens, packed_positions, runs.cu_seqlens, runs.longest,
                                packed_targets, attend)
    result = {'model': f'TinyGPT({vocab}, {T}, d_model={d}, num_heads={heads}, num_layers={layers})',
              'batch': batch, 'T': T, 'padding': 1 - real.float().mean().item()}
    contenders = {'padded': padded, 'unpad': unpadded, 'hand_written': hand}
    with torch.no_grad():
        result['loss'] = {name: fn().item() for name, fn in contenders.items()}
    print(result, flush=True)
    for name, fn in contenders.items():
        def step(fn=fn):
            model.zero_grad(set_to_none=True)
            fn().backward()
        result[f'training_{name}_s'] = timed(step, reps, cuda)
        save(result)
    result['unpad_over_hand_written'] = result['training_unpad_s'] / result['training_hand_written_s']
    result['padded_over_hand_written'] = result['training_padded_s'] / result['training_hand_written_s']
    result['padded_over_unpad'] = result['training_padded_s'] / result['training_unpad_s']
    save(result)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--small', action='store_true')
    ap.add_argument('--out', default=str(ROOT / 'bench' / 'gpu_packed.json'))
    ap.add_argument('--part', choices=('all', 'documents', 'unpad'), default='all')
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device, dtype = ('cuda', torch.bfloat16) if cuda else ('cpu', torch.float32)
    from bench.benchmark import cpu_model
    name = (torch.cuda.get_device_name() if cuda else
            f"{cpu_model()} CPU{' (small sizes)' if args.small else ''}, {torch.get_num_threads()} threads")
    result = {'device': name, 'torch': torch.__version__, 'dtype': str(dtype),
              'date': datetime.date.today().isoformat(),
              'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])}
    save = lambda: Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    for part, run in (('documents', documents_part), ('unpad', unpad_part)):
        if args.part in ('all', part):
            try: run(cuda, device, dtype, args.small, lambda r, part=part: (result.update({part: r}), save()))
            except Exception as e:                       # recorded; the next part runs
                result[part + '_error'] = f'{type(e).__name__}: {e}'[:800]
            print(part, json.dumps(result.get(part), indent=1), flush=True)
            if cuda: torch.cuda.empty_cache()
    save()


if __name__ == '__main__':
    main()
