"""nbdev_test runs several notebooks in one process: a method that one notebook adds to a package class must not
be what the next notebook runs."""
import os, subprocess, sys, textwrap

import pytest

pytestmark = pytest.mark.heavy  # fresh processes that compile: make test and CI run it, make test-quick skips it


def test_a_notebooks_method_stays_in_that_notebook():
    script = textwrap.dedent('''
        from execnb.shell import CaptureShell
        from selfattn_nbdev.multihead import MultiHeadAttention
        package = MultiHeadAttention(4, 4, 4).extra_repr()
        first = CaptureShell()
        first.run("from selfattn_nbdev.core import patch\\n"
                  "from selfattn_nbdev.multihead import MultiHeadAttention\\n"
                  "@patch\\n"
                  "def extra_repr(self:MultiHeadAttention): return 'first notebook'\\n"
                  "@patch\\n"
                  "def norms(self:MultiHeadAttention): return 'new method'\\n"
                  "seen = MultiHeadAttention(4, 4, 4).extra_repr()\\n"
                  "replaced = MultiHeadAttention.extra_repr.replaced(MultiHeadAttention(4, 4, 4))")
        assert first.user_ns['seen'] == 'first notebook', first.user_ns.get('seen')
        assert first.user_ns['replaced'] == package
        second = CaptureShell()
        second.run("from selfattn_nbdev.multihead import MultiHeadAttention\\n"
                   "seen = MultiHeadAttention(4, 4, 4).extra_repr()\\n"
                   "has_new = hasattr(MultiHeadAttention, 'norms')")
        assert second.user_ns['seen'] == package, second.user_ns['seen']
        assert second.user_ns['has_new'] is False
        print('isolated')
    ''')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and 'isolated' in out.stdout, out.stdout + out.stderr


# a notebook that compiles FlexAttention itself, not through the package
ELSEWHERE = ("import torch\nfrom torch.nn.attention.flex_attention import flex_attention\n"
             "cap = 5.0\ndef capped(score, b, h, q_idx, kv_idx): return cap * torch.tanh(score / cap)\n"
             "q = torch.randn(1, 2, 128, 16)\n"
             "out = torch.compile(flex_attention)(q, q, q, score_mod=capped)\nok = True")
# a notebook whose score function reads a module of its own `__main__` (`numbers`)
SECOND = ("import torch, numbers\nfrom selfattn_nbdev.masks import flex_attend\n"
          "def capped(score, b, h, q_idx, kv_idx):\n"
          "    assert isinstance(5.0, numbers.Real)\n    return 5 * torch.tanh(score / 5)\n"
          "def causal(b, h, q_idx, kv_idx): return q_idx >= kv_idx\n"
          "q = torch.randn(1, 2, 128, 16)\n"
          "out = flex_attend(q, q, q, causal, compiled={compiled}, score_mod=capped)\nok = True")


def test_compiled_flex_in_a_second_notebook():
    "torch.compile caches the first `__main__` it imports: a second notebook's score function must still compile."
    first = ("import torch\nfrom selfattn_nbdev.masks import flex_attend\n"
             "def causal(b, h, q_idx, kv_idx): return torch.ge(q_idx, kv_idx)\n"
             "q = torch.randn(1, 2, 128, 16)\nout = flex_attend(q, q, q, causal, compiled=True)\nok = True")
    second = SECOND.format(compiled=True)
    _in_one_process(ELSEWHERE, second, first, second)


def test_eager_flex_after_a_notebook_compiled_flex():
    """flex_attention compiles itself even when the package does not ask it to: a score function of the second
    notebook that reads one of its modules must not be looked up in the first notebook's `__main__`."""
    _in_one_process(ELSEWHERE, SECOND.format(compiled=False))


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
