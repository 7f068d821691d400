"generate's min_p, repetition_penalty and its refusal of options it does not know."
import math

import pytest
import torch

from selfattn_nbdev.decoding import generate, keep_min_p, penalize_repeats, sample_next
from selfattn_nbdev.generation import TinyGPT


def test_min_p_draws_only_from_tokens_above_the_cut():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3                                    # (b, vocab)
    probs = (logits / 0.8).softmax(-1)
    allowed = probs >= 0.25 * probs.amax(-1, keepdim=True)
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_next(logits, 0.8, min_p=0.25, generator=g) for _ in range(300)])
    assert allowed.gather(1, draws.T).all()
    assert all(len(set(draws[:, r].tolist())) == int(allowed[r].sum()) for r in range(4))  # each one drawn


def test_min_p_equals_renormalised_sampling_with_the_same_generator():
    torch.manual_seed(1)
    logits = torch.randn(3, 20, dtype=torch.float64)
    kept = keep_min_p(logits, 0.1, temperature=1.3)
    ours = sample_next(logits, 1.3, min_p=0.1, generator=torch.Generator().manual_seed(5))
    probs = ((kept - kept.amax(-1, keepdim=True)) / 1.3).softmax(-1)
    theirs = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(5))[:, 0]
    assert torch.equal(ours, theirs)


def test_the_penalty_only_lowers_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = penalize_repeats(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0]]


def test_a_padded_row_is_penalized_as_it_is_alone():
    torch.manual_seed(0)
    model = TinyGPT(12, 64, 16, 2).eval()
    rows = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7])]
    together = generate(model, rows, 12, repetition_penalty=3.0)
    alone = [generate(model, [r], 12, repetition_penalty=3.0)[0] for r in rows]
    for a, b in zip(together, alone): assert torch.equal(a, b)
    plain = generate(model, rows, 12)
    assert any(not torch.equal(a, b) for a, b in zip(together, plain))  # the penalty acted


@pytest.mark.parametrize('option, value, said', [
    ('min_p', 1.5, 'min_p'), ('min_p', -0.1, 'min_p'),
    ('repetition_penalty', 0.0, 'repetition_penalty'), ('repetition_penalty', True, 'repetition_penalty')])
def test_bad_values_are_refused_by_name(option, value, said):
    model = TinyGPT(12, 64, 16, 2)
    with pytest.raises(ValueError, match=said):
        generate(model, torch.tensor([[1, 2]]), 3, **{option: value})


def test_unknown_options_are_refused_with_what_is_supported():
    model = TinyGPT(12, 64, 16, 2)
    with pytest.raises(TypeError) as e:
        generate(model, torch.tensor([[1, 2]]), 3, num_beams=2, eos_token_id=3)
    said = str(e.value)
    assert 'num_beams' in said and 'eos_token_id' in said and 'stop_ids' in said
    assert 'It supports:' in said and 'repetition_penalty' in said and 'min_p' in said


def test_a_penalty_without_seen_is_refused():
    with pytest.raises(ValueError, match='seen'):
        sample_next(torch.randn(2, 5), repetition_penalty=1.2)


OPTIONS = dict(temperature=0.7, top_k=6, top_p=0.8, min_p=0.15, repetition_penalty=1.3)


@pytest.mark.parametrize('names', [pair for i, a in enumerate(OPTIONS) for pair in
                                   [(a, b) for b in list(OPTIONS)[i + 1:]]] + [tuple(OPTIONS)],
                         ids=lambda names: '+'.join(names))
def test_options_compose_as_transformers_composes_them(names):
    """Each pair (and all five) against transformers' processors in generate's order: repetition penalty,
    temperature, top-k, top-p, min-p. The same generator draws from both distributions: the same tokens."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    given = {n: OPTIONS[n] for n in names}
    t = given.get('temperature', 1.0)
    steps = [RepetitionPenaltyLogitsProcessor(given['repetition_penalty'])] if 'repetition_penalty' in given else []
    steps += [TemperatureLogitsWarper(t)]
    steps += [TopKLogitsWarper(given['top_k'])] if 'top_k' in given else []
    steps += [TopPLogitsWarper(given['top_p'])] if 'top_p' in given else []
    steps += [MinPLogitsWarper(given['min_p'])] if 'min_p' in given else []
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 40, generator=gen, dtype=torch.float64) * 2        # (b, vocab)
    history = torch.randint(0, 40, (64, 6), generator=gen)
    seen = torch.zeros(64, 40, dtype=torch.bool).scatter(1, history, True)
    theirs = LogitsProcessorList(steps)(history, logits.clone()).softmax(-1)
    for seed in range(5):
        ours = sample_next(logits, t, given.get('top_k'), given.get('top_p'), torch.Generator().manual_seed(seed),
                           min_p=given.get('min_p'), repetition_penalty=given.get('repetition_penalty', 1.0),
                           seen=seen)
        want = torch.multinomial(theirs, 1, generator=torch.Generator().manual_seed(seed))[:, 0]
        assert torch.equal(ours, want), (names, seed)


def test_top_p_then_min_p_as_transformers():
    "The report's row: top-p first keeps tokens 0 and 1, min-p keeps both; min-p first would leave token 0 alone."
    probs = torch.tensor([[0.5, 0.3] + [0.005] * 40])
    g = torch.Generator().manual_seed(0)
    drawn = {sample_next(probs.log(), 1.0, top_p=0.6, min_p=0.5, generator=g).item() for _ in range(200)}
    assert drawn == {0, 1}
