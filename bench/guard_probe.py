"""What the padding guard of MultiHeadAttention.forward costs (on CUDA: batch 8, T = 8,192, d_model 1,024,
bfloat16, 22 % padded; --small or no GPU: tiny sizes on the CPU, to check the script): setting non-finite padded
values to 0 as masked_fill of (padding & not finite), as torch.where with nan_to_num (what forward does), and,
for scale, a plain masked_fill of every padded value. Times are medians of bench/gpu.py's `timed`."""
import argparse, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu import timed  # noqa: E402

ap = argparse.ArgumentParser(); ap.add_argument('--small', action='store_true')
cuda = torch.cuda.is_available() and not ap.parse_args().small
B, T, d = (8, 8192, 1024) if cuda else (2, 256, 64)
device, dtype = ('cuda', torch.bfloat16) if cuda else ('cpu', torch.float32)
x = torch.randn(B, T, d, device=device, dtype=dtype)
pad = (torch.arange(T, device=device) >= int(T * 0.78)).expand(B, T)[..., None]
ms = lambda fn: timed(fn, 50, cuda)[0] * 1e3
print('guard isfinite %.3f ms; masked_fill pad only %.3f ms; nan_to_num where %.3f ms' % (
    ms(lambda: x.masked_fill(pad & ~x.isfinite(), 0.0)), ms(lambda: x.masked_fill(pad, 0.0)),
    ms(lambda: torch.where(pad, x.nan_to_num(0.0, 0.0, 0.0), x))))
