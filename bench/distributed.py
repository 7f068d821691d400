"""Benchmark: what attention split across gloo CPU ranks sends, and how long a step takes.

    python bench/distributed.py           # writes bench/distributed.json
    python bench/distributed.py --small   # 64 and 256 tokens, printed only: checks the bench runs (make test-slow)

Measured on this machine, every rank a process forked from run_ranks's server, all on 127.0.0.1:
- tensor parallelism: one `MultiHeadAttention` (d 512, 8 heads, 2 key/value heads, 512 tokens, batch 1) split by
  `tensor_parallel` over 2 ranks against the whole module in one process; per forward + backward step, the bytes
  of the whole tensor every collective works on (an all-reduce's tensor, an all-gather's output, a reduce-scatter's
  input; counted by a dispatch mode that sees each `c10d` / `_c10d_functional` call; the input x requires a
  gradient, as the output of an earlier layer does) and
  the median time of 10 steps after 2 warm-up steps;
- ring attention: 8 query heads and 2 key/value heads of 64 dims over 2,048 tokens split over R = 2 and 4 ranks
  (zig-zag, causal) against `tiled_attention` on the whole sequence in one process (key/value heads repeated);
  the bytes each rank hands to `_pass_on` (blocks and their gradients) and the median time of 5 forward +
  backward steps after one warm-up step; and the bytes of one step with the key/value heads repeated to 8
  before the ring, as a ring without GQA would send them;
- FSDP2: the same attention sharded by `fully_shard` over 2 ranks; bytes per forward + backward step.
Printed and saved, never asserted here: the Measurements page (nbs/95_measurements.ipynb) reads the file, and
tests/test_distributed.py and tests/test_ring.py check that its byte counts are the formulas of the two pages.
"""
import argparse, datetime, json, platform, shlex, statistics, sys, time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import selfattn_nbdev.distributed as D  # noqa: E402
import selfattn_nbdev.ring as RA  # noqa: E402
from selfattn_nbdev.multihead import MultiHeadAttention  # noqa: E402
from selfattn_nbdev.tiled import tiled_attention  # noqa: E402

MHA = dict(d_in=512, d_out=512, context_length=512, num_heads=8, num_kv_heads=2, out_bias=False)
RING = dict(num_tokens=2048, heads=8, kv_heads=2, head_dim=64)


class CountBytes(TorchDispatchMode):
    "Sum the bytes of the tensors handed to every collective (c10d and functional collectives)."
    def __init__(self):
        super().__init__(); self.bytes, self.calls = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split('.')[0]
        if func.namespace in ('c10d', '_c10d_functional') and not name.startswith(('wait', '_wrap')):
            flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
            self.bytes += max(t.nbytes for t in flat if isinstance(t, torch.Tensor))  # the whole tensor
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def timed(step, repeats: int, warmup: int) -> float:
    for _ in range(warmup): step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tp_rank(rank: int, world_size: int, mha: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh('cpu', (world_size,))
    torch.manual_seed(0)
    whole = MultiHeadAttention(**mha)
    split = D.tensor_parallel(MultiHeadAttention(**mha), mesh)
    x = torch.randn(1, mha['context_length'], mha['d_in'], requires_grad=True)
    step = lambda m: lambda: m(x).pow(2).mean().backward()
    counter = CountBytes()
    with counter: step(split)()
    return {'bytes': counter.bytes, 'calls': counter.calls,
            'time_split': timed(step(split), 10, 2), 'time_whole': timed(step(whole), 10, 2)}


def fsdp_rank(rank: int, world_size: int, mha: dict) -> dict:
    import warnings
    from torch.distributed.fsdp import fully_shard
    warnings.filterwarnings('ignore', 'FSDP2-wrapped module')
    torch.manual_seed(0)
    sharded = MultiHeadAttention(**mha)
    fully_shard(sharded)
    x = torch.randn(1, mha['context_length'], mha['d_in'], requires_grad=True)
    counter = CountBytes()
    with counter: sharded(x).pow(2).mean().backward()
    return {'bytes': counter.bytes, 'calls': counter.calls,
            'time': timed(lambda: sharded(x).pow(2).mean().backward(), 10, 2)}


def ring_rank(rank: int, world_size: int, ring: dict) -> dict:
    T, h, kv, hd = ring['num_tokens'], ring['heads'], ring['kv_heads'], ring['head_dim']
    torch.manual_seed(0)
    whole = [torch.randn(1, h, T, hd), torch.randn(1, kv, T, hd), torch.randn(1, kv, T, hd)]
    mine = [RA.shard_sequence(t, rank, world_size).requires_grad_() for t in whole]
    sent, pass_on = [0], RA._pass_on
    def counting(t, group=None, tag=0):
        sent[0] += t.nbytes
        return pass_on(t, group, tag)
    RA._pass_on = counting
    step = lambda q, k, v: lambda: RA.ring_attention(q, k, v, causal=True).pow(2).mean().backward()
    step(*mine)()
    bytes_sent = sent[0]
    repeated = [mine[0]] + [RA._share_heads(t.detach(), h // kv).requires_grad_() for t in mine[1:]]
    sent[0] = 0; step(*repeated)()
    bytes_repeated = sent[0]
    t_ring = timed(step(*mine), 5, 1)
    whole = [whole[0]] + [RA._share_heads(t, h // kv) for t in whole[1:]]
    whole = [t.requires_grad_() for t in whole]
    t_whole = timed(lambda: tiled_attention(*whole, causal=True, block_size=T // (2 * world_size))
                    .pow(2).mean().backward(), 5, 1) if rank == 0 else None
    return {'bytes': bytes_sent, 'bytes_heads_repeated': bytes_repeated, 'time_ring': t_ring,
            'time_whole': t_whole}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--small', action='store_true', help='small sizes, printed and not saved')
    small = parser.parse_args().small
    mha = dict(MHA, context_length=64) if small else MHA
    ring = dict(RING, num_tokens=256) if small else RING
    out = {'torch': torch.__version__, 'machine': platform.machine(), 'mha': mha, 'ring_config': ring,
           'tp': D.run_ranks(tp_rank, 2, mha, timeout=300)[0],
           'fsdp': D.run_ranks(fsdp_rank, 2, mha, timeout=300)[0],
           'ring': {R: D.run_ranks(ring_rank, R, ring, timeout=300) for R in (2, 4)},
           'date': datetime.date.today().isoformat(),
           'command': shlex.join(['python', 'bench/' + Path(__file__).name, *sys.argv[1:]])}
    if not small: Path(__file__).with_suffix('.json').write_text(json.dumps(out, indent=1) + '\n')
    print(json.dumps(out, indent=1))


if __name__ == '__main__':  # the ranks need the functions from an importable module, not __main__
    from bench import distributed
    distributed.main()
