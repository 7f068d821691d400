# No library fits: nbmake only runs notebooks; nbval and pytest-notebook compare outputs exactly or by regex (not numbers to their printed precision, not figures by size) and ignore nbdev's `#|` flags.
"""pytest plugin (loaded by conftest.py): each notebook in nbs/ is one test, run once for three checks.

The notebook runs as `nbdev_test --flags slow` runs it: with nbdev's engine (execnb), from its own folder, skipping
`#| eval: false` and `nbdev_export()` cells and notebooks whose front matter says `skip_exec`; with `--quick`, cells
flagged with settings.ini's `tst_flags` (`#| slow`) are skipped too, as plain `nbdev_test` skips them. The test
fails at the first cell that raises; then if the notebook leaves the process changed for the next one that
`nbdev_test` would run in it (`leaks`: torch's switches, the package's names), which is what running them one after
another in a process catches; otherwise every code cell's fresh outputs are compared with the ones saved in the
notebook, which are what the site shows:
- text (results, prints, stderr) after normalising what legitimately varies (memory addresses, object ids,
  durations, and rates such as GB/s), with numbers compared to the precision they are printed with (one unit in the last printed digit);
- figures by presence and pixel size within 2 % (not pixel values: tight bounding boxes move by a pixel).
A failure names each cell (numbered from 1, as nbdev does), the head of its source and a diff.
"""
import base64, difflib, os, re, struct, traceback
from pathlib import Path

import pytest
from execnb.nbio import read_nb
from fastcore.basics import str2bool
from nbdev.config import get_config
from nbdev.frontmatter import FrontmatterProc
from nbdev.process import NBProcessor, extract_directives, nb_lang

ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    group = parser.getgroup('notebooks')
    group.addoption('--quick', action='store_true', help="skip notebook cells flagged with settings.ini's tst_flags (`#| slow`)")
    group.addoption('--cell-times', metavar='FILE', help='append each code cell\'s seconds to FILE, one tab-separated '
                    'line a cell: notebook, cell number (from 1, as nbdev counts), seconds, its first line of code')


def pytest_configure(config):
    config.addinivalue_line('markers', 'notebook: a notebook of nbs/, run and its saved outputs compared')


def pytest_collect_file(file_path: Path, parent):
    "The notebooks `nbdev_test` would test: under nbs/, no part of the path starting with `_` or `.`, no `.notest`."
    nbs = get_config(path=ROOT).nbs_path
    if file_path.suffix != '.ipynb' or not file_path.is_relative_to(nbs): return None
    if any(p.startswith(('_', '.')) for p in file_path.relative_to(nbs).parts): return None
    if (file_path.parent/'.notest').exists(): return None
    return NotebookFile.from_parent(parent, path=file_path)


class NotebookFile(pytest.File):
    def collect(self): yield Notebook.from_parent(self, name=self.path.stem)


class NotebookFailure(Exception): pass


def _head(cell) -> str:
    "The cell's first line of code, to find it by."
    line = next((l for l in cell.source.splitlines() if l.strip() and not l.startswith('#|')), '(no code)')
    return line if len(line) <= 60 else line[:59] + '…'


def _cell_traceback(e: BaseException) -> str:
    "The traceback of `e` from the notebook cell's own frame on (execnb's and IPython's frames left out)."
    tb = e.__traceback__
    while tb and not tb.tb_frame.f_code.co_filename.startswith('<'): tb = tb.tb_next
    return ''.join(traceback.format_exception(type(e), e, tb or e.__traceback__))


def skipped(cell, flags: set) -> bool:
    "Whether nbdev_test would skip `cell` (nbdev.test.test_nb's `_no_eval`)."
    if cell.cell_type != 'code' or 'nbdev_export' + '(' in cell.source: return True
    direc = extract_directives(cell, remove=False)
    return direc.get('eval:', [''])[0].lower() == 'false' or bool(flags & direc.keys())


def check_notebook(path: Path, quick: bool = False, cell_times: str | None = None) -> None:
    """Run the notebook at `path` as `nbdev_test` would and raise `NotebookFailure` if a cell raises, if it leaves
    the process changed for the next notebook (`leaks`), or if a cell prints other than its saved outputs."""
    nb = read_nb(path)
    flags = set(get_config(path=ROOT).tst_flags.split()) if quick else set()
    run = [c for c in nb.cells if not skipped(c, flags)]
    saved = [c.get('outputs', []) for c in run]
    for c in run: c.outputs = []
    outputs, error, seconds = _run_in_child(path, nb, {id(c) for c in run})
    if cell_times:
        with open(cell_times, 'a') as f:   # one short write a notebook: workers may share the file
            f.write(''.join(f'{path.name}\t{n}\t{t:.2f}\t{head}\n' for n, t, head in seconds))
    if error: raise NotebookFailure(error)
    for c, out in zip(run, outputs): c.outputs = out
    problems = [p for c, s in zip(run, saved) if (p := compare(c, s))]
    if problems:
        raise NotebookFailure(f'{path.name}: {len(problems)} cell(s) print something else than the outputs saved in '
                              'the notebook (the site shows those): run it again and save it (`make run NB=...`), '
                              'or fix the code.\n\n' + '\n\n'.join(problems))


class Notebook(pytest.Item):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_marker('notebook')
        self.add_marker('no_cover')  # pytest-cov: tests/ cover the package; tracing the notebooks only slows them

    def runtest(self):
        path = self.path
        fm = getattr(NBProcessor(path, procs=FrontmatterProc, process=True).nb, 'frontmatter_', {})
        if str2bool(fm.get('skip_exec', False)): pytest.skip('skip_exec in its front matter')
        if nb_lang(read_nb(path)) != 'python': pytest.skip(f'a {nb_lang(read_nb(path))} notebook')
        check_notebook(path, self.config.getoption('quick'), self.config.getoption('cell_times'))

    def repr_failure(self, excinfo):
        return str(excinfo.value) if excinfo.errisinstance(NotebookFailure) else super().repr_failure(excinfo)

    def reportinfo(self): return self.path, None, self.path.name


PHONE_COLUMN_PX, CSS_PX_PER_INCH, MIN_TEXT_PX = 339, 94.5, 8.0  # measured: Quarto's text column at 390 px


def figure_text_px(fig) -> list[tuple[float, str]]:
    """The height in CSS px of each text of `fig` on a 390 px phone, smallest first, with the text.

    The site shows a figure at its natural size (`CSS_PX_PER_INCH` per inch of `figsize`) or, on a phone, scaled down
    to the text column, so a font of s points ends up s / 72 * min(column / width, px per inch) CSS px tall."""
    from matplotlib.text import Text
    width = fig.get_figwidth()
    scale = min(PHONE_COLUMN_PX / width, CSS_PX_PER_INCH) / 72
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return sorted((t.get_fontsize() * scale, t.get_text()) for t in texts)


def _guard_figure_text(shell, problems: list, path: Path) -> None:
    "Note in `problems` every figure the notebook displays with text under 8 px on a phone (IPython would swallow a raise)."
    from matplotlib.backend_bases import FigureCanvasBase
    print_figure = FigureCanvasBase.print_figure
    report = os.environ.get('FIGURE_TEXT_REPORT')  # a file: append each figure's smallest text, in px
    def checked(self, *args, **kwargs):
        sizes = figure_text_px(self.figure)
        if report and sizes:
            with open(report, 'a') as f: f.write(f'{path.name}\t{sizes[0][0]:.2f}\t{sizes[0][1][:30]!r}\n')
        small = [(px, text) for px, text in sizes if px < MIN_TEXT_PX]
        if small:
            problems.append(f'cell #{shell._cell_idx}: figure text must be at least {MIN_TEXT_PX:g} CSS px tall on a 390 px '
                            f'phone; got {small[0][0]:.1f} px for {small[0][1][:40]!r} ({len(small)} text(s) too small) '
                            f'in a {self.figure.get_figwidth():g} in wide figure: use a larger font or a narrower figure')
        return print_figure(self, *args, **kwargs)
    FigureCanvasBase.print_figure = checked


def process_state() -> dict:
    """What a notebook could leave behind for the next one that `nbdev_test` runs in the same process, as name ->
    value: torch's computing switches, and every function, class and method of the package as the next notebook
    would resolve it (a notebook that re-runs an exported cell defines its own copy; the package must keep its own).
    Display settings (print options, matplotlib's rc) are left out: every page sets its own in its first cell."""
    import sys, torch
    state = {'torch.get_default_dtype()': torch.get_default_dtype(),
             'torch.get_default_device()': torch.get_default_device(),
             'torch.is_grad_enabled()': torch.is_grad_enabled(),
             'torch.is_inference_mode_enabled()': torch.is_inference_mode_enabled(),
             'torch.is_anomaly_enabled()': torch.is_anomaly_enabled(),
             'torch.are_deterministic_algorithms_enabled()': torch.are_deterministic_algorithms_enabled(),
             'torch.get_float32_matmul_precision()': torch.get_float32_matmul_precision()}
    package, main = get_config(path=ROOT).lib_name, sys.modules['__main__']
    sys.modules['__main__'] = type(sys)('__main__')   # resolve names as a notebook that starts now would
    try:
        for name, module in list(sys.modules.items()):
            if name.split('.')[0] != package or module is None: continue
            for attr, value in list(vars(module).items()):
                if attr.startswith('__'): continue
                state[f'{name}.{attr}'] = value
                if isinstance(value, type) and value.__module__ == name:   # a class of this module: its methods
                    for k, v in list(vars(value).items()):
                        if not k.startswith('__') or k in ('__init__', '__call__'):
                            state[f'{name}.{attr}.{k}'] = v
    finally: sys.modules['__main__'] = main
    return state


def leaks(before: dict, after: dict) -> list[str]:
    """The names whose value `after` a notebook is not the one `before` it (package objects compared by identity,
    settings by value), and the methods a notebook added to a package class that existed before it."""
    same = lambda a, b: a is b or (not callable(a) and type(a) is type(b) and _equal(a, b))
    changed = [k for k in before.keys() & after.keys() if not same(before[k], after[k])]
    classes = {k for k in before if isinstance(before[k], type)}
    added = [k for k in after.keys() - before.keys() if k.rsplit('.', 1)[0] in classes and after[k] is not None]
    return sorted(changed + added)


def _equal(a, b) -> bool:
    try: return bool(a == b)
    except Exception: return False


WARM = ('matplotlib.pyplot', 'IPython.display', 'fastcore.test', 'transformers',  # most notebooks import these
        'transformers.models.llama.modeling_llama')  # and so transformers' models, generation and masks (1.4 s)


def _warm_imports() -> None:
    """Import, once in this worker, what most notebooks import, and the whole package: each notebook's fork then
    finds them loaded (1 to 3 s a notebook otherwise). A notebook still runs its own imports; nothing it sets is
    shared, as each runs in a fork."""
    import importlib, pkgutil, sys
    if getattr(_warm_imports, 'done', False): return
    for name in WARM:
        try: importlib.import_module(name)
        except ImportError: pass
    package = importlib.import_module(get_config(path=ROOT).lib_name)
    for m in pkgutil.iter_modules(package.__path__): importlib.import_module(f'{package.__name__}.{m.name}')
    _warm_imports.done = True


def _run_in_child(path: Path, nb, todo: set) -> tuple[list, str | None, list]:
    """Execute the cells of `nb` whose id is in `todo`, in a forked copy of this process; return their outputs, the
    failure or None, and each cell run's (number, seconds, first line). A notebook sets things for its whole process
    (matplotlib's rc and font state, torch's print options, seeds); in a fork, none of it reaches the next notebook
    that this xdist worker runs."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix=f'{path.stem}-') as scratch:  # removed after the child, whatever happens
        return _fork_and_run(path, nb, todo, scratch)


def _fork_and_run(path: Path, nb, todo: set, scratch: str) -> tuple[list, str | None, list]:
    "_run_in_child's work. The notebook's temporary folders (tempfile.mkdtemp(), a saved checkpoint) go in `scratch`."
    import multiprocessing, sys, tempfile, time
    from execnb.shell import CaptureShell  # with matplotlib and IPython: imported once here, not in every child
    _warm_imports()
    reader, writer = multiprocessing.get_context('fork').Pipe(duplex=False)
    def child():
        # GNU OpenMP hangs in a fork whose parent has run torch on several threads: keep the child on one
        if 'torch' in sys.modules: sys.modules['torch'].set_num_threads(1)
        tempfile.tempdir = os.environ['TMPDIR'] = scratch  # the child leaves by os._exit: nothing of its own is cleaned
        before = process_state()
        shell, error, small_text = CaptureShell(path), None, []
        _guard_figure_text(shell, small_text, path)
        os.environ['IN_TEST'] = '1'
        os.chdir(path.parent)
        seconds = []
        def pre(c):
            if id(c) in todo: seconds.append([c.idx_ + 1, time.perf_counter(), _head(c)])
            return id(c) not in todo
        def post(c): seconds[-1][1] = time.perf_counter() - seconds[-1][1]
        try: shell.run_all(nb, exc_stop=True, preproc=pre, postproc=post)
        except Exception:
            cell = nb.cells[shell._cell_idx - 1]
            error = (f'{path.name}, cell #{shell._cell_idx} ({_head(cell)}) raised:\n'
                     + _cell_traceback(shell.exc))
        if small_text and not error: error = f'{path.name}: ' + '\n'.join(small_text)
        if not error and (left := leaks(before, process_state())):
            error = (f'{path.name} leaves the process changed for the next notebook that nbdev_test runs in it '
                     f'(several notebooks share a process there): {", ".join(left[:8])}'
                     f'{f" and {len(left) - 8} more" if len(left) > 8 else ""}. Put a setting back where the '
                     'notebook changes it (a `with` block), and leave the package\'s names to the package.')
        writer.send(([c.get('outputs', []) for c in nb.cells if id(c) in todo], error, seconds))
        os._exit(0)
    proc = multiprocessing.get_context('fork').Process(target=child)
    proc.start()
    writer.close()
    try: outputs, error, seconds = reader.recv()
    except EOFError:
        outputs, error, seconds = [], f'{path.name}: the process running it died (exit code {proc.join() or proc.exitcode})', []
    proc.join()
    return outputs, error, seconds


def compare(cell, saved) -> str | None:
    "None if `cell`'s fresh outputs match its `saved` ones, else a report: the cell's number, first line and a diff."
    sa, sb = summarise(saved), summarise(cell.outputs)
    same = lambda x, y: x[:2] == y[:2] and (same_text if x[0] == 'text' else same_size)(x[2], y[2])
    if len(sa) == len(sb) and all(map(same, sa, sb)): return None
    fmt = lambda s: '\n'.join(f'{k}[{n}]: {v}' for k, n, v in s).splitlines()
    diff = '\n'.join(difflib.unified_diff(fmt(sa), fmt(sb), 'saved', 'fresh', lineterm=''))
    return f'cell #{cell.idx_ + 1} ({_head(cell)}):\n{diff}'


NUM = re.compile(r'-?\d+\.\d+(?:e[+-]?\d+)?|-?\d+(?:e[+-]?\d+)?|-?inf\b|nan\b', re.I)
VARIES = [(re.compile(r'0x[0-9a-fA-F]+'), '0x…'),                                   # memory addresses
          (re.compile(r'\b\d+(?:\.\d+)?\s?(?:ns|µs|us|ms|s|sec|seconds|min)\b'), '<time>'),  # durations
          (re.compile(r'\b\d+(?:\.\d+)?\s?(?:[KMGT]B/s|tok/s)'), '<rate>'),  # rates: a duration's kin
          (re.compile(r'\bid=\d+'), 'id=…')]


def _text(x) -> str: return x if isinstance(x, str) else ''.join(x or [])


def _png_size(b64) -> tuple[int, int]: return struct.unpack('>II', base64.b64decode(_text(b64))[16:24])


def summarise(outputs) -> list[tuple]:
    "The comparable content of a cell's outputs: ('text', kind, normalised string) or ('image', mime, size)."
    res = []
    for o in outputs:
        kind, data = o.get('output_type'), o.get('data', {})
        if kind == 'stream': res.append(('text', o.get('name'), _text(o.get('text'))))
        elif kind == 'error': res.append(('text', 'error', f"{o.get('ename')}: {o.get('evalue')}"))
        elif 'image/png' in data: res.append(('image', 'image/png', _png_size(data['image/png'])))
        elif 'image/svg+xml' in data: res.append(('image', 'image/svg+xml', None))
        elif 'text/markdown' in data: res.append(('text', 'markdown', _text(data['text/markdown'])))
        elif 'text/plain' in data: res.append(('text', 'plain', _text(data['text/plain'])))
    out = []
    for r in res:
        if r[0] == 'text':
            t = r[2]
            for pat, rep in VARIES: t = pat.sub(rep, t)
            r = ('text', r[1], t.rstrip())
        out.append(r)
    return out


def _decimals(s: str) -> int:
    m = re.match(r'-?\d+\.(\d+)', s)
    return len(m.group(1)) if m else 0


def same_text(saved: str, fresh: str) -> bool:
    "Equal once numbers are compared to the precision they are printed with."
    saved, fresh = (t.replace('\u2212', '-') for t in (saved, fresh))  # a typographic minus (it does not wrap)
    if NUM.sub('#', saved) != NUM.sub('#', fresh): return False
    for a, b in zip(NUM.findall(saved), NUM.findall(fresh)):
        if a == b: continue
        fa, fb = float(a), float(b)
        if fa != fa and fb != fb: continue  # nan == nan
        # float32 rounding (a difference of 1e-7 or 6e-8) depends on the CPU's vector instructions: any two
        # numbers below 1e-5 are the same noise; the notebooks' own assertions bound them
        if max(abs(fa), abs(fb)) < 1e-5: continue
        tol = 10 ** -max(_decimals(a), _decimals(b)) * 1.01
        if 'e' in a.lower() or 'e' in b.lower(): tol = max(abs(fa), abs(fb)) * 1e-3
        if abs(fa - fb) > tol: return False
    return True


def same_size(a, b) -> bool:
    "Two pictures' (width, height) agree within 2 %."
    if a is None or b is None: return a == b
    return all(abs(x - y) <= 0.02 * max(x, y) for x, y in zip(a, b))
