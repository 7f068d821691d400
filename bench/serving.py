"""Serving many at once, on this CPU: the package's Engine (paged cache, continuous batching, prefix caching) against
the package's padded batch (generate_stream with a static cache, batches of up to max_batch requests as they arrive)
and transformers' continuous batching (init_continuous_batching), on the same weights: a small random Llama that
transformers builds and from_hf reads. Five workloads: all at once; Poisson arrivals; a long tail of output lengths; a
KV budget smaller than a static batch needs; a shared prefix. Per run: useful tokens/s, time to first token and time
per output token (p50, p95), KV slots used over reserved, prefix hit rate, and whether every request's tokens are
those of generate on it alone. Rounds interleave the systems; the medians are kept, with the machine and its load.

    python bench/serving.py --out bench/serving.json     # about 3 minutes on 2 cores
"""
import argparse, datetime, json, os, platform, statistics, tempfile, time
from pathlib import Path

import torch

BLOCK, MAX_BATCH = 16, 8


def workloads(vocab: int) -> dict:
    "Each workload: prompts, max_new_tokens per request, arrival times (s), num_blocks for the paged systems."
    g = torch.Generator().manual_seed(0)
    rand = lambda lo, hi, n: torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in rand(16, 128, 24)]
    flat = [48] * 24
    gaps = torch.empty(24).exponential_(1 / 0.04, generator=g).tolist()      # a request every 40 ms on average
    arrivals = [sum(gaps[:i]) for i in range(24)]
    tail = [min(256, int(8 * 1.6 ** e)) for e in torch.empty(24).exponential_(0.6, generator=g).tolist()]
    static_need = MAX_BATCH * (128 + 48)                                  # one padded batch's slots
    prefix = torch.randint(1, vocab, (384,), generator=g)
    shared = [torch.cat([prefix, torch.randint(1, vocab, (n,), generator=g)]) for n in rand(8, 32, 16)]
    return {
        'all at once': dict(prompts=prompts, max_new=flat, arrivals=[0.0] * 24, num_blocks=512),
        'Poisson arrivals': dict(prompts=prompts, max_new=flat, arrivals=arrivals, num_blocks=512),
        'long tail of outputs': dict(prompts=prompts, max_new=tail, arrivals=[0.0] * 24, num_blocks=512),
        'KV budget of half a batch': dict(prompts=prompts, max_new=flat, arrivals=[0.0] * 24,
                                          num_blocks=static_need // 2 // BLOCK),
        'shared prefix': dict(prompts=shared, max_new=[32] * 16, arrivals=[0.0] * 16, num_blocks=512)}


def quantiles(xs: list) -> tuple:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
    return pick(0.5), pick(0.95)


def summary(w: dict, first: dict, times: dict, tokens: dict, wall: float, kv: float | None, hit: float | None,
            alone: list) -> dict:
    "The figures of one run from each request's token times (perf_counter) and tokens."
    n = len(w['prompts'])
    ttft = [first[i] - w['start'] - w['arrivals'][i] for i in range(n)]
    tpot = [(times[i][-1] - times[i][0]) / (len(times[i]) - 1) for i in range(n) if len(times[i]) > 1]
    useful = sum(len(tokens[i]) for i in range(n))
    equal = all(tokens[i] == alone[i] for i in range(n))
    (t50, t95), (p50, p95) = quantiles(ttft), quantiles(tpot)
    return dict(tokens_per_s=useful / wall, ttft_p50_ms=1e3 * t50, ttft_p95_ms=1e3 * t95,
                tpot_p50_ms=1e3 * p50, tpot_p95_ms=1e3 * p95, kv_used_over_reserved=kv, prefix_hit_rate=hit,
                tokens_equal=equal, useful_tokens=useful)


def wait_until(t: float):
    delay = t - time.perf_counter()
    if delay > 0: time.sleep(delay)


def run_engine(model, w: dict, alone: list) -> dict:
    from selfattn_nbdev.serving import Engine
    engine = Engine(model, w['num_blocks'], block_size=BLOCK, max_batch=MAX_BATCH)
    n, ids, kv = len(w['prompts']), {}, []
    first, times, tokens = {}, {i: [] for i in range(n)}, {i: [] for i in range(n)}
    w['start'] = start = time.perf_counter(); nxt = 0
    while nxt < n or engine.has_work():
        while nxt < n and start + w['arrivals'][nxt] <= time.perf_counter():
            ids[engine.add_request(w['prompts'][nxt], w['max_new'][nxt], stop_ids=[])] = nxt; nxt += 1
        if not engine.has_work(): wait_until(start + w['arrivals'][nxt]); continue
        events = engine.step(); now = time.perf_counter()
        for request, token, _ in events:
            i = ids[request]; tokens[i].append(token); times[i].append(now); first.setdefault(i, now)
        filled = {}                              # each held block's written slots, shared ones once
        for s in engine.running + engine.prefilling:
            for j, block in enumerate(s.blocks):
                filled[block] = max(filled.get(block, 0), min(BLOCK, s.length - j * BLOCK))
        if filled: kv.append(sum(filled.values()) / (len(filled) * BLOCK))
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in w['prompts'])
    hit = 1 - (engine.stats['prefill tokens'] - engine.stats['recomputed tokens']) / prompt_tokens
    return summary(w, first, times, tokens, wall, statistics.mean(kv), hit, alone)


def run_padded(model, w: dict, alone: list) -> dict:
    "Batches of up to MAX_BATCH of the requests that have arrived, each batch to its longest max_new_tokens."
    from selfattn_nbdev.decoding import generate_stream
    n, kv = len(w['prompts']), []
    first, times, tokens = {}, {i: [] for i in range(n)}, {i: [] for i in range(n)}
    w['start'] = start = time.perf_counter(); nxt = 0
    budget = w['num_blocks'] * BLOCK
    while nxt < n:
        wait_until(start + w['arrivals'][nxt])
        batch = []
        while (nxt < n and start + w['arrivals'][nxt] <= time.perf_counter() and len(batch) < MAX_BATCH):
            cap = max(len(w['prompts'][i]) for i in batch + [nxt]) + max(w['max_new'][i] for i in batch + [nxt])
            if batch and (len(batch) + 1) * cap > budget: break            # the static cache must fit the budget
            batch.append(nxt); nxt += 1
        steps = max(w['max_new'][i] for i in batch)
        cap = max(len(w['prompts'][i]) for i in batch) + steps
        kv.append(sum(len(w['prompts'][i]) + w['max_new'][i] for i in batch) / (len(batch) * cap))
        for step, row in enumerate(generate_stream(model, [w['prompts'][i] for i in batch], steps,
                                                   static=True, stop_ids=[])):
            now = time.perf_counter()
            for i, token in zip(batch, row.tolist()):
                if step < w['max_new'][i]:
                    tokens[i].append(token); times[i].append(now); first.setdefault(i, now)
    return summary(w, first, times, tokens, time.perf_counter() - start, statistics.mean(kv), 0.0, alone)


def run_transformers(hf, w: dict, alone: list) -> dict:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    n = len(w['prompts'])
    gc = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(w['max_new']))
    cb = ContinuousBatchingConfig(num_blocks=w['num_blocks'], max_batch_tokens=512, block_size=BLOCK)
    manager = hf.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
    manager.start()
    try:
        w['start'] = start = time.perf_counter(); created = {}
        for i in range(n):
            wait_until(start + w['arrivals'][i])
            manager.add_request(w['prompts'][i].tolist(), request_id=str(i), max_new_tokens=w['max_new'][i],
                                record_timestamps=True)
            created[i] = time.perf_counter()
        results = {}
        while len(results) < n:
            r = manager.get_result(timeout=30)
            if r is None: raise RuntimeError('transformers continuous batching stopped')
            if r.is_finished(): results[int(r.request_id)] = r
        wall = time.perf_counter() - start
    finally: manager.stop(block=True)
    first = {i: results[i].timestamps[0] for i in range(n)}
    times = {i: results[i].timestamps for i in range(n)}
    tokens = {i: list(results[i].generated_tokens) for i in range(n)}
    return summary(w, first, times, tokens, wall, None, None, alone)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out'); parser.add_argument('--rounds', type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    from selfattn_nbdev.decoding import generate
    from selfattn_nbdev.pretrained import from_hf
    logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0)).eval()
    with tempfile.TemporaryDirectory() as folder:  # from_hf reads the checkpoint whole: the folder can go
        hf.save_pretrained(folder)
        ours = from_hf(folder).eval()
    load = [os.getloadavg()[0]]
    work = workloads(256)
    alone = {name: [generate(ours, p[None], m, stop_ids=[])[0, len(p):].tolist()
                    for p, m in zip(w['prompts'], w['max_new'])] for name, w in work.items()}
    runs = {name: {s: [] for s in ('engine', 'padded', 'transformers')} for name in work}
    for _ in range(args.rounds):
        for name, w in work.items():
            runs[name]['engine'].append(run_engine(ours, w, alone[name]))
            runs[name]['padded'].append(run_padded(ours, w, alone[name]))
            runs[name]['transformers'].append(run_transformers(hf, w, alone[name]))
    load.append(os.getloadavg()[0])
    table = {}
    for name, systems in runs.items():
        table[name] = {}
        for system, rs in systems.items():
            row = {k: (statistics.median(r[k] for r in rs) if isinstance(rs[0][k], float) else rs[0][k])
                   for k in rs[0]}
            row['tokens_equal'] = all(r['tokens_equal'] for r in rs)
            table[name][system] = row
    result = dict(date=datetime.date.today().isoformat(), command='python bench/serving.py --out bench/serving.json',
                  machine=dict(cpu_model=next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo')
                                               if l.startswith('model name')), platform.processor()),
                               cpu_count=os.cpu_count()),
                  threads=torch.get_num_threads(), torch=torch.__version__, transformers=__import__('transformers').__version__,
                  load_average_1min=load, rounds=args.rounds, block_size=BLOCK, max_batch=MAX_BATCH,
                  model='Llama shape: hidden 256, 4 layers, 8 query / 2 key-value heads, vocabulary 256, float32',
                  workloads=table)
    for name, systems in table.items():
        print(name)
        for system, r in systems.items():
            kv = '-' if r['kv_used_over_reserved'] is None else f"{r['kv_used_over_reserved']:.2f}"
            print(f"  {system:13} {r['tokens_per_s']:8.0f} tok/s  ttft p50 {r['ttft_p50_ms']:7.1f} p95 "
                  f"{r['ttft_p95_ms']:7.1f} ms  tpot p50 {r['tpot_p50_ms']:6.2f} ms  kv {kv}  equal {r['tokens_equal']}")
    if args.out: Path(args.out).write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
