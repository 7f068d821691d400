"""One choice of kernel (issue "Add, never replace", point 2): the module's fused path and the transformers route both
ask kernels.choose_kernel, and for the same mask and scores they ask the same question and get the same kernel."""
import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from selfattn_nbdev import hf, kernels
from selfattn_nbdev.kernels import flex_mode
from selfattn_nbdev.llama_attention import LlamaAttention


def _asked(monkeypatch) -> list:
    "Every answer choose_kernel gives, from either route, in order."
    answers, real = [], kernels.choose_kernel
    def spy(*args, **kwargs):
        answers.append(real(*args, **kwargs)); return answers[-1]
    monkeypatch.setattr(kernels, 'choose_kernel', spy)
    monkeypatch.setattr(hf, 'choose_kernel', spy)
    return answers


CASES = [(T, padded, window, softcap, grad, mode)
         for T in (16, 1100) for padded in (False, True) for window in (None, 4)
         for softcap in (None, 30.0) for grad in (False, True) for mode in ('auto', 'eager')
         if not (T > 16 and mode == 'eager')]  # eager Flex at 1,100 tokens: slow, and the same table


@pytest.mark.parametrize('T, padded, window, softcap, grad, mode', CASES)
def test_the_module_and_the_transformers_route_choose_alike(monkeypatch, T, padded, window, softcap, grad, mode):
    torch.manual_seed(0)
    b, heads, hd = 2, 2, 8
    m = LlamaAttention(heads * hd, T, heads, window=window, softcap=softcap).double()
    pad = torch.arange(T) >= torch.tensor([[T], [T - 3]]) if padded else None  # the second row: 3 pads
    answers = _asked(monkeypatch)
    with flex_mode(mode), torch.set_grad_enabled(grad):
        m(torch.randn(b, T, heads * hd, dtype=torch.float64, requires_grad=grad), key_padding_mask=pad)
        module = list(answers); answers.clear()
        q, k, v = (torch.randn(b, heads, T, hd, dtype=torch.float64, requires_grad=grad) for _ in range(3))
        function = None if window is None else sliding_window_causal_mask_function(window)
        mask = hf.hf_mask(b, T, T, mask_function=function, attention_mask=None if pad is None else ~pad,
                          local_size=window, allow_is_causal_skip=False)
        hf.attend(q, k, v, mask, softcap=softcap)
    plain = not padded and (window is None or window >= T) and softcap is None
    assert module == answers and len(module) == (0 if plain else 1), (module, answers)


def test_a_capped_causal_call_without_a_mask_asks_too(monkeypatch):
    "transformers gives no mask to a causal batch; with a soft cap the route still asks, as the module does."
    answers = _asked(monkeypatch)
    q = torch.randn(1, 2, 16, 8)
    with torch.no_grad(): out, _ = hf.attend(q, q, q, None, softcap=20.0)
    assert answers == ['explicit'] and out.shape == q.shape


def test_a_capped_causal_call_without_a_mask_gives_the_explicit_paths_numbers_on_flex(monkeypatch):
    "The maskless capped call that now asks choose_kernel: where it answers Flex, the numbers are the explicit path's."
    answers = _asked(monkeypatch)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        with flex_mode('eager'): flexed, _ = hf.attend(q, k, v, None, softcap=5.0)
        expected, _ = hf.attend(q, k, v, None, softcap=5.0, with_weights=True)
    assert answers == ['flex_eager'] and (flexed - expected).abs().max() < 1e-10
