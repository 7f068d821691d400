"""Re-execute every notebook and compare the outputs saved in it with fresh ones.

The site shows the outputs saved in the notebooks, so a saved output that the code no longer produces is a
lie on the site. This check runs each notebook from top to bottom (with nbdev's execution engine, execnb) and
compares, cell by cell:
- text outputs (results, prints, stderr), after normalising what legitimately varies: memory addresses,
  object ids, durations; numbers are compared to the precision they are printed with (one unit in the
  last printed digit);
- figures, by presence and pixel size within 2 % (not pixel values: tight bounding boxes move by a pixel).

    python tools/check_outputs.py [NOTEBOOK ...]    # default: every notebook in nbs/
"""
import base64, difflib, os, re, struct, sys, time
from pathlib import Path

from execnb.nbio import read_nb
from execnb.shell import CaptureShell

ROOT = Path(__file__).resolve().parents[1]
NUM = re.compile(r'-?\d+\.\d+(?:e[+-]?\d+)?|-?\d+(?:e[+-]?\d+)?|-?inf\b|nan\b', re.I)
VARIES = [(re.compile(r'0x[0-9a-fA-F]+'), '0x…'),                                   # memory addresses
          (re.compile(r'\b\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|s|sec|seconds|min)\b'), '<time>'),  # durations
          (re.compile(r'\bid=\d+'), 'id=…')]


def _text(x) -> str: return ''.join(x) if isinstance(x, list) else (x or '')


def _png_size(b64: str) -> tuple[int, int]:
    raw = base64.b64decode(_text(b64))
    return struct.unpack('>II', raw[16:24])


def summarise(outputs) -> list[tuple]:
    "The comparable content of a cell's outputs: ('text', normalised string) or ('image', mime, size)."
    res = []
    for o in outputs:
        kind = o.get('output_type')
        if kind == 'stream': res.append(('text', o.get('name'), _text(o.get('text'))))
        elif kind == 'error': res.append(('text', 'error', f"{o.get('ename')}: {o.get('evalue')}"))
        else:
            data = o.get('data', {})
            if 'image/png' in data: res.append(('image', 'image/png', _png_size(data['image/png'])))
            elif 'image/svg+xml' in data: res.append(('image', 'image/svg+xml', None))
            elif 'text/markdown' in data: res.append(('text', 'markdown', _text(data['text/markdown'])))
            elif 'text/plain' in data: res.append(('text', 'plain', _text(data['text/plain'])))
    out = []
    for r in res:
        if r[0] == 'text':
            t = r[2]
            for pat, rep in VARIES: t = pat.sub(rep, t)
            out.append(('text', r[1], t.rstrip()))
        else: out.append(r)
    return out


def _decimals(s: str) -> int:
    m = re.match(r'-?\d+\.(\d+)', s)
    return len(m.group(1)) if m else 0


def same_text(saved: str, fresh: str) -> bool:
    "Equal once numbers are compared to the precision they are printed with."
    if NUM.sub('#', saved) != NUM.sub('#', fresh): return False
    for a, b in zip(NUM.findall(saved), NUM.findall(fresh)):
        if a == b: continue
        try: fa, fb = float(a), float(b)
        except ValueError: return False
        if fa != fa and fb != fb: continue  # nan == nan
        tol = 10 ** -max(_decimals(a), _decimals(b)) * 1.01
        if 'e' in a.lower() or 'e' in b.lower(): tol = max(abs(fa), abs(fb)) * 1e-3
        if abs(fa - fb) > tol: return False
    return True


def same_size(a, b) -> bool:
    "Two pictures' (width, height) agree within 2 %."
    if a is None or b is None: return a == b
    return all(abs(x - y) <= 0.02 * max(x, y) for x, y in zip(a, b))


def check_notebook(path: Path) -> tuple[int, list[str]]:
    "Run `path`; return the number of outputs compared and a list of problems (cell number and a diff)."
    saved = read_nb(path)
    fresh = read_nb(path)
    cwd = os.getcwd(); os.chdir(path.parent)
    try:
        shell = CaptureShell(path)
        shell.run_all(fresh, exc_stop=True)
    except Exception as e:
        return 0, [f'{path.name}: the notebook raised while running: {e!r}']
    finally: os.chdir(cwd)
    compared, problems = 0, []
    for i, (a, b) in enumerate(zip(saved.cells, fresh.cells)):
        if a.cell_type != 'code': continue
        sa, sb = summarise(a.get('outputs', [])), summarise(b.get('outputs', []))
        compared += len(sa)
        ok = len(sa) == len(sb) and all(x[:2] == y[:2] and (same_text(x[2], y[2]) if x[0] == 'text' else same_size(x[2], y[2]))
                                        for x, y in zip(sa, sb))
        if ok: continue
        fmt = lambda s: [f'{k}[{n}]: {v}' for k, n, v in s]
        diff = '\n'.join(difflib.unified_diff('\n'.join(fmt(sa)).splitlines(), '\n'.join(fmt(sb)).splitlines(),
                                              'saved', 'fresh', lineterm=''))
        src = ''.join(a.source).strip().splitlines()
        problems.append(f"{path.name}, cell {i} ({src[0][:60] if src else ''}...):\n{diff}")
    return compared, problems


def main(paths: list[str]) -> int:
    nbs = [Path(p).resolve() for p in paths] or sorted((ROOT/'nbs').glob('*.ipynb'))
    total, problems = 0, []
    for nb in nbs:
        t0 = time.time()
        n, probs = check_notebook(nb)
        total += n; problems += probs
        print(f"{'ok  ' if not probs else 'FAIL'} {nb.name}: {n} outputs compared ({time.time()-t0:.1f}s)", flush=True)
    for p in problems: print('\n' + p)
    print(f"\n{total} saved outputs compared over {len(nbs)} notebooks; {len(problems)} cell(s) differ")
    if problems: print('Re-run the notebook(s) and save them (then `make export`), or fix the code.')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
