"""Every check `make test` runs, each reported on its own, then one summary line.

    python tools/check.py            # all checks (what CI runs)
    python tools/check.py --quick    # skip notebook cells flagged `#| slow`

A check fails when: `nbdev_export` would change the package, `nbdev_clean` would change a notebook,
README.md is not the render of nbs/index.ipynb, a notebook cell raises (`nbdev_test`), an output saved in a
notebook is not what its code prints now, the site has a broken link, or pytest fails.
"""
import argparse, filecmp, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*cmd, cwd=ROOT, env=None) -> int:
    print('$', ' '.join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env).returncode


# Notebooks run side by side, one process per core: each torch with one thread, or they oversubscribe the cores
# (measured on 2 cores: nbdev_test 83 s with torch's default threads, 21 s with one).
ONE_THREAD = {**os.environ, 'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS', '1')}


def _tracked_copy(dst: Path) -> None:
    "Copy the files git would commit (tracked, plus untracked ones not ignored) into `dst`."
    files = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split('\0')
    for f in filter(None, files):
        src = ROOT/f
        if src.is_file():
            (dst/f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst/f)


def _diff(a: Path, b: Path, rel: str, pattern: str = '*') -> list[str]:
    "Files under `rel` matching `pattern` that differ between trees `a` and `b` (ignoring caches)."
    out = []
    for d in [a/rel, b/rel]:
        if not d.exists(): return [rel]
    names = set()
    for tree in (a, b):
        names |= {p.relative_to(tree).as_posix() for p in (tree/rel).rglob(pattern) if p.is_file() and '__pycache__' not in p.parts}
    for n in sorted(names):
        if not ((a/n).exists() and (b/n).exists() and filecmp.cmp(a/n, b/n, shallow=False)): out.append(n)
    return out


def check_sync() -> int:
    "Run nbdev_export and nbdev_clean in a scratch copy; the working tree must already be what they produce."
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _tracked_copy(tmp)
        for tool in ['nbdev_export', 'nbdev_clean']:
            if subprocess.run([BIN/tool], cwd=tmp, capture_output=True).returncode:
                print(f'{tool} failed in a clean copy'); return 1
        stale = _diff(ROOT, tmp, 'selfattn_nbdev') + _diff(ROOT, tmp, 'nbs', '*.ipynb')
        if not filecmp.cmp(ROOT/'pyproject.toml', tmp/'pyproject.toml', shallow=False): stale.append('pyproject.toml')
    if stale:
        print('out of sync with the notebooks (run `make export` and commit):\n  ' + '\n  '.join(stale))
        return 1
    print('package and notebooks are in sync; notebooks are clean')
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument('--quick', action='store_true', help='skip notebook cells flagged `slow`')
    args = ap.parse_args()
    py = sys.executable
    steps = [
        ('generated files in sync', check_sync),
        ('README.md is the render of nbs/index.ipynb', lambda: run(py, 'tools/docs.py', 'readme', '--check')),
        ('notebooks run (nbdev_test)',
         lambda: run(BIN/'nbdev_test', *([] if args.quick else ['--flags', 'slow']), env=ONE_THREAD)),
        ('saved outputs match fresh ones', lambda: run(py, 'tools/check_outputs.py')),
        ('site builds with no broken link', lambda: run(py, 'tools/docs.py', 'check')),
        ('pytest (line coverage of the package >= 95 %)',
         lambda: run(py, '-m', 'pytest', '-q', 'tests', '--cov=selfattn_nbdev', '--cov-report=term', '--cov-fail-under=95')),
    ]
    results = []
    for name, step in steps:
        print(f'\n=== {name}', flush=True)
        t0 = time.time()
        ok = step() == 0
        results.append((name, ok, time.time() - t0))
    print('\n=== summary')
    for name, ok, secs in results: print(f"{'PASS' if ok else 'FAIL'}  {name}  ({secs:.1f}s)")
    failed = sum(not ok for _, ok, _ in results)
    print(f'checks: {len(results) - failed} passed, {failed} failed')
    return 1 if failed else 0


if __name__ == '__main__':
    os.chdir(ROOT)
    sys.exit(main())
