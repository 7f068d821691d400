"""bench/decode_guards.py's own code on a tiny model: both ways write the same tokens, each round times one call each
way, and a call's step time leaves out its first two (the prompt's, and the first step, which checks every guard)."""
import pytest
import torch

pytest.importorskip('transformers')
from bench import decode_guards  # noqa: E402
from conftest import tiny_decoder as tiny  # noqa: E402


@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer slows torch.compile
def test_measure_times_generate_and_the_stream_on_the_same_tokens(monkeypatch):
    monkeypatch.setattr(decode_guards, 'NEW', 6)
    monkeypatch.setattr(decode_guards, 'ROUNDS', 2)
    model, ids = tiny('gpt2'), torch.randint(0, 97, (1, 5))
    tokens, times = decode_guards.generate_times(model, ids)
    assert tokens.shape == (1, 11) and len(times) == 6
    streamed, times = decode_guards.stream_times(model, ids)
    assert torch.equal(streamed, tokens) and len(times) == 6
    entry = decode_guards.measure(model, ids)
    assert entry['same_tokens'] and all(len(t) == 2 and min(t) > 0 for t in entry['ms_each_round'].values())
    assert entry['ratio_stream_over_generate'] == entry['ms']['generate_stream'] / entry['ms']['generate']
    assert 0 < entry['guards']['kept'] < entry['guards']['checked']         # the host checks the rest
