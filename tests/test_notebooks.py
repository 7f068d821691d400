"""What every page of the site promises its reader, checked on the notebooks themselves.

The notebooks also run, each as a test of its own (tools/pytest_notebooks.py); these tests check their shape: the
code is shown and fits its box, every story page ends with what it built and with exercises whose solutions check
themselves, every figure has a caption and alt text, and no public method leaves the site to show PyTorch's inherited
docstring."""
import importlib, inspect, json, re
from pathlib import Path

import pytest
from torch import nn

import selfattn_nbdev

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT/'nbs').glob('*.ipynb'))
# The pages that build something end with what they built and with exercises: not the landing page (also the README),
# the benchmark page (it measures), nor the reference pages that hold no code (notation, references, developing).
STORY = [p for p in NOTEBOOKS if p.stem not in ('index', '08_performance', '92_notation', '93_references', '94_develop',
                                                     '95_measurements', '96_measurements_gpu')]
MAX_LINE = 88  # an 88-character line fits the text column at 1280 px (checked in the browser by tools/walk_site.py)


def cells(path: Path, kind: str = 'code') -> list[str]:
    return [''.join(c['source']) for c in json.loads(path.read_text())['cells'] if c['cell_type'] == kind]


def options(src: str) -> dict:
    "A cell's `#|` options."
    out = {}
    for line in src.splitlines():
        if not line.startswith('#|'): break
        key, _, val = line[2:].strip().partition(':')
        out[key.strip()] = val.strip().strip('"')
    return out


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_cell_options_are_yaml(nb):
    "Quarto reads `#|` options as YAML and stops the whole build on one it cannot parse (smalldocs is lenient)."
    import yaml
    for src in cells(nb):
        head = '\n'.join(l[3:] for l in src.splitlines() if re.match(r'#\| [\w-]+:', l))  # not `#| hide`
        try: parsed = yaml.safe_load(head) if head else {}
        except yaml.YAMLError as e: pytest.fail(f'{nb.name}: cell options are not valid YAML: {e}\n{head}')
        assert head == '' or isinstance(parsed, dict), f'{nb.name}: cell options are not key: value lines: {head}'


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_code_lines_fit_the_page(nb):
    shown = [src for src in cells(nb) if 'hide' not in options(src)]  # `#|` lines are options, not shown code
    long = [(i, line) for i, src in enumerate(shown) for line in src.splitlines()
            if len(line) > MAX_LINE and not line.startswith('#|')]
    assert not long, f'{nb.name}: {len(long)} code line(s) longer than {MAX_LINE} characters, e.g. cell {long[0]}'


IMPORT = re.compile(r'^(import|from)\s+\S+', re.M)  # top-level imports: nbdev runs those cells


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_import_cells_hold_only_imports(nb):
    "nbdev's docs build runs every cell that imports something (to make `show_doc` work): keep those cells pure."
    for src in cells(nb):
        if not IMPORT.search(src): continue
        body = [l for l in src.splitlines() if l.strip() and not l.startswith('#')]
        stray = [l for l in body if not IMPORT.match(l) and not l.startswith((' ', ')', '_all_ ='))]
        assert not stray, f'{nb.name}: a cell that imports and also runs code (move the import up): {stray[:2]}'


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_exported_code_is_shown(nb):
    hidden = [src.splitlines()[1] for src in cells(nb)
              if options(src).keys() & {'export'} and 'hide' not in options(src)]
    assert not hidden, f'{nb.name}: `#| export` hides the source on the site; use `#| exports`: {hidden}'


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_figures_have_caption_and_alt_text(nb):
    for src in cells(nb):
        if re.search(r'\bplt\.|\bfig\b', src) and 'plt.close' not in src and ('imshow' in src or 'subplots' in src):
            opts = options(src)
            assert opts.get('fig-cap') and opts.get('fig-alt'), f'{nb.name}: a figure without fig-cap/fig-alt:\n{src[:200]}'


@pytest.mark.parametrize('nb', STORY, ids=lambda p: p.stem)
def test_story_page_ends_with_what_you_built_and_exercises(nb):
    headings = [line for src in cells(nb, 'markdown') for line in src.splitlines() if line.startswith('## ')]
    assert '## What you built' in headings and '## Exercises' in headings, f'{nb.name}: {headings[-4:]}'
    assert headings.index('## What you built') < headings.index('## Exercises')
    solutions = [src for src in cells(nb) if options(src).get('code-summary', '').startswith('Solution')]
    assert 2 <= len(solutions) <= 3, f'{nb.name}: {len(solutions)} folded solutions'
    for src in solutions:
        assert options(src).get('code-fold') == 'true', f'{nb.name}: a solution that is not folded'
        assert re.search(r'\btest_(eq|close|fail|ne)\b|\bassert\b', src), f'{nb.name}: a solution that checks nothing'


def _public_methods():
    for modname in ['core', 'simple', 'trainable', 'causal', 'multihead', 'training']:
        mod = importlib.import_module(f'selfattn_nbdev.{modname}')
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not (inspect.isclass(obj) and issubclass(obj, nn.Module)): continue
            for attr, fn in vars(obj).items():
                if inspect.isfunction(fn) and not attr.startswith('_'):  # __init__: the class docstring
                    yield f'{name}.{attr}', fn


@pytest.mark.parametrize('qualname,fn', list(_public_methods()), ids=lambda x: x if isinstance(x, str) else '')
def test_public_methods_have_their_own_docstring(qualname, fn):
    assert fn.__doc__ and 'Should be overridden' not in fn.__doc__, f'{qualname} shows an inherited docstring'


def test_every_exported_name_is_documented():
    for name in selfattn_nbdev.__all__:
        assert getattr(selfattn_nbdev, name).__doc__, name


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_no_code_inside_link_text(nb):
    "nbdev links a backticked API name itself; inside a link's text that makes a nested link, which Quarto prints raw."
    nested = [m.group(0) for src in cells(nb, 'markdown') for m in re.finditer(r'\[`[^`\]]+`\]\([^)]*\)', src)]
    assert not nested, f'{nb.name}: backticked names inside link text: {nested[:3]}'


def sidebar() -> dict:
    "The sidebar's groups, in reading order: {group title (None for the landing page): [notebook, ...]}."
    import yaml
    groups = {}
    for item in yaml.safe_load((ROOT/'nbs'/'sidebar.yml').read_text())['website']['sidebar']['contents']:
        if isinstance(item, str): groups.setdefault(None, []).append(item)
        else: groups[item['section']] = list(item['contents'])
    return groups


def page(nb_name: str) -> str: return re.sub(r'^\d+_', '', nb_name).replace('.ipynb', '.html')


def test_sidebar_lists_every_notebook_once_in_three_groups():
    groups = sidebar()
    assert list(groups) == [None, 'Foundation', 'The story', 'Beyond the story', 'Reference'], list(groups)
    listed = [nb for nbs in groups.values() for nb in nbs]
    assert sorted(listed) == sorted(p.name for p in NOTEBOOKS), 'every notebook in the sidebar, once'
    assert groups[None] == ['index.ipynb']


NEXT = re.compile(r'(?:^|[.!?]\s+)Next,\s*\[[^\]]*\]\((\w+\.html)[^)]*\)|^##+ (?:What\'s next|Next)\n+[^\[]*\[[^\]]*\]\((\w+\.html)', re.M)


def test_the_landing_page_lists_every_page_in_the_sidebar_order():
    "'The rest of the story' on the landing page links every other page once, in the sidebar's order."
    text = '\n\n'.join(cells(ROOT/'nbs'/'index.ipynb', 'markdown'))
    listed = re.findall(r'^- \[[^\]]+\]\((\w+\.html)\)', text.split('## The rest of the story')[1], re.M)
    order = [page(nb) for group, nbs in sidebar().items() if group for nb in nbs]
    assert listed == order, f'listed: {listed}; the sidebar: {order}'


def test_every_next_sentence_names_the_next_page():
    "A page's 'Next, [..](page.html)' (or its 'Next' section) must point where the footer's next link goes."
    order = [nb for nbs in sidebar().values() for nb in nbs]
    closing = sidebar()['The story'] + sidebar()['Beyond the story'][:-1]  # pages that hand over to the next
    for i, nb in enumerate(order[:-1]):
        text = '\n\n'.join(cells(ROOT/'nbs'/nb, 'markdown'))
        said = [a or b for a, b in NEXT.findall(text)]
        if nb in closing: assert said, f'{nb}: no "Next, [...](page.html)" sentence'
        assert all(s == page(order[i + 1]) for s in said), f'{nb}: says next is {said}, footer: {page(order[i + 1])}'


def test_a_link_named_for_a_page_opens_that_page():
    "A link whose text is a page's title opens that page: [Measurements](measurements_gpu.html) once sent readers elsewhere."
    titles = {}
    for nb in NOTEBOOKS:
        title = re.match(r'#\s+(.+)', cells(nb, 'markdown')[0])
        if title: titles[title.group(1).strip().lower()] = page(nb.name)
    wrong = [(nb.name, text, href) for nb in NOTEBOOKS for src in cells(nb, 'markdown')
             for text, href in re.findall(r'\[([^\]]+)\]\((\w+\.html)', src)
             if titles.get(text.lower(), href) != href]
    assert not wrong, f'link text names one page, the link opens another: {wrong}'


DEFINITION = re.compile(r'^(?:class|def)\s+(\w+)(?:\(self:(\w+))?', re.M)  # a method added with @patch: its class


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_each_definition_is_shown_once(nb):
    "An exported definition is shown once, by its source; the page gets a table of its parameters, not its signature again."
    shown = [src for src in cells(nb) if 'hide' not in options(src)]
    assert not [s for s in shown if re.match(r'show_doc\(', s)], f'{nb.name}: show_doc repeats a shown definition'
    # a page may first show an earlier form as page code (not exported): the package has one version of each name
    exported = [src for src in shown if 'exports' in options(src) or 'export' in options(src)]
    names = [f'{cls}.{n}' if cls else n for src in exported for n, cls in DEFINITION.findall(src)]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f'{nb.name}: defined twice on the page: {twice}'


HASH = re.compile(r'\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b')  # a commit, by its look
LOG = re.compile(r'lent to|this session|since the last change|ran before that change|has not run again|'
                 r'an earlier run|the first of two runs', re.I)


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=lambda p: p.stem)
def test_pages_are_explanations_not_logs(nb):
    "No commit hashes, lent machines, sessions or 'since the last change' in what a page shows (text and outputs)."
    texts = []
    for c in json.loads(nb.read_text())['cells']:
        if c['cell_type'] == 'markdown': texts.append(''.join(c['source']))
        for o in c.get('outputs', []):
            texts += [''.join(v) for k, v in o.get('data', {}).items() if k in ('text/markdown', 'text/plain')]
            texts.append(''.join(o.get('text', '')))
    found = [m for t in texts for m in HASH.findall(t) + LOG.findall(t)]
    assert not found, f'{nb.name}: the page reads as a log: {found[:5]}'
