"""The project's own tooling: the notebook plugin (what fails a notebook, the stale-output comparison) and the README renderer."""
import json, re
from pathlib import Path

import pytest

from tools.pytest_notebooks import same_text, summarise


def test_numbers_compare_to_printed_precision():
    assert same_text('tensor([0.1385, 0.2379])', 'tensor([0.1386, 0.2379])')      # one unit in the last digit
    assert not same_text('tensor([0.1385, 0.2379])', 'tensor([0.1395, 0.2379])')  # ten units
    assert not same_text('tensor([0.1385])', 'tensor([0.1385, 0.2])')             # shape changed
    assert not same_text('grad_fn=<MmBackward0>', 'grad_fn=<BmmBackward0>')       # text changed
    assert same_text('nan', 'nan')
    assert same_text('diff 6e-08', 'diff 1e-07')       # float32 rounding: depends on the CPU
    assert not same_text('diff 6e-08', 'diff 2e-05')   # not rounding any more
    assert not same_text('3.2e-03', '3.5e-03')          # above 1e-5: 1e-3 relative
    assert same_text('| 8.4e−16 |', '| 1.1e−15 |')      # a typographic minus in an exponent: rounding too
    rate = lambda t: summarise([dict(output_type='stream', name='stdout', text=t)])
    assert rate('4 KiB pages: 25.5 GB/s, 12 ms') == rate('4 KiB pages: 21.7 GB/s, 9 ms')  # rates and times vary
    assert rate('4 KiB pages: 25.5 GB/s') != rate('2 MiB pages: 25.5 GB/s')              # the words do not
    assert not same_text('| 2.0e−03 |', '| 3.0e−03 |')


def test_what_varies_is_normalised():
    outs = [{'output_type': 'stream', 'name': 'stdout', 'text': 'took 12.5 ms at 0x7f00deadbeef'}]
    fresh = [{'output_type': 'stream', 'name': 'stdout', 'text': 'took 3 ms at 0x7f11cafe0000'}]
    assert summarise(outs) == summarise(fresh)


def test_readme_skips_hidden_cells_and_directives(tmp_path):
    from tools.docs import readme_markdown  # imports nbdev's docs machinery: only when this test runs
    nb = {'cells': [
        {'cell_type': 'markdown', 'metadata': {}, 'source': '# Title\n\nSee [core](core.html#selfattention).'},
        {'cell_type': 'code', 'metadata': {}, 'outputs': [], 'source': '#| hide\nsecret = 1'},
        {'cell_type': 'code', 'metadata': {}, 'source': '#| echo: true\n1 + 1',
         'outputs': [{'output_type': 'execute_result', 'data': {'text/plain': '2'}, 'metadata': {}}]}],
        'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
    p = tmp_path/'index.ipynb'
    p.write_text(json.dumps(nb))
    md, images = readme_markdown(p, 'https://example.org/site')
    assert 'secret' not in md and '#|' not in md
    assert '](https://example.org/site/core.html#selfattention)' in md
    assert '```python\n1 + 1\n```' in md and '```\n2\n```' in md
    assert images == {}


def test_search_index_text_has_no_tex():
    from tools.docs import plain_maths
    assert plain_maths(r'\alpha_j = \frac{e^{s_j - m}}{l}') == 'α_j = (e^(s_j - m))/l'
    assert plain_maths(r'\mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right) V') == 'softmax (QK^ᵀ/√(d_k)) V'
    assert plain_maths(r'\omega_{ij} = x^{(i)} \cdot x^{(j)}') == 'ω_(ij) = x^((i)) · x^((j))'
    assert plain_maths('no maths: a $5 note') == 'no maths: a 5 note'
    assert '\\' not in plain_maths(r'\begin{aligned} m &= \max(m, s) \\ l &= l\, e^{m} \end{aligned}')


def test_figure_text_is_measured_on_a_phone():
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from tools.pytest_notebooks import figure_text_px
    fig, ax = plt.subplots(figsize=(7, 3)); ax.set_title('small', fontsize=9); ax.set_xlabel('large', fontsize=14)
    (px_small, text_small), *_ = figure_text_px(fig)
    assert text_small == 'small' and abs(px_small - 9 / 72 * 339 / 7) < 1e-9      # 6.05 px: too small
    fig.set_figwidth(3)                                                         # shown at 94.5 px per inch
    assert abs(figure_text_px(fig)[0][0] - 9 / 72 * 94.5) < 1e-9
    plt.close(fig)


def test_pages_link_their_notebook_and_not_colab(tmp_path, monkeypatch):
    "Under each title: a link to download the page's notebook; none to Colab, where no notebook of this site runs."
    from tools.docs import ROOT, reader_additions
    monkeypatch.chdir(ROOT)
    nb = {'cells': [{'cell_type': 'markdown', 'metadata': {}, 'source': '# Title'}],
          'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
    p = tmp_path/'index.ipynb'  # a processed copy of nbs/index.ipynb
    p.write_text(json.dumps(nb))
    reader_additions(p)
    text = ''.join(c['source'] if isinstance(c['source'], str) else ''.join(c['source']) for c in json.loads(p.read_text())['cells'])
    assert '<a href="notebooks/index.ipynb" download>' in text
    assert 'colab' not in text.lower()


def _documented(x: int,     # the input
                name: str = 'x',  # what the messages call it
                ) -> int:   # the input, checked
    "A function with docments."
    return x


def test_parameter_tables_sit_in_a_div_a_phone_can_stack():
    from tools.showdoc_tables import ParamTables
    md = ParamTables(_documented)._repr_markdown_()
    assert '<span id="_documented" class="api-anchor"></span>' in md
    div = md[md.index('::: {.api-params}'):]
    assert div.splitlines()[2] == '| `_documented(…)` | type | default | |'
    assert "| `name` | `str` | `'x'` | what the messages call it |" in div
    assert div.rstrip().endswith(':::\n\n</details>')
    assert md.index('<details class="api-details">') < md.index('::: {.api-params}')   # folded
    assert '<summary>Parameters of <code>_documented(…)</code></summary>' in md


def test_the_child_times_each_cell_it_runs(tmp_path):
    "`--cell-times`' numbers: each code cell run gets its number (from 1, as nbdev counts), its seconds and first line."
    from execnb.nbio import read_nb
    from tools.pytest_notebooks import _run_in_child
    cell = lambda kind, src: dict(cell_type=kind, metadata={}, source=src,
                                  **(dict(outputs=[], execution_count=None) if kind == 'code' else {}))
    path = tmp_path/'timed.ipynb'
    path.write_text(json.dumps(dict(nbformat=4, nbformat_minor=5, metadata={}, cells=[
        cell('markdown', '# A page'), cell('code', 'import time'), cell('code', '#| slow\ntime.sleep(0.3)'),
        cell('code', '1 + 1')])))
    nb = read_nb(path)
    todo = {id(c) for c in nb.cells if c.cell_type == 'code' and '#| slow' not in c.source}  # as --quick skips
    outputs, error, seconds = _run_in_child(path, nb, todo)
    assert error is None and [(n, head) for n, _, head in seconds] == [(2, 'import time'), (4, '1 + 1')]
    assert all(0 <= t < 0.3 for _, t, _ in seconds)                    # the skipped sleep is in none of them
    nb = read_nb(path)
    _, _, seconds = _run_in_child(path, nb, {id(c) for c in nb.cells if c.cell_type == 'code'})
    assert [n for n, _, _ in seconds] == [2, 3, 4] and seconds[1][1] >= 0.3


def _notebook(path, *codes, outputs=None):
    "A notebook of code cells at `path`; `outputs`: the saved outputs of each cell (none by default)."
    cells = [dict(cell_type='code', metadata={}, source=src, execution_count=None,
                  outputs=(outputs or {}).get(i, [])) for i, src in enumerate(codes)]
    path.write_text(json.dumps(dict(nbformat=4, nbformat_minor=5, metadata={}, cells=cells)))
    return path


@pytest.mark.parametrize('kind, codes, says', [
    ('raises', ['x = 1', '1 / 0'], 'cell #2 (1 / 0) raised'),
    ('sets torch.set_default_dtype', ['import torch', 'torch.set_default_dtype(torch.float64)'],
     'torch.get_default_dtype()'),
    ('turns grad off for good', ['import torch', 'torch.set_grad_enabled(False)'], 'torch.is_grad_enabled()'),
    ('puts its own method on a package class',
     ['from selfattn_nbdev.multihead import MultiHeadAttention',
      'MultiHeadAttention.extra_repr = lambda self: "mine"'], 'selfattn_nbdev.multihead.MultiHeadAttention.extra_repr'),
    ('adds a method to a package class',
     ['from selfattn_nbdev.multihead import MultiHeadAttention', 'MultiHeadAttention.norms = lambda self: 1'],
     'selfattn_nbdev.multihead.MultiHeadAttention.norms'),
    ('replaces a package function', ['import selfattn_nbdev.generation as g', 'g.truncated_logits = print'],
     'selfattn_nbdev.generation.truncated_logits'),
])
def test_a_notebook_fails_when_it_raises_or_leaks(tmp_path, kind, codes, says):
    """What `nbdev_test` catches by running notebooks one after another in a process, the pytest item catches in one
    run: a cell that raises, and a notebook that changes the process for the next one."""
    from tools.pytest_notebooks import NotebookFailure, check_notebook
    with pytest.raises(NotebookFailure, match=re.escape(says)):
        check_notebook(_notebook(tmp_path/'nb.ipynb', *codes))


def test_a_notebook_fails_when_it_prints_other_than_its_saved_outputs(tmp_path):
    from tools.pytest_notebooks import NotebookFailure, check_notebook
    said = lambda text: [dict(output_type='stream', name='stdout', text=text)]
    path = _notebook(tmp_path/'nb.ipynb', 'print(0.25)', outputs={0: said('0.25\n')})
    check_notebook(path)                                            # what it prints is what it saved
    path = _notebook(tmp_path/'nb.ipynb', 'print(0.25)', outputs={0: said('0.5\n')})
    with pytest.raises(NotebookFailure, match='print something else than the outputs saved'):
        check_notebook(path)


def test_a_notebook_that_puts_back_what_it_changes_passes(tmp_path):
    "Settings changed inside a `with` block, and a package method patched in and put back, leave nothing behind."
    from tools.pytest_notebooks import check_notebook
    check_notebook(_notebook(tmp_path/'nb.ipynb', 'import torch', 'with torch.no_grad(): y = torch.ones(2) * 2',
                             'from selfattn_nbdev.multihead import MultiHeadAttention\n'
                             'old = MultiHeadAttention.extra_repr\nMultiHeadAttention.extra_repr = lambda self: "x"\n'
                             'MultiHeadAttention.extra_repr = old'))


def test_the_quick_loop_runs_every_value_of_a_grid_once(pytester):
    "make test-quick runs a large grid on a covering subset: every value of every parameter, fewer cases."
    pytester.makeconftest("pytest_plugins = ['conftest_under_test']\n"
                          "def pytest_addoption(parser): parser.addoption('--quick', action='store_true')\n")
    code = (Path(__file__).resolve().parents[1]/'conftest.py').read_text().replace('pytest_plugins', '_plugins')
    (pytester.path/'conftest_under_test.py').write_text(code)
    pytester.makepyfile(test_grid="""
import pytest
@pytest.mark.parametrize('a', range(5))
@pytest.mark.parametrize('b', ['x', 'y', 'z'])
def test_big(a, b): print('RAN', a, b)
@pytest.mark.parametrize('c', range(3))
def test_small(c): pass
""")
    full, quick = pytester.runpytest('-q', '-s'), pytester.runpytest('-q', '-s', '--quick')
    full.assert_outcomes(passed=18)
    ran = set(re.findall(r'RAN (\d) (\w)', quick.stdout.str()))
    assert {a for a, _ in ran} == set('01234') and {b for _, b in ran} == set('xyz')  # every value once
    assert len(ran) == 7                     # (0..4, x), then (0, y) and (0, z): 7 of 15 cases
    quick.assert_outcomes(passed=10, deselected=8)                 # and the small grid whole


def test_the_walk_lets_through_only_hosts_that_answer(tmp_path):
    "The site walk aborts a request to a host no connection reaches (at once, not after Chromium's 5 s), once a host."
    import socket
    from tools.walk_site import reachable, serve
    server, base = serve(tmp_path)
    try:
        closed = socket.socket(); closed.bind(('127.0.0.1', 0)); port = closed.getsockname()[1]; closed.close()
        seen = {}
        assert reachable(base + 'page.html', seen) is True                 # the site's own server answers
        assert reachable(f'http://127.0.0.1:{port}/fonts.css', seen) is False  # nobody listens there
        assert reachable('https://no-such-host.invalid/x.css', seen) is False   # no such name
        assert seen == {('127.0.0.1', server.server_address[1]): True, ('127.0.0.1', port): False,
                        ('no-such-host.invalid', 443): False}
    finally: server.shutdown()


def test_each_indented_line_of_code_carries_its_indent(tmp_path):
    "tools/docs.py marks Quarto's line spans with --indent (at most INDENT_MOST) for the phone's hanging indent."
    from tools.docs import INDENT_MOST, hanging_indents
    line = lambda n, spaces, text: (f'<span id="cb1-{n}"><a href="#cb1-{n}" aria-hidden="true" tabindex="-1"></a>'
                                    f'{" " * spaces}{text}</span>')
    page = tmp_path / 'p.html'
    page.write_text('<pre class="sourceCode"><code class="sourceCode python">' + '\n'.join(
        [line(1, 0, 'def f(x):'), line(2, 4, 'return g(x,'), line(3, 40, 'y)'),
         line(4, 0, '<span class="co">    a docstring\'s second line')]) + '</code></pre>')
    assert hanging_indents(tmp_path) == '3 indented code lines marked'
    html = page.read_text()
    assert '<span id="cb1-1"><a' in html                                    # no indent: no mark
    assert '<span id="cb1-2" style="--indent:4ch"><a' in html and '</a>    return' in html   # the text as it was
    assert f'<span id="cb1-3" style="--indent:{INDENT_MOST}ch"><a' in html
    assert '<span id="cb1-4" style="--indent:4ch"><a' in html       # its spaces inside the string's span


def test_a_long_name_in_code_breaks_after_a_dot_or_an_underscore(tmp_path):
    "tools/docs.py puts <wbr> after . and _ inside names of code (not in numbers, tags, or outputs); the text is as written."
    from tools.docs import name_breaks
    page = tmp_path / 'p.html'
    code = ('<span id="cb1-1"><a href="#cb1-1"></a>x <span class="op">=</span> transformers.models.qwen3_5'
            '.use_cache(<span class="fl">0.05</span>, a_b)</span>')
    page.write_text(f'<pre class="sourceCode"><code class="sourceCode python">{code}</code></pre>'
                    '<pre><code>an.output_line</code></pre>')
    assert name_breaks(tmp_path) == '5 breaks in names of code'
    html = page.read_text()
    assert 'transformers.<wbr>models.<wbr>qwen3_<wbr>5' not in html and 'qwen3_5.<wbr>use_<wbr>cache' in html
    assert 'transformers.<wbr>models.<wbr>qwen3_5' in html and 'a_<wbr>b' in html
    assert '0.05' in html and 'an.output_line' in html and '<a href="#cb1-1"></a>' in html
    assert re.sub(r'<[^>]+>', '', html) == re.sub(r'<[^>]+>', '', code) + 'an.output_line'


def test_a_long_name_in_inline_code_breaks_after_a_dot_or_an_underscore_and_a_short_one_stays_whole(tmp_path):
    """Inline code: a name of INLINE_LONG characters or more breaks at <wbr> as a block's names do; a shorter one
    (`head_dim`) gets no mark, so prose never splits it at a line's end; an output's <pre><code> none at all."""
    from tools.docs import INLINE_LONG, name_breaks
    page = tmp_path / 'p.html'
    long = 'transformers.models.qwen3_5.modeling_qwen3_5'
    assert len(long) >= INLINE_LONG > len('apply_chat_template')
    page.write_text(f'<h2>The <code>rope_theta</code></h2><p>In <code>{long}</code>, see '
                    '<a href="x.html#f"><code>apply_chat_template</code></a>.</p>'
                    '<pre><code>kept.as_printed_by_a_cell_output_line.x</code></pre>')
    assert name_breaks(tmp_path) == '4 breaks in names of code'
    html = page.read_text()
    assert '<code>transformers.<wbr>models.<wbr>qwen3_5.<wbr>modeling_<wbr>qwen3_5</code>' in html
    assert '<code>rope_theta</code>' in html and '<code>apply_chat_template</code>' in html
    assert '<pre><code>kept.as_printed_by_a_cell_output_line.x</code></pre>' in html
    page.write_text('<p><code>(module, q) -&gt; q</code></p><pre><code>f() -&gt; x</code></pre>')
    name_breaks(tmp_path)                                   # an arrow stays whole; an output is left as printed
    assert page.read_text() == ('<p><code>(module, q) <span class="arrow">-&gt;</span> q</code></p>'
                                '<pre><code>f() -&gt; x</code></pre>')


def test_llms_txt_lists_every_page_once_in_reading_order():
    """tools/docs.py's llms.txt (llmstxt.org): a title, a summary, then the sidebar's sections as H2 (Reference as
    Optional), each page once, in the sidebar's order, linked to its published page with its own summary."""
    import yaml
    from tools.docs import _title_and_summary, llms_text
    ROOT = Path(__file__).resolve().parents[1]
    text = llms_text()
    lines = text.splitlines()
    assert lines[0] == '# Self-attention from first principles' and lines[2].startswith('> ')
    sidebar = yaml.safe_load((ROOT / 'nbs' / 'sidebar.yml').read_text())['website']['sidebar']['contents']
    order = [n for item in sidebar for n in ([item] if isinstance(item, str) else item['contents'])]
    linked = re.findall(r'\]\(https://selfattn-nbdev\.github\.io/selfattn_nbdev/([\w.]+\.html)\)', text)
    expected = [re.sub(r'^\d+[a-zA-Z0-9]*_', '', n).replace('.ipynb', '.html') for n in order]
    assert linked == expected and len(set(linked)) == len(linked) == len(list((ROOT / 'nbs').glob('*.ipynb')))
    sections = [l[3:] for l in lines if l.startswith('## ')]
    assert sections == [('Optional' if s['section'] == 'Reference' else s['section'])
                        for s in sidebar if isinstance(s, dict)]
    assert sections[-1] == 'Optional'                                  # llmstxt.org: what a reader may skip
    title, summary = _title_and_summary(ROOT / 'nbs' / '10_masks.ipynb')
    assert f'- [{title}](https://selfattn-nbdev.github.io/selfattn_nbdev/masks.html): {summary}' in lines
    assert title == 'Masks as functions' and summary.startswith('A mask is a predicate')
