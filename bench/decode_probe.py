"""Where the time of a compiled decode step goes (CUDA; with --small a tiny model on the CPU checks the script).

GPT-2 small's shape in bfloat16, one row, a 32-token prompt: the compiled step alone (replayed 200 times), the
same inside generate's loop, the eager step, and a profile of 20 compiled steps (the 15 costliest operations
on the CPU, and the number of CUDA kernels a step launches). Steps run back to back with one synchronisation at
the end, the rate a generation loop sees; generate's step_times are host times, which on CUDA say how fast the
host queues steps, not how fast the GPU runs them. Run with TORCH_LOGS=perf_hints to see why CUDA graphs would be
skipped."""
import argparse, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfattn_nbdev.generation import TinyGPT  # noqa: E402
from selfattn_nbdev.decoding import _decode_step, generate  # noqa: E402
from selfattn_nbdev.pretrained import GPT2  # noqa: E402


def per_step(fn, n, sync):
    "Seconds per call of fn over n calls, the device's work included."
    sync(); start = time.perf_counter()
    for _ in range(n): fn()
    sync(); return (time.perf_counter() - start) / n


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--small', action='store_true'); args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device, dtype = ('cuda', torch.bfloat16) if cuda else ('cpu', torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    model = (GPT2() if cuda else TinyGPT(64, 512, 32, 4, 2)).to(device, dtype).eval()
    prompt = torch.randint(0, model.vocab_size, (1, 32 if cuda else 8), device=device)
    n = 200 if cuda else 10
    options = True if cuda else dict(backend='eager', fullgraph=True)
    with torch.no_grad():
        for name, compile in (('eager', False), ('compiled', options)):
            caches = model.new_caches(prompt.shape[1] + 3 * n + 40, None)
            model(prompt, caches)
            step = _decode_step(model, compile)
            ids = prompt[:, -1:].clone()
            for _ in range(3): step(ids, caches)       # compiling, recording the graph
            alone = per_step(lambda: step(ids, caches), n, sync)
            print(f'{name} step alone: {alone * 1e3:.3f} ms', flush=True)
            if name == 'compiled':
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] +
                                            ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
                    for _ in range(20): step(ids, caches)
                    sync()
                print(prof.key_averages().table(sort_by='cpu_time_total', row_limit=15), flush=True)
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                print(f'CUDA kernels per step: {len(kernels) / 20:.1f}', flush=True)
                from torch._dynamo.utils import counters
                print('dynamo/inductor counters:', {k: dict(v) for k, v in counters.items() if v}, flush=True)
        times = []
        generate(model, prompt, 64, compile=options, step_times=times)
        times = []
        generate(model, prompt, 256, compile=options, step_times=times)
        times.sort()
        print(f'generate(compile=...): median step {times[len(times) // 2] * 1e3:.3f} ms, '
              f'mean {sum(times) / len(times) * 1e3:.3f} ms', flush=True)


if __name__ == '__main__':
    main()
