"""nbdev_test runs several notebooks in one process. A notebook runs again the cells the package was written from:
its `@patch` cells must leave the package's methods in place, and torch.compile must not look a second notebook's
names up in the first notebook's `__main__`."""
import inspect, linecache, os, subprocess, sys, textwrap

import pytest

from selfattn_nbdev.core import patch
import selfattn_nbdev.kernels as kernels
from selfattn_nbdev.kernels import _attend_masked
from selfattn_nbdev.multihead import MultiHeadAttention


def _run_as(module_name: str, code: str, names: dict | None = None) -> dict:
    "Run `code` as the module `module_name` would (a notebook is `__main__`), after `names`; its names."
    names = {**(names or {}), '__name__': module_name, 'patch': patch, 'MultiHeadAttention': MultiHeadAttention}
    filename = f"<{module_name}>"  # its source readable, as IPython makes a cell's
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    exec(compile(code, filename, "exec"), names)
    return names


def test_a_notebook_running_the_package_cell_keeps_the_package_method():
    "The cell kernels.py was written from, run again as a notebook runs it: the class keeps the package's method."
    cell = textwrap.dedent(inspect.getsource(_attend_masked))
    imported = {k: v for k, v in vars(kernels).items() if not k.startswith('__')}  # what its import cell gave
    names = _run_as('__main__', cell, imported)
    assert MultiHeadAttention._attend_masked is _attend_masked     # the package's, with the package's globals
    assert names['_attend_masked'] is _attend_masked               # and the notebook's name is it too


def test_a_package_module_cannot_replace_a_method():
    "Add, never replace: a second definition of a name, from a module of the package, is refused by name."
    with pytest.raises(TypeError, match=r"patch adds names: MultiHeadAttention._attend_masked exists \(from "
                                        r"selfattn_nbdev.kernels\); give the method of selfattn_nbdev.later"):
        _run_as('selfattn_nbdev.later', '@patch\ndef _attend_masked(self:MultiHeadAttention): return 0\n')
    assert MultiHeadAttention._attend_masked is _attend_masked


def test_a_notebook_being_edited_may_replace_a_method():
    "While you edit a page, its new version of a method is the one that runs (the package's comes back on export)."
    try:
        _run_as('__main__', '@patch\ndef _attend_masked(self:MultiHeadAttention): return "edited"\n')
        assert MultiHeadAttention(4, 4, 4)._attend_masked() == 'edited'
    finally: MultiHeadAttention._attend_masked = _attend_masked
    assert MultiHeadAttention._attend_masked is _attend_masked


def test_a_new_name_is_added():
    try:
        names = _run_as('__main__', '@patch\ndef norms_of_heads(self:MultiHeadAttention): return 3\n')
        assert MultiHeadAttention(4, 4, 4).norms_of_heads() == 3
        assert MultiHeadAttention.norms_of_heads.__qualname__ == 'MultiHeadAttention.norms_of_heads'
        assert names['norms_of_heads'] is MultiHeadAttention.norms_of_heads
    finally: del MultiHeadAttention.norms_of_heads


# a notebook that compiles FlexAttention itself, not through the package
ELSEWHERE = ("import torch\nfrom torch.nn.attention.flex_attention import flex_attention\n"
             "cap = 5.0\ndef capped(score, b, h, q_idx, kv_idx): return cap * torch.tanh(score / cap)\n"
             "q = torch.randn(1, 2, 128, 16)\n"
             "out = torch.compile(flex_attention)(q, q, q, score_mod=capped)\nok = True")
# a notebook whose score function reads a module of its own `__main__` (`numbers`)
SECOND = ("import torch, numbers\nfrom selfattn_nbdev.kernels import flex_attend\n"
          "def capped(score, b, h, q_idx, kv_idx):\n"
          "    assert isinstance(5.0, numbers.Real)\n    return 5 * torch.tanh(score / 5)\n"
          "def causal(b, h, q_idx, kv_idx): return q_idx >= kv_idx\n"
          "q = torch.randn(1, 2, 128, 16)\n"
          "out = flex_attend(q, q, q, causal, compiled={compiled}, score_mod=capped)\nok = True")


@pytest.mark.heavy  # a fresh process that compiles: make test and CI run it, make test-quick skips it
def test_flex_in_a_second_notebook():
    """torch.compile caches the first `__main__` it imports. A later notebook's score function that reads one of its
    modules must still compile: after a notebook that compiled Flex itself, eagerly (flex_attention compiles itself
    even when the package does not ask it to) and compiled, and again after a notebook that compiled through the
    package. One process for all four, as nbdev_test runs them."""
    first = ("import torch\nfrom selfattn_nbdev.kernels import flex_attend\n"
             "def causal(b, h, q_idx, kv_idx): return torch.ge(q_idx, kv_idx)\n"
             "q = torch.randn(1, 2, 128, 16)\nout = flex_attend(q, q, q, causal, compiled=True)\nok = True")
    _in_one_process(ELSEWHERE, SECOND.format(compiled=False), SECOND.format(compiled=True), first,
                    SECOND.format(compiled=True))


def _in_one_process(*notebooks):
    "Run each code as a notebook of its own (a new shell, a new __main__), all in one fresh process."
    script = textwrap.dedent(f'''
        from execnb.shell import CaptureShell
        for code in {notebooks!r}:
            shell = CaptureShell(); shell.run(code)
            assert shell.user_ns.get('ok'), shell.exc
        print('all ran')
    ''')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode == 0 and 'all ran' in out.stdout, out.stdout + out.stderr[-3000:]


def test_a_notebooks_switch_steers_the_package_methods():
    """A notebook defines its own `attention_kernel` (the cell runs again), while the class keeps the package's
    methods: the switch they share lives in an earlier module (core's `_switches`), so the notebook's copy steers them."""
    import torch
    imported = {k: v for k, v in vars(kernels).items() if not k.startswith('__')}
    source = inspect.getsource(kernels)  # the cell of the switches, as the notebook runs it: its state too
    cell = source[source.index('FLEX_MODES = '):source.index('def pick_kernel(')]
    names = _run_as('__main__', cell, imported)
    mine = names['attention_kernel']
    assert mine is not kernels.attention_kernel                      # the notebook's own copy
    lm, x = MultiHeadAttention(8, 8, 8, num_heads=2), torch.randn(1, 4, 8)
    with mine('dense'), pytest.raises(Exception, match='no score function'):
        lm(x, score_mod=lambda score, b, h, q, kv: score)
    with mine('explicit'), torch.no_grad():
        assert kernels._switches.kernel == 'explicit'


def test_forget_old_main_clears_the_cache_torch_keeps(monkeypatch):
    "On a torch that caches imported modules (2.13, 2.14), a new `__main__` clears that cache and resets Dynamo."
    import types
    import torch
    import torch._dynamo.symbolic_convert as convert
    from selfattn_nbdev import core
    cleared, reset = [], []
    monkeypatch.setattr(convert, '_import_module', types.SimpleNamespace(cache_clear=lambda: cleared.append(1)))
    monkeypatch.setattr(torch._dynamo, 'reset', lambda: reset.append(1))
    monkeypatch.setattr(core, '_last_main', [None])
    core._forget_old_main(); core._forget_old_main()     # the second: the same __main__, nothing to do
    assert cleared == [1] and reset == [1]


def test_forget_old_main_does_nothing_on_a_torch_without_the_cache(monkeypatch):
    """PyTorch's pull request 197046 removes `_import_module`: on such a torch a compiled call must not fail on
    the missing name, and Dynamo keeps what it compiled."""
    import torch
    import torch._dynamo.symbolic_convert as convert
    from selfattn_nbdev import core
    reset = []
    monkeypatch.delattr(convert, '_import_module')
    monkeypatch.setattr(torch._dynamo, 'reset', lambda: reset.append(1))
    monkeypatch.setattr(core, '_last_main', [None])
    core._forget_old_main()
    assert reset == []
