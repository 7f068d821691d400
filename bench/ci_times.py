"""How long CI's steps take on a clean clone of this repository.

    python bench/ci_times.py [--out bench/ci.json] [--skip-site] [--quarto <folder with bin/quarto>] [--rev REV]

Clones the repository's HEAD (or --rev) into a temporary folder with `../shared` beside it, as CI does, and times the steps of
`.ci/run` one by one: `make install` (the virtual environment and the pinned tools), `make test`, `make test-slow`,
`make test-nbdev`, then `make docs` with smalldocs (no Quarto on PATH), `make docs` with Quarto when `--quarto` names
one, and `make test-site`. For each it records the wall-clock seconds, the CPU seconds of its child processes and,
for the pytest steps, pytest's own count and seconds, the coverage and the seconds of each notebook and test file
(pytest's --durations, setup, call and teardown summed; with two workers they overlap); for `make test-nbdev`, the
seconds of each notebook (`nbdev_test --timing`). `make test-quick`, the edit loop (warm, after `make test`), and
`make docs`, which `.ci/run` does not run (`make test-site` builds the site it walks), are timed too but are not CI
steps (`in_ci: false`, left out of the total). The Measurements page reads the JSON.
"""
import argparse, datetime, json, os, platform, re, resource, shlex, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.benchmark import cpu_model  # noqa: E402


def step(name: str, args: list, cwd: Path, env: dict, log: Path) -> dict:
    "Run one step; its seconds, its children's CPU seconds, and what pytest said of itself."
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (log/f'{name}.log').write_text(res.stdout + res.stderr)
    out = dict(command=shlex.join(args), seconds=round(seconds, 1), returncode=res.returncode,
               cpu_seconds=round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1))
    tail = (res.stdout + res.stderr)[-4000:]
    summary = re.findall(r'^=*\s*(\d+ passed.*?) in ([\d.]+)s', tail, re.M)
    if summary: out['pytest'], out['pytest_seconds'] = summary[-1][0], float(summary[-1][1])
    coverage = re.search(r'Total coverage: ([\d.]+)%', res.stdout)   # before --durations' list
    if coverage: out['coverage_percent'] = float(coverage.group(1))
    per_file = {}
    for seconds, where in re.findall(r'^([\d.]+)s (?:setup|call|teardown)\s+(\S+?)(?:::|\s|$)', res.stdout, re.M):
        per_file[where] = per_file.get(where, 0) + float(seconds)
    per_file.update({f'nbs/{nb}': float(t) for nb, t in re.findall(r'^(\S+\.ipynb): (\d+) secs$', res.stdout, re.M)})
    if per_file: out['seconds_by_file'] = dict(sorted(((k, round(v, 1)) for k, v in per_file.items()),
                                                      key=lambda kv: -kv[1]))
    print(f"{name:<14} {out['seconds']:7.1f} s  rc {res.returncode}  {out.get('pytest', '')}", flush=True)
    if res.returncode: print(tail, file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--out', default=str(ROOT/'bench'/'ci.json'))
    ap.add_argument('--quarto', help='a Quarto install (the folder holding bin/quarto) to time `make docs` with')
    ap.add_argument('--skip-site', action='store_true', help='leave out `make test-site` (the browser walk)')
    ap.add_argument('--rev', default='HEAD', help='the commit to clone and time (an earlier one, to compare)')
    a = ap.parse_args()
    commit = subprocess.run(['git', 'rev-parse', a.rev], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix='ci_times_'))
    log = work/'logs'; log.mkdir()
    (work/'shared').symlink_to((ROOT.parent/'shared').resolve())
    subprocess.run(['git', 'clone', '-q', str(ROOT), str(work/'main')], check=True)
    clone = work/'main'
    subprocess.run(['git', 'checkout', '-q', commit], cwd=clone, check=True)
    # no Quarto on PATH unless asked: CI's machine has none
    path = os.pathsep.join(p for p in os.environ['PATH'].split(os.pathsep) if not Path(p, 'quarto').exists())
    env = {k: v for k, v in os.environ.items() if not k.startswith(('VIRTUAL_ENV', 'PYTHON'))} | dict(PATH=path)
    result = dict(machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count()), python=platform.python_version(),
                  commit=commit[:12],
                  date=datetime.date.today().isoformat(), command=shlex.join(['python', 'bench/ci_times.py'] + sys.argv[1:]),
                  load_average_at_start=os.getloadavg()[0], steps={})
    timed = env | dict(PYTEST_ADDOPTS='--durations=0 --durations-min=0.5')   # each file's seconds
    steps = [('install', ['make', 'install'], env), ('test', ['make', 'test'], timed),
             ('test-quick', ['make', 'test-quick'], env),   # the edit loop, warm: after make test
             ('test-slow', ['make', 'test-slow'], timed), ('test-nbdev', ['make', 'test-nbdev'], env),
             ('docs', ['make', 'docs'], env)]
    if a.quarto:
        steps.append(('docs-quarto', ['make', 'docs'], env | dict(PATH=f"{Path(a.quarto)/'bin'}{os.pathsep}{path}")))
        steps.append(('docs', ['make', 'docs'], env))   # leave the smalldocs site for the walk, as CI builds it
    if not a.skip_site: steps.append(('test-site', ['make', 'test-site'], timed))
    for name, args, step_env in steps:
        if name == 'docs' and name in result['steps']:
            subprocess.run(args, cwd=clone, env=step_env, capture_output=True)
            continue
        result['steps'][name] = step(name, args, clone, step_env, log)
    torch_version = subprocess.run([str(clone/'.venv'/'bin'/'python'), '-c', 'import torch; print(torch.__version__)'],
                                   capture_output=True, text=True).stdout.strip()
    result['torch'] = torch_version
    result['load_average_at_end'] = os.getloadavg()[0]
    result['steps']['test-quick']['in_ci'] = False   # a contributor's loop, not CI's
    for name in ('docs', 'docs-quarto'):  # .ci/run builds no site of its own: test-site builds it, timed there
        if name in result['steps']: result['steps'][name]['in_ci'] = False
    result['total_seconds'] = round(sum(s['seconds'] for s in result['steps'].values() if s.get('in_ci', True)), 1)
    Path(a.out).write_text(json.dumps(result, indent=1) + '\n')
    shutil.rmtree(clone)  # its venv and builds: 1.6 GB a run; the logs stay, for a step that failed
    print(f"wrote {a.out}; total {result['total_seconds']} s; logs in {log} (commit {commit[:12]})")
    if any(s['returncode'] for s in result['steps'].values()): sys.exit(1)


if __name__ == '__main__':
    main()
