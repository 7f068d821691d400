# No library fits: nbdev_docs, nbdev_readme and nbdev_preview need Quarto, which no package registry installs offline (PyPI's quarto-cli downloads it from GitHub); this drives smalldocs through nbdev's own pre-processing.
"""Build the documentation site and README.md from the notebooks in `nbs/`.

    python tools/docs.py site            # -> _docs/ (Quarto when `quarto` is on PATH, else smalldocs)
    python tools/docs.py readme          # -> README.md (+ index_files/) from nbs/index.ipynb
    python tools/docs.py readme --check  # exit 1 when README.md is not what the notebook renders to
    python tools/docs.py check           # smalldocs' link check over the processed notebooks
    python tools/docs.py preview         # serve the site on localhost and rebuild it on change

The pre-processing is nbdev's own (`_quarto.yml`/`nbdev.yml` refresh, module index, sidebar, `proc_nbs`),
called through its Python API so that nothing tries to download and install Quarto.
"""
import argparse, base64, json, os, re, shutil, signal, subprocess, sys, time
from pathlib import Path

from nbdev.config import get_config
from nbdev.quarto import refresh_quarto_yml
from nbdev.serve import proc_nbs
import nbdev.doclinks, nbdev.frontmatter, nbdev.showdoc

sys.path.insert(0, str(Path(__file__).parent))
from showdoc_tables import ParamTables

ROOT = Path(__file__).resolve().parents[1]


def preprocess(force: bool = True) -> Path:
    "Run nbdev's docs pre-processing and return the folder of processed notebooks (`_proc/`); `force`: from scratch."
    os.chdir(ROOT)
    refresh_quarto_yml()
    nbdev.doclinks._build_modidx()
    nbdev.showdoc.BasicMarkdownRenderer = ParamTables  # see ParamTables
    proc = proc_nbs(force=force, n_workers=0)  # nbs/sidebar.yml is written by hand: custom_sidebar = True
    for nb in proc.glob('*.ipynb'): reader_additions(nb)
    return proc


PRIVATE_DEF = re.compile(r'^(?:class|def)\s+(_[A-Za-z]\w*)', re.M)
SOLUTION = re.compile(r'^#\|\s*code-summary:\s*"?Solution', re.M)
FOLD = re.compile(r'^#\|\s*code-(fold|summary):.*\n?', re.M)
FOLD_EXPORT = re.compile(r'^#\|\s*fold(?:[ \t]+(.*?))?[ \t]*$', re.M)  # nbdev's kind: export drops it, docs fold
DEFINED = re.compile(r'^(?:@patch\s*\n)?(?:class|def)\s+(\w+)(?:\(self:(\w+))?', re.M)


def _lines(text: str) -> list[str]: return text.splitlines(keepends=True)  # Quarto reads a source as its lines


def _md_cell(text: str) -> dict: return {'cell_type': 'markdown', 'metadata': {}, 'source': _lines(text)}


def reader_additions(nb: Path) -> None:
    """What each processed page gets beyond its notebook.

    - An exercise's solution is folded *with its output*: Quarto's `code-fold` folds only the source, so the
      printed answer showed below the fold. The cell goes inside a `<details>` instead, under both renderers.
    - Under the title: a link to download the page's notebook (copied into the site by `copy_notebooks`). No link
      to run it in Colab: no notebook installs the package there, and several read files of the repository
      (`../bench/*.json`), so a notebook opened on its own would fail.
    - A code cell whose notebook source has the directive `#| fold` (nbdev ignores it; the export drops it) is
      folded under the name of what it defines: a long definition the page explains in words before it;
      `#| fold <summary>` folds it under that summary (the package's details beside the lesson's code).
    - An anchor before each private definition shown on the page (`def _tile_scores`): nbdev links a backticked
      `_tile_scores` to it, as it links a public name to its parameter table."""
    data = json.loads(nb.read_text())
    cells, out = data['cells'], []
    original = ROOT/get_config().nbs_path.name/nb.name
    folded = ({c.get('id'): FOLD_EXPORT.search(_text(c['source'])).group(1)
               for c in json.loads(original.read_text())['cells']
               if c['cell_type'] == 'code' and FOLD_EXPORT.search(_text(c['source']))}
              if original.exists() else {})
    for cell in cells:
        src = _text(cell.get('source', ''))
        if cell['cell_type'] == 'code' and cell.get('id') in folded:  # `#| fold`: a long definition, folded
            names = (', '.join(f'{c}.{n}' if c else n for n, c in DEFINED.findall(src))
                     or ', '.join(re.findall(r'^([A-Za-z_]\w*)\s*=', src, re.M)) or 'the code')
            summary = folded[cell.get('id')] or f'Code: {names}'  # `#| fold <summary>`, or the names
            cell['source'] = _lines(f'#| code-fold: true\n#| code-summary: "{summary}"\n' + src)
        private = PRIVATE_DEF.findall(src) if cell['cell_type'] == 'code' else []
        if private: out.append(_md_cell(''.join(f'<span id="{n.lower()}" class="api-anchor"></span>' for n in private)))
        if cell['cell_type'] == 'code' and SOLUTION.search(src):
            cell['source'] = _lines(FOLD.sub('', src))
            out += [_md_cell('<details class="solution">\n<summary>Solution</summary>'), cell, _md_cell('</details>')]
        else: out.append(cell)
    name = nb.name
    if (get_config().nbs_path/name).exists():
        links = f'<p class="notebook-links"><a href="notebooks/{name}" download>Download this notebook</a></p>'
        first = next((i for i, c in enumerate(out) if c['cell_type'] != 'raw'), 0)
        out.insert(first, _md_cell(links))
    data['cells'] = out
    nb.write_text(json.dumps(data))


TEX_SYMBOLS = {
    'alpha': 'α', 'beta': 'β', 'gamma': 'γ', 'omega': 'ω', 'theta': 'θ', 'mu': 'μ', 'sigma': 'σ', 'sqrt': '√',
    'cdot': '·', 'times': '×', 'dots': '…', 'ldots': '…', 'cdots': '⋯', 'sum': 'Σ', 'infty': '∞', 'leftarrow': '←',
    'rightarrow': '→', 'to': '→', 'le': '≤', 'leq': '≤', 'ge': '≥', 'geq': '≥', 'ne': '≠', 'neq': '≠', 'approx': '≈',
    'in': '∈', 'top': 'ᵀ', 'circ': '∘', 'propto': '∝', 'pm': '±', 'qquad': '  ', 'quad': ' ', 'lfloor': '⌊',
    'rfloor': '⌋', 'lceil': '⌈', 'rceil': '⌉', 'log': 'log', 'exp': 'exp', 'max': 'max', 'min': 'min'}
TEX_DROPPED = r'(?:mathrm|text|mathbf|mathit|operatorname|left|right|big|Big|bigl|bigr|textstyle|displaystyle|hat|tilde)'


def _group(text: str, i: int) -> tuple[str, int]:
    "The balanced `{...}` group that starts at text[i] (or the single character there), and the index after it."
    if i >= len(text) or text[i] != '{': return text[i:i + 1], i + 1
    depth = 0
    for j in range(i, len(text)):
        depth += {'{': 1, '}': -1}.get(text[j], 0)
        if depth == 0: return text[i + 1:j], j + 1
    return text[i + 1:], len(text)


def _fracs(text: str) -> str:
    "`\\frac{a}{b}` -> `a/b`, with parentheses around a part that is more than one term."
    out, i = [], 0
    while (k := text.find('\\frac', i)) >= 0:
        num, j = _group(text, k + 5); den, j = _group(text, j)
        part = lambda p: f'({_fracs(p)})' if re.search(r'[\s+−-]', p.strip()) else _fracs(p).strip()
        out += [text[i:k], part(num), '/', part(den)]; i = j
    return ''.join(out) + text[i:]


def plain_maths(text: str) -> str:
    """TeX as a reader types it into a search box: `\\alpha_j = \\frac{e^{s_j - m}}{l}` -> `α_j = e^(s_j - m)/l`.

    Search indexes hold the text of a page with its maths as TeX source, and show it in their result snippets."""
    text = re.sub(r'\\(?:begin|end)\{[a-z*]+\}|\\[()\[\]]|\$', '', text)
    text = re.sub(r'\\\\|&', ' ', text)                        # aligned lines and columns
    text = re.sub(r'\\[,;:! ]', ' ', text)                       # spacing commands
    text = _fracs(re.sub(r'\\' + TEX_DROPPED + r'(?![A-Za-z])\s*', '', text))
    for _ in range(4):                                         # innermost groups first
        text = re.sub(r'\\sqrt\{([^{}]*)\}', lambda m: '√' + (m.group(1) if len(m.group(1)) == 1 else f'({m.group(1)})'), text)
        text = re.sub(r'([\^_])\{([^{}]*)\}', lambda m: m.group(1) + (m.group(2) if len(m.group(2)) == 1 else f'({m.group(2)})'), text)
        text = re.sub(r'\{([^{}]*)\}', r'\1', text)
    text = re.sub(r'\\([A-Za-z]+)', lambda m: TEX_SYMBOLS.get(m.group(1), m.group(1)), text)
    return re.sub(r'[ \t]{2,}', ' ', text)


def clean_search_index(site_dir: Path) -> str:
    "Search results without raw TeX: each entry's text, title and section as `plain_maths` writes them."
    index = site_dir/'search.json'
    if not index.exists(): return 'no search index'
    entries = json.loads(index.read_text())
    for e in entries:
        for key in ('text', 'title', 'section'):
            if isinstance(e.get(key), str): e[key] = plain_maths(e[key])
    index.write_text(json.dumps(entries))
    return f'search index without TeX ({len(entries)} entries)'


def copy_notebooks(site_dir: Path) -> str:
    "Put each page's notebook in the site, for its download link."
    dest = site_dir/'notebooks'
    dest.mkdir(exist_ok=True)
    nbs = sorted(get_config().nbs_path.glob('*.ipynb'))
    for p in nbs: shutil.copy2(p, dest/p.name)
    return f'{len(nbs)} notebooks copied for download'


def _output_file(nb: Path) -> str | None:
    "The `output-file` that nbdev wrote into a processed notebook's front matter."
    cells = json.loads(nb.read_text())['cells']
    m = re.search(r'^output-file:\s*(\S+)', ''.join(cells[0]['source']), re.M) if cells else None
    return m.group(1) if m else None


def smalldocs_names(proc: Path) -> None:
    """Give each processed notebook the name of its page, as Quarto's `output-file` does.

    nbdev names pages after their notebook without its number prefix (`00_core.ipynb` -> `core.html`), and its
    doc links point there. Quarto reads that from `output-file`; smalldocs does not, so rename the files."""
    sidebar = proc/'sidebar.yml'
    text = sidebar.read_text()
    for nb in sorted(proc.rglob('*.ipynb')):
        out = _output_file(nb)
        if not out: continue
        new = nb.with_name(Path(out).with_suffix('.ipynb').name)
        data = json.loads(nb.read_text())  # drop the key smalldocs would warn about: the file name now says it
        data['cells'][0]['source'] = re.sub(r'^output-file:.*\n?', '', ''.join(data['cells'][0]['source']), flags=re.M)
        nb.write_text(json.dumps(data))
        if new != nb:
            nb.rename(new)
            text = re.sub(rf'(?<![\w/]){re.escape(nb.relative_to(proc).as_posix())}\b', new.relative_to(proc).as_posix(), text)
    sidebar.write_text(text)


def _title_and_summary(nb: Path) -> tuple[str, str]:
    "A notebook's page title and one-line summary, read from its first markdown cell as nbdev reads them."
    cells = json.loads(nb.read_text())['cells']
    text = next((''.join(c['source']) for c in cells if c['cell_type'] == 'markdown'), '')
    fm = nbdev.frontmatter._md2dict(text)  # `# Title` and `> summary`: the page's title and description
    return fm.get('title', nb.stem), fm.get('description', '')


def llms_text() -> str:
    """The site as an llms.txt (llmstxt.org): its title, its summary, then each sidebar section's pages in reading
    order, each a link to its published page with the page's own summary; the reference pages under `Optional`,
    the section a reader of the file may skip. Built from nbs/sidebar.yml and each notebook's first cell."""
    import yaml
    cfg = get_config()
    url = f"{cfg.doc_host.rstrip('/')}{cfg.doc_baseurl.rstrip('/')}/"
    sidebar = yaml.safe_load((cfg.nbs_path/'sidebar.yml').read_text())['website']['sidebar']['contents']
    def entry(name):
        title, summary = _title_and_summary(cfg.nbs_path/name)
        page = nbdev.doclinks._nbpath2html(Path(name)).name
        return f"- [{title}]({url}{page})" + (f": {summary}" if summary else "")
    lines = [f"# {cfg.title}", "", f"> {cfg.description}", "",
             f"Every page is a Jupyter notebook (nbdev): the same notebooks are the package `{cfg.lib_name}` "
             f"(`pip install git+{cfg.git_url}`; PyTorch its only dependency) and its tests. A page's notebook "
             f"is `{url}notebooks/<notebook>.ipynb`, named as in the repository's `nbs/`.", ""]
    for item in sidebar:
        if isinstance(item, str): lines += ["Start with " + entry(item)[2:], ""]; continue
        section = 'Optional' if item['section'] == 'Reference' else item['section']
        lines += [f"## {section}", "", *map(entry, item['contents']), ""]
    return "\n".join(lines)


def llms_txt(site_dir: Path) -> str:
    "Write the site's llms.txt (`llms_text`)."
    text = llms_text()
    (site_dir/'llms.txt').write_text(text)
    pages = len(re.findall(r'^(?:- |Start with )\[', text, re.M))
    return f"llms.txt ({pages} pages)"


KATEX_CDN = re.compile(r'https://cdn\.jsdelivr\.net/npm/katex@([\d.]+)/dist')


def vendor_katex(site_dir: Path) -> str:
    """Serve KaTeX from the site itself, so its maths renders offline too.

    smalldocs links KaTeX from a CDN. When `npm` is available, take the same version from the npm registry
    (cached under .venv/), copy it into site_libs/katex and point the pages at it; otherwise leave the CDN."""
    pages = [p for p in site_dir.rglob('*.html') if KATEX_CDN.search(p.read_text())]
    if not pages: return 'no maths'
    version = KATEX_CDN.search(pages[0].read_text()).group(1)
    cache = ROOT/'.venv'/'cache'/f'katex-{version}'
    if not (cache/'package'/'dist').exists():
        if not shutil.which('npm'): return 'KaTeX from its CDN (npm not found)'
        cache.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(['npm', 'pack', f'katex@{version}', '--silent'], cwd=cache, capture_output=True, text=True)
        tgz = next(cache.glob('katex-*.tgz'), None)
        if res.returncode or not tgz: return f'KaTeX from its CDN (npm pack failed: {res.stderr.strip()[:200]})'
        shutil.unpack_archive(tgz, cache)
    dest = site_dir/'site_libs'/'katex'
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(cache/'package'/'dist', dest, ignore=shutil.ignore_patterns('*.mjs', '*.ttf', '*.woff', 'katex.js', 'katex.css'))
    for p in pages:
        rel = os.path.relpath(dest, p.parent)
        p.write_text(KATEX_CDN.sub(rel, p.read_text()))
    return f'KaTeX {version} served from site_libs/katex'


def local_links(site_dir: Path) -> str:
    """Point the site's links to its own pages at the local files.

    nbdev writes its API cross-links as absolute addresses of the published site (settings.ini `doc_host` +
    `doc_baseurl`), so a local build would send the reader to the web. Every page sits at the top of the site,
    so a page's own name is the right relative link, online and offline alike."""
    cfg = get_config()
    published = f"{cfg.doc_host}{cfg.doc_baseurl}".rstrip('/') + '/'
    link = re.compile(r'(<a\b[^>]*?\bhref=")' + re.escape(published) + r'([\w.-]*\.html)?')  # anchors only
    n = 0
    for page in site_dir.rglob('*.html'):
        text, k = link.subn(lambda m: m.group(1) + (m.group(2) or 'index.html'), page.read_text())
        if k: page.write_text(text); n += k
    return f'{n} links to the published site made local'


WIDGET_LOADERS = re.compile(  # what Quarto adds to a page with any HTML output, for Jupyter's JavaScript widgets
    r'<script src="https://cdn\.jsdelivr\.net/npm/(?:requirejs@[\d.]+/require|jquery@[\d.]+/dist/jquery)\.min\.js"[^>]*>'
    r'</script>\n?|<script type="application/javascript">define\(\'jquery\'[^<]*</script>\n?')


def drop_widget_loaders(site_dir: Path) -> str:
    """Remove the RequireJS and jQuery that Quarto links from a CDN into every page with an HTML output.

    Quarto adds them for notebook widgets that expect them (itables, old Plotly). The only HTML outputs of this
    site are its attention explorers, plain scripts that use neither; offline, the missing RequireJS would make
    the jQuery shim throw `define is not defined` on every such page. No option of Quarto turns this off."""
    n = 0
    for page in site_dir.rglob('*.html'):
        text, k = WIDGET_LOADERS.subn('', page.read_text())
        if k: page.write_text(text); n += 1
    return f'widget loaders dropped from {n} pages' if n else 'no widget loaders'


INDENT_MOST = 20  # columns: a continuation starts at most 24 columns in, about half a phone's width
CODE_LINE = re.compile(r'(<span id="cb\d+-\d+")(><a href="#cb\d+-\d+" aria-hidden="true" tabindex="-1"></a>'
                       r'(?:<span class="\w+">)*)( +)')  # the spaces may open a string's or a comment's span


def hanging_indents(site_dir: Path) -> str:
    """Give each indented line of code its indent as `--indent` (Quarto writes a span per line), for styles.css.

    On a phone a long line of code wraps, and a continuation that started at the left edge would read as a new
    statement at the top level; styles.css starts it 4 columns past the line's own indent instead, which it can
    only do knowing that indent. An indent past INDENT_MOST counts as INDENT_MOST: a line aligned under an open
    bracket far to the right would leave its continuation no room on a phone's 45 columns. smalldocs writes no
    span per line: there the wrapped lines start at the edge."""
    n = 0
    for page in site_dir.rglob('*.html'):
        text, k = CODE_LINE.subn(lambda m: f'{m.group(1)} style="--indent:{min(len(m.group(3)), INDENT_MOST)}ch"'
                                           f'{m.group(2)}{m.group(3)}', page.read_text())
        if k: page.write_text(text); n += k
    return f'{n} indented code lines marked' if n else 'no code lines marked'


SOURCE_CODE = re.compile(r'(<code class="sourceCode[^"]*">)(.*?)(</code>)', re.S)
INLINE_CODE = re.compile(r'(<pre[^>]*>\s*)?(<code>)(.*?)(</code>)', re.S)  # group 1: an output's
ARROW = '<span class="arrow">-&gt;</span>'  # styles.css: never broken
INLINE_LONG = 30  # a name in prose this long may not fit a phone's line: it breaks at . or _; a shorter one
                 # moves to the next line whole (a mark in it would split `head_dim` at a line's end)
NAME_JOINT = re.compile(r'(?<=[A-Za-z0-9_])([._])(?=[A-Za-z_])')  # x.shape, use_cache: not 0.05


def name_breaks(site_dir: Path) -> str:
    """Let a long dotted or snake_case name in code break after a `.` or `_` (`<wbr>`), not inside a word.

    On a phone, styles.css wraps code; a name wider than the line (`transformers.models.qwen3_5.modeling_qwen3_5`)
    would otherwise break wherever the line ends, mid-word. `<wbr>` adds no character: what the copy button copies is
    the code as written. Only code (Quarto's `sourceCode`, and names of INLINE_LONG characters or more in inline
    code), never outputs, and never inside a tag. An arrow `->` is kept whole (a line may break after a `-`)."""
    n = 0
    def marked(opening, body, closing, shortest=0):
        nonlocal n
        parts = re.split(r'(<[^>]+>)', body)  # text and tags in turn: the tags kept whole
        for i in range(0, len(parts), 2):
            parts[i] = re.sub(r'\S{%d,}' % max(shortest, 1), lambda w: NAME_JOINT.sub(r'\1<wbr>', w.group()),
                              parts[i]).replace('-&gt;', ARROW)  # a line may break after '-': not in '->'
        n += sum(part.count('<wbr>') for part in parts[::2])
        return opening + ''.join(parts) + closing
    mark = lambda m: marked(*m.groups())
    mark_inline = lambda m: m.group(0) if m.group(1) else marked(*m.groups()[1:], shortest=INLINE_LONG)
    for page in site_dir.rglob('*.html'):
        text = page.read_text()
        new = INLINE_CODE.sub(mark_inline, SOURCE_CODE.sub(mark, text))
        if new != text: page.write_text(new)
    return f'{n} breaks in names of code' if n else 'no breaks in names of code'


def render(proc: Path) -> str:
    "Render the processed notebooks into `_docs/`; return the renderer's name."
    cfg = get_config()
    out = proc/cfg.doc_path.name
    shutil.rmtree(out, ignore_errors=True)
    if shutil.which('quarto'):
        subprocess.run(['quarto', 'render', '--no-cache'], cwd=proc, check=True)
        renderer = 'quarto'
    else:
        smalldocs_names(proc)
        subprocess.run([sys.executable, '-m', 'smalldocs.cli', 'render', str(proc)], check=True)
        renderer = 'smalldocs'
    renderer += f' ({vendor_katex(out)}; {local_links(out)}; {drop_widget_loaders(out)}; {hanging_indents(out)}; {name_breaks(out)}; {copy_notebooks(out)}; {llms_txt(out)}; {clean_search_index(out)})'
    shutil.rmtree(cfg.doc_path, ignore_errors=True)
    shutil.move(str(out), str(cfg.doc_path))
    return renderer


def site() -> None:
    renderer = render(preprocess())
    pages = sorted(p.name for p in (ROOT/'_docs').glob('*.html'))
    print(f"site built with {renderer}: {len(pages)} pages in _docs/ ({', '.join(pages)})")
    print(f"open {ROOT/'_docs'/'index.html'}  (or run `make preview`)")


def check() -> int:
    "smalldocs' broken-link check over the processed notebooks, under the page names the site uses."
    proc = preprocess()
    smalldocs_names(proc)
    res = subprocess.run([sys.executable, '-m', 'smalldocs.cli', 'check', str(proc)], capture_output=True, text=True)
    report = (res.stdout + res.stderr).strip()
    broken = [l for l in report.splitlines() if 'broken' in l or 'error' in l.lower()]
    print(report or 'smalldocs check: nothing to report')
    print(f"smalldocs check: {len(broken)} broken link(s)")
    return 1 if broken else 0


# ---- README.md ---------------------------------------------------------------------------------------------

def _cell_options(src: str) -> tuple[dict, list[str]]:
    "Split a code cell into its `#|` options and its code lines."
    lines, opts = src.split('\n'), {}
    while lines and lines[0].startswith('#|'):
        key, _, val = lines.pop(0)[2:].strip().partition(':')
        opts[key.strip()] = val.strip().strip('"') if val.strip() else True
    return opts, lines


def _text(x) -> str: return ''.join(x) if isinstance(x, list) else x


def readme_markdown(nb_path: Path, doc_url: str) -> tuple[str, dict[str, bytes]]:
    """Render a notebook as GitHub Markdown: what the site shows, minus hidden cells and `#|` directives.

    Returns the Markdown and the images it links to (path -> bytes). Links to other pages of the site
    (`core.html`) become absolute links to the published site, so they work on GitHub and PyPI."""
    nb = json.loads(nb_path.read_text())
    parts, images = ['<!-- WARNING: THIS FILE WAS AUTOGENERATED FROM nbs/index.ipynb! DO NOT EDIT! -->'], {}
    for i, cell in enumerate(nb['cells']):
        src = _text(cell['source'])
        if cell['cell_type'] == 'markdown':
            md = re.sub(r'\]\((?!https?:|#)([\w/-]+\.html)(#[\w-]*)?\)', lambda m: f"]({doc_url}/{m.group(1)}{m.group(2) or ''})", src)
            parts.append(md.strip())
            continue
        if cell['cell_type'] != 'code': continue
        opts, lines = _cell_options(src)
        if opts.get('hide') or opts.get('include') == 'false' or 'default_exp' in opts: continue
        code = '\n'.join(lines).strip()
        if code and opts.get('echo') != 'false': parts.append(f"```python\n{code}\n```")
        for j, out in enumerate(cell.get('outputs', [])):
            if out['output_type'] == 'stream': parts.append('```\n' + _text(out['text']).rstrip() + '\n```')
            data = out.get('data', {})
            if 'image/png' in data:
                path = f"index_files/figure-commonmark/cell-{i}-output-{j}.png"
                images[path] = base64.b64decode(_text(data['image/png']))
                alt = opts.get('fig-alt', opts.get('fig-cap', 'figure'))
                parts.append(f'![{alt}]({path})')
                if 'fig-cap' in opts: parts.append(f"*{opts['fig-cap']}*")
            elif 'data-attention-explorer' in _text(data.get('text/html', '')):  # GitHub runs no script
                parts.append(f"*An interactive attention explorer: [try it on the site]({doc_url}/index.html#try-it).*")
            elif 'text/markdown' in data: parts.append(_text(data['text/markdown']).strip())
            elif 'text/plain' in data: parts.append('```\n' + _text(data['text/plain']).rstrip() + '\n```')
    return '\n\n'.join(parts) + '\n', images


def readme(check_only: bool = False) -> int:
    cfg = get_config()
    md, images = readme_markdown(cfg.nbs_path/cfg.readme_nb, f"{cfg.doc_host}{cfg.doc_baseurl}".rstrip('/'))
    readme_path, img_dir = ROOT/'README.md', ROOT/'index_files'
    if check_only:
        stale = [] if readme_path.exists() and readme_path.read_text() == md else ['README.md']
        have = {p.relative_to(ROOT).as_posix() for p in img_dir.rglob('*.png')} if img_dir.exists() else set()
        stale += sorted(have ^ set(images)) + [p for p in images if p in have and (ROOT/p).read_bytes() != images[p]]
        if stale:
            print(f"README is stale ({', '.join(stale)}): run `make readme` and commit the result")
            return 1
        print("README.md matches nbs/index.ipynb")
        return 0
    shutil.rmtree(img_dir, ignore_errors=True)
    for p, data in images.items():
        (ROOT/p).parent.mkdir(parents=True, exist_ok=True)
        (ROOT/p).write_bytes(data)
    readme_path.write_text(md)
    print(f"wrote README.md ({len(md.splitlines())} lines) and {len(images)} image(s) from nbs/{cfg.readme_nb}")
    return 0


def _source_state() -> dict:
    "Modification times of everything the site is made from."
    cfg = get_config()
    generated = {'sidebar.yml', 'nbdev.yml'}  # rewritten by every refresh, from the notebooks and settings.ini
    files = [p for p in cfg.nbs_path.rglob('*') if p.is_file() and not p.name.startswith('.') and p.name not in generated]
    return {p: p.stat().st_mtime for p in files + [cfg.config_file]}


def preview(poll: float = 1.0) -> None:
    """Serve the site on localhost and rebuild it whenever a notebook (or anything in nbs/) changes.

    The renderer's own preview watches the processed copies in _proc/; this loop watches nbs/ and re-runs nbdev's
    processing into _proc/ on every change, which the renderer then picks up."""
    def refresh(force=False):  # in place: the server keeps serving from _proc/
        proc = preprocess(force)
        if not shutil.which('quarto'): smalldocs_names(proc)
        return proc
    proc = refresh(force=True)
    cmd = ['quarto', 'preview'] if shutil.which('quarto') else [sys.executable, '-m', 'smalldocs.cli', 'preview', str(proc)]
    server = subprocess.Popen(cmd, cwd=proc)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the server too when we are stopped
    state = _source_state()
    try:
        while server.poll() is None:
            time.sleep(poll)
            now = _source_state()
            if now != state:
                state = now
                print('nbs/ changed: processing the notebooks again', flush=True)
                try: refresh()
                except Exception as e: print(f'processing failed: {e}', flush=True)
    except KeyboardInterrupt: pass
    finally: server.terminate()


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('cmd', choices=['site', 'readme', 'check', 'preview'])
    ap.add_argument('--check', action='store_true', help='with readme: only report whether README.md is stale')
    a = ap.parse_args()
    os.chdir(ROOT)
    if a.cmd == 'site': site()
    elif a.cmd == 'readme': sys.exit(readme(a.check))
    elif a.cmd == 'check': sys.exit(check())
    else: preview()
