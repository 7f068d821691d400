"""bench/gpu.py runs anywhere with --small (here on CPU) and writes its JSON with the device's name."""
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
