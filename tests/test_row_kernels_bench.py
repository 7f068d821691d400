"""bench/row_kernels.py's own code: its `before` asks only the two probes of the rule before (1 row up to GEMV_ROWS,
GEMM_PROBE_ROWS above), its `by rows` asks each product's own rows, and both write the same greedy tokens."""
import pytest
import torch

from bench import row_kernels
from selfattn_nbdev import decoding
from selfattn_nbdev.models import Llama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason='a build without oneDNN')


def _model():
    torch.manual_seed(0)
    return Llama(vocab_size=64, context_length=128, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2).eval()


@pytest.mark.parametrize('before, asked', [(True, {1, decoding.GEMM_PROBE_ROWS}), (False, {4, 4 * row_kernels.PROMPT})])
def test_each_rule_asks_the_rows_it_names(before, asked, monkeypatch):
    seen, real = [], decoding.rows_kernel
    monkeypatch.setattr(decoding, 'rows_kernel',
                        lambda m, rows, linears=None: seen.append(rows) or real(m, rows, linears))
    patched = decoding.rows_kernel
    tok_s, tokens = row_kernels.rate(_model(), 4, before)
    assert set(seen) == asked and tok_s > 0 and len(tokens) == 4 and len(tokens[0]) == row_kernels.NEW + 1
    assert decoding.rows_kernel is patched                                # put back after the run


def test_choices_name_a_kernel_for_every_bucket():
    out = row_kernels.choices(_model())
    assert list(out) == [str(b) for b in row_kernels.BUCKETS]
    assert all(c['kernel'] in decoding.KERNELS and c['seconds'] >= 0 for c in out.values())
