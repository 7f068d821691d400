"""The project's own tooling: the stale-output comparison of the notebook plugin and the README renderer."""
import json

from tools.pytest_notebooks import same_text, summarise


def test_numbers_compare_to_printed_precision():
    assert same_text('tensor([0.1385, 0.2379])', 'tensor([0.1386, 0.2379])')      # one unit in the last digit
    assert not same_text('tensor([0.1385, 0.2379])', 'tensor([0.1395, 0.2379])')  # ten units
    assert not same_text('tensor([0.1385])', 'tensor([0.1385, 0.2])')             # shape changed
    assert not same_text('grad_fn=<MmBackward0>', 'grad_fn=<BmmBackward0>')       # text changed
    assert same_text('nan', 'nan')


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
