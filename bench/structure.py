"""The package's structure, measured (issue "Add, never replace"): its lines, the methods and functions defined more
than once (superseded versions), the @patch definitions that reach into another module's class, and one traced forward
of a 1-layer Llama with mask_mod=sliding_window(4): how many calls into the package it makes, in how many modules, and
how often it switches module; the guard lines the story pages show, and each module's lines and package imports. Prints a table; `--out FILE` writes it as JSON.

    python bench/structure.py --out bench/structure.json
"""
import argparse, ast, collections, datetime, json, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'selfattn_nbdev'


def package_lines() -> int:
    "Lines of the generated package, without _modidx.py (nbdev's index)."
    return sum(len(p.read_text().splitlines()) for p in PACKAGE.glob('*.py') if p.name != '_modidx.py')


ISOLATION = ('class _NotebookMethod', 'def _forget_old_main')  # what notebooks sharing a process once needed


def isolation_machinery() -> list:
    "The pieces of notebook-isolation machinery the package still defines."
    text = '\n'.join(p.read_text() for p in PACKAGE.glob('*.py') if p.name != '_modidx.py')
    return [name.split()[1] for name in ISOLATION if name in text]


def cross_module_patches() -> tuple:
    "(@patch or @replaces definitions, those on a class that another module defines)."
    classes, patches = {}, []
    for path in PACKAGE.glob('*.py'):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef): classes.setdefault(node.name, path.stem)
            if isinstance(node, ast.FunctionDef) and any(
                    (isinstance(d, ast.Name) and d.id == 'patch') or
                    (isinstance(d, ast.Call) and getattr(d.func, 'id', '') in ('replaces', 'patch'))
                    for d in node.decorator_list):
                first = node.args.args[0].annotation if node.args.args else None
                owner = first.id if isinstance(first, ast.Name) else None
                patches.append((path.stem, owner))
    return len(patches), sum(1 for module, owner in patches if owner and classes.get(owner, module) != module)


STORY = ['index', '01_simple', '02_trainable', '03_causal', '04_multihead', '05_training', '06_generation']


def story_guards() -> dict:
    "Guard lines the story pages show (code not folded or hidden): check_* calls and @checked."
    counts = {}
    for page in STORY:
        nb = json.loads(next((ROOT / 'nbs').glob(f'{page}*.ipynb')).read_text())
        n = 0
        for cell in nb['cells']:
            src = ''.join(cell['source'])
            if cell['cell_type'] != 'code' or re.search(r'^#\|\s*(fold|hide)|code-fold', src, re.M): continue
            n += sum(1 for line in src.splitlines() if not line.lstrip().startswith(('def ', '#'))
                     and (re.search(r'\bcheck_\w+\(', line) or line.strip() == '@checked'))
        counts[page] = n
    return dict(total=sum(counts.values()), by_page=counts)


def module_imports() -> dict:
    "Each module of the package: its lines, the notebooks that write it (first its own), and the modules it imports."
    layout = {}
    for path in sorted(PACKAGE.glob('*.py')):
        if path.name in ('_modidx.py', '__init__.py'): continue
        text = path.read_text()
        tree = ast.parse(text)
        imports = sorted({node.module for node in ast.walk(tree)
                          if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module})
        page = re.search(r'File to edit: \.\./nbs/(\S+)\.ipynb', text)  # nbdev's header
        pages = [page.group(1)] if page else []
        for more in re.findall(r'^# %% \.\./nbs/(\S+)\.ipynb', text, re.M):  # cells of a later page
            if more not in pages: pages.append(more)
        layout[path.stem] = dict(lines=len(text.splitlines()), page=page and page.group(1), pages=pages,
                                 imports=imports)
    return layout


def superseded() -> int | None:
    "The count printed by ../shared/tools/superseded.py, when it is there."
    tool = ROOT.parent / 'shared' / 'tools' / 'superseded.py'
    if not tool.exists(): return None
    out = subprocess.run([sys.executable, str(tool)], cwd=ROOT, capture_output=True, text=True).stdout
    last = [l for l in out.splitlines() if l.startswith('superseded versions:')]
    return int(last[-1].split(':')[1]) if last else None


def package_calls(f) -> list:
    "(module, function) of every call into the package while `f()` runs, under torch.no_grad, in order."
    import torch
    calls = []

    def profile(frame, event, arg):
        if event == 'call' and frame.f_code.co_filename.startswith(str(PACKAGE)):
            calls.append((Path(frame.f_code.co_filename).stem, frame.f_code.co_name))
    sys.setprofile(profile)
    try:
        with torch.no_grad(): f()
    finally: sys.setprofile(None)
    return calls


def traced_forward() -> dict:
    "Calls into the package during one forward of a 1-layer Llama with a sliding-window mask_mod."
    import torch
    from selfattn_nbdev.masks import sliding_window
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    model = Llama(vocab_size=64, context_length=32, d_model=32, num_heads=4, num_layers=1).eval()
    ids = torch.randint(0, 64, (1, 16))
    mask_mod = sliding_window(4)
    with torch.no_grad(): model(ids, mask_mod=mask_mod)  # warm: tables and block masks made once
    calls = package_calls(lambda: model(ids, mask_mod=mask_mod))
    modules = [m for m, _ in calls]
    frames = ('<listcomp>', '<setcomp>', '<dictcomp>', '<genexpr>')  # Python 3.11 gives each a frame; 3.12 inlines
    switches = sum(1 for a, b in zip(modules, modules[1:]) if a != b)
    sequence = [f'{m}.{f}' for m, f in calls]
    return dict(calls=len(calls), function_calls=sum(f not in frames for _, f in calls),
                modules=len(set(modules)), switches=switches, **without_checks(sequence),
                by_module=dict(collections.Counter(modules)), sequence=sequence)


def without_checks(sequence: list) -> dict:
    """The trace counted as the code review of 2026-12-04 counted it, whose figure the issue quotes: input checks
    (check_*, _check_*) and comprehensions left out."""
    kept = [c for c in sequence if not c.split('.', 1)[1].lstrip('_').startswith('check') and '<' not in c]
    return dict(calls_without_checks=len(kept), modules_without_checks=len({c.split('.')[0] for c in kept}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', help='write the figures as JSON to this file')
    args = parser.parse_args()
    patches, cross = cross_module_patches()
    trace = traced_forward()
    result = dict(date=datetime.date.today().isoformat(), command='python bench/structure.py --out bench/structure.json',
                  package_lines=package_lines(), superseded_versions=superseded(), patches=patches,
                  patches_into_another_module=cross, story_guards=story_guards(),
                  isolation_machinery=isolation_machinery(), layout=module_imports(), forward_trace=trace)
    rows = [('package lines (without _modidx.py)', result['package_lines']),
            ('superseded versions', result['superseded_versions']),
            ('@patch / @replaces definitions', patches), ('  into another module\'s class', cross),
            ('1-layer Llama, mask_mod: package calls', trace['calls']),
            ('  of them functions (not comprehensions)', trace['function_calls']),
            ('  modules', trace['modules']), ('  module switches', trace['switches']),
            ('  without checks and comprehensions', f"{trace['calls_without_checks']} calls in "
                                                    f"{trace['modules_without_checks']} modules"),
            ('guard lines shown on the story pages', result['story_guards']['total']),
            ('notebook-isolation machinery', ', '.join(result['isolation_machinery']) or 'none')]
    for name, value in rows: print(f'{name:42} {value}')
    if args.out:
        out = Path(args.out)  # the figures before the change, kept when the file has them
        before = json.loads(out.read_text()).get('before') if out.exists() else None
        if before: result['before'] = before
        out.write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
