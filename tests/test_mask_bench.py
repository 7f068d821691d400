"""The benchmarks run anywhere with --small (here on CPU): bench/gpu.py writes its JSON with the device's name; the GPU probes
and bench/distributed.py print theirs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_bench_runs_small_on_cpu(tmp_path):
    out = tmp_path / 'gpu.json'
    subprocess.run([sys.executable, str(ROOT / 'bench' / 'gpu.py'), '--small', '--out', str(out)], check=True,
                   capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result['device'].startswith('CPU') and len(result['rows']) == 7
    assert all(r['ours_s'] > 0 and r['best_s'] > 0 for r in result['rows'])


@pytest.mark.slow
def test_packed_bench_runs_small_on_cpu(tmp_path):
    "bench/gpu_packed.py --small: every contender runs, and the padded, unpadded and hand-written losses agree."
    out = tmp_path / 'packed.json'
    subprocess.run([sys.executable, str(ROOT / 'bench' / 'gpu_packed.py'), '--small', '--out', str(out)],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert not [k for k in result if k.endswith('_error')], result
    assert max(result['documents']['max_diff_vs_varlen'].values()) < 1e-5
    losses = list(result['unpad']['loss'].values())
    assert len(losses) == 3 and max(losses) - min(losses) < 1e-5
    assert all(result['unpad'][f'training_{n}_s'] > 0 for n in ('padded', 'unpad', 'hand_written'))


def gpu_decode_small(part: str, tmp_path) -> dict:
    "Run bench/gpu_decode.py --small --part `part` here; what it wrote under `part`."
    out = tmp_path / f'{part}.json'
    subprocess.run([sys.executable, str(ROOT / 'bench' / 'gpu_decode.py'), '--small', '--part', part, '--out',
                    str(out)], check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())[part]


@pytest.mark.slow
def test_gpu_decode_graphs_part_runs_small_on_cpu(tmp_path):
    "bench/gpu_decode.py --part graphs --small: both ways of replaying the step write the same tokens."
    graphs = gpu_decode_small('graphs', tmp_path)
    assert graphs and all(r['same_tokens'] for r in graphs.values())


@pytest.mark.slow
def test_gpu_decode_stacked_part_runs_small_on_cpu(tmp_path):
    "bench/gpu_decode.py --part stacked --small: separate and stacked products write the same tokens, both timed."
    rows = gpu_decode_small('stacked', tmp_path)
    assert len(rows) == 2 and all(r['same_tokens'] and 'error' not in r for r in rows.values())
    assert all(r['separate step_ms'] > 0 and r['stacked step_ms'] > 0 for r in rows.values())
    assert all(r['profile stacked'] and r['profile stacked'][0]['us_per_step'] > 0 for r in rows.values())


@pytest.mark.slow
@pytest.mark.parametrize('probe', ['blockmask_probe', 'guard_probe', 'decode_probe'])
def test_gpu_probes_run_small_on_cpu(probe):
    "The probes bench/gpu_run.sh runs on a GPU also run here with --small, so a GPU session does not find them broken."
    res = subprocess.run([sys.executable, str(ROOT / 'bench' / f'{probe}.py'), '--small'], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert ' ms' in res.stdout


@pytest.mark.slow
def test_distributed_bench_runs_small():
    "bench/distributed.py starts its ranks from an importable module (run_ranks refuses __main__'s functions); GQA's bytes."
    res = subprocess.run([sys.executable, str(ROOT / 'bench' / 'distributed.py'), '--small'], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out['tp']['calls'] == {'all_reduce': 4}
    for per_rank in out['ring'].values():   # 8 query heads, 2 key/value heads: a quarter of the bytes
        assert per_rank[0]['bytes_heads_repeated'] == 4 * per_rank[0]['bytes'] > 0


@pytest.mark.slow
def test_many_lengths_compile_a_few_graphs_not_one_per_length(tmp_path):
    "bench/lengths.py --small: 20 new lengths on the compiled path; dynamic shapes compile a few graphs, not 20."
    out = tmp_path / 'lengths.json'
    res = subprocess.run([sys.executable, str(ROOT / 'bench' / 'lengths.py'), '--small', '--out', str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {'date', 'command', 'machine', 'torch'} <= set(result)
    for kind, run in result['runs'].items():
        calls = run['calls']
        assert len(calls) == 21 and len({c["T"] for c in calls}) == 20, kind
        assert sum(c['compiled'] for c in calls) <= 8, (kind, [c['compiled'] for c in calls])
        assert not any(c['compiled'] for c in calls[4:]), kind       # nothing new after the first lengths


@pytest.mark.slow
def test_the_checkpoint_benchmarks_run_small(tmp_path):
    "bench/families.py and bench/load_memory.py --small: every family loads, agrees and is timed; the loads are measured."
    out = tmp_path / 'families.json'
    res = subprocess.run([sys.executable, str(ROOT / 'bench' / 'families.py'), '--small', '--out', str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result['families']) == 8
    for name, r in result['families'].items():
        assert 'error' not in r, (name, r)
        assert r['logits_relative_difference'] <= 1e-5 and r['same_tokens'], name
        assert r['prefill']['ratio'] > 0 and r['decode']['ratio'] > 0, name
    out = tmp_path / 'load_memory.json'
    res = subprocess.run([sys.executable, str(ROOT / 'bench' / 'load_memory.py'), '--small', '--out', str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert set(json.loads(out.read_text())['runs']) == {'from_hf', 'copied', 'transformers'}


@pytest.mark.slow
def test_gpu_round_parts_run_small_on_cpu(tmp_path):
    """bench/gpu_round.py --small, every part the GPU round runs: each writes its rows without an error; the paged
    step's logits are the contiguous cache's (each row's blocks scattered through the pool)."""
    out = tmp_path / 'round.json'
    subprocess.run([sys.executable, str(ROOT / 'bench' / 'gpu_round.py'), '--small', '--part',
                    'linear,paged,sinks,mla', '--out', str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert {'linear', 'paged', 'sinks', 'mla'} <= set(result), sorted(result)
    assert not [k for k in result if k.endswith('_error')], result   # a part that raised
    rows = result['paged']['rows']
    assert set(rows) == {'40', '100'} and not [r for r in rows.values() if 'error' in r], rows
    assert all(r['logits_paged_vs_contiguous'] < 1e-4 for r in rows.values())
    assert all(r['paged_step_ms'] > 0 and r['contiguous_step_ms'] > 0 for r in rows.values())
