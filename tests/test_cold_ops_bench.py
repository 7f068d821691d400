"""bench/cold_ops.py's own code: every operator runs at the shape it names, and a measurement has a median for every
operator and every column."""
import torch

from bench import cold_ops


def test_every_operator_runs_at_the_llama_shape():
    out = {name: op() for name, op in cold_ops.operators().items()}
    H, KV, hd, D = cold_ops.HEADS, cold_ops.KV_HEADS, cold_ops.HD, cold_ops.D
    assert out['attention'].shape == out['RoPE'].shape == (1, H, 1, hd)
    assert out['split heads'].shape == (1, H, 1, hd) and out['rms_norm'].shape == (1, 1, D)
    assert out['cache write'].shape == (1, KV, 2 * cold_ops.CACHED, hd)


def test_a_measurement_has_every_operator_and_column():
    result = cold_ops.measure(rounds=1)
    columns = ['hot', 'after 1 MiB', 'after 4 MiB', 'after 22 MiB', 'after 128 MiB', 'again']
    assert list(result) == list(cold_ops.operators())
    for row in result.values():
        assert list(row) == columns and all(t > 0 for t in row.values())
