"""generate's default, compile='auto': on a CPU the decode steps run eagerly, timed, until this model's eager steps
of a batch shape have cost about one compile (COMPILE_AFTER_SECONDS); then the step is compiled, once, and every later
step and call of that shape reuses it. Rent until the rent paid equals the price, then buy: the time lost is at most about twice the better
choice made in hindsight, without knowing how long the user will decode."""
import logging

import pytest
import torch

from selfattn_nbdev import decoding
from selfattn_nbdev.decoding import generate
from selfattn_nbdev.models import Llama


def _llama(seed=0):
    torch.manual_seed(seed)
    return Llama(vocab_size=97, context_length=512, d_model=64, num_heads=4, num_layers=2, num_kv_heads=2).eval()


PROMPT = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))


def _reference(model, new):
    "The package's reference path: a growing cache, eager steps, never compiled."
    return generate(model, PROMPT, new, compile=False, static=False)


def _eager_backend(monkeypatch):
    "The switch and its bookkeeping without Inductor's seconds: Dynamo traces the step and runs it eagerly."
    made, real = [], decoding._decode_step
    def step(model, compile, asked=True):
        if compile is False: return real(model, False)
        made.append((compile, asked))
        return real(model, dict(backend='eager', fullgraph=True), asked)
    monkeypatch.setattr(decoding, '_decode_step', step)
    return made


def test_a_short_call_decodes_eagerly_and_counts_its_steps_seconds(monkeypatch):
    "Below the threshold nothing compiles (no graph made), the tokens are the reference's, and the rent is kept."
    model, made = _llama(), _eager_backend(monkeypatch)
    assert decoding.COMPILE_AFTER_SECONDS == 10.0  # the default: about one compile (Measurements)
    assert torch.equal(generate(model, PROMPT, 12), _reference(model, 12))
    assert made == []
    spent = model.__dict__['_eager_step_seconds'][torch.get_num_threads(), 2, False]  # threads, rows, padded
    assert 0 < spent < decoding.COMPILE_AFTER_SECONDS


def test_the_step_is_compiled_in_the_middle_of_a_call_once_the_eager_steps_have_cost_a_compile(monkeypatch, caplog):
    """The first decode step runs eagerly (nothing spent yet), the second finds the rent paid and compiles: the same
    static caches carry on, counted by the host from then on, and the tokens are the reference's. The switch says why
    at WARNING; a later call reuses the graphs and compiles nothing."""
    model, made = _llama(), _eager_backend(monkeypatch)
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 1e-12)
    with caplog.at_level(logging.WARNING, logger='selfattn_nbdev.decoding'):
        assert torch.equal(generate(model, PROMPT, 12), _reference(model, 12))
    assert made == [(True, False)]  # compile=True's options, asked by 'auto'
    assert any('compiling the step now' in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    steps = []
    assert torch.equal(generate(model, PROMPT, 20, step_times=steps), _reference(model, 20))
    assert len(made) == 2 and len(steps) == 20  # a new step function, no new warning:
    assert sum('compiling the step now' in r.getMessage() for r in caplog.records) == 1


def test_a_batch_of_another_shape_pays_its_own_rent(monkeypatch, caplog):
    """Each batch shape (its rows, padded or not) compiles a graph of its own, seconds each: once a shape has compiled,
    another still runs eagerly until its own eager steps have cost a compile, while the compiled shape goes on at once.
    So the bound holds per graph: a session never pays a compile that its steps of that shape have not earned."""
    model, made = _llama(), _eager_backend(monkeypatch)
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 1e-12)
    assert torch.equal(generate(model, PROMPT, 6), _reference(model, 6))   # 2 rows: compiled at its second step
    assert len(made) == 1
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 10.0)
    padded, said = [PROMPT[0, 3:], PROMPT[1]], lambda: [r.getMessage() for r in caplog.records
                                                        if r.name == 'selfattn_nbdev.decoding']
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger='selfattn_nbdev.decoding'):
        assert torch.equal(generate(model, PROMPT[:1], 6), generate(model, PROMPT[:1], 6, compile=False))  # 1 row
        eager = generate(model, padded, 6, compile=False)
        assert all(torch.equal(a, b) for a, b in zip(generate(model, padded, 6), eager))  # 2 rows, padded
    assert len(made) == 1 and not said()                                     # both eager, their rent not paid
    spent = model.__dict__['_eager_step_seconds']
    threads = torch.get_num_threads()
    assert spent[threads, 1, False] > 0 and spent[threads, 2, True] > 0
    generate(model, PROMPT, 6)                                               # 2 rows again: compiled at once
    assert len(made) == 2
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 1e-12)            # the 1-row shape's rent, paid:
    with caplog.at_level(logging.WARNING, logger='selfattn_nbdev.decoding'):
        generate(model, PROMPT[:1], 6)
    assert len(made) == 3
    assert any('steps of 1 row(s) at' in m for m in said())


def test_a_model_compiled_by_compile_true_is_reused_by_auto_at_once(monkeypatch):
    model, made = _llama(), _eager_backend(monkeypatch)
    generate(model, PROMPT, 4, compile=True)
    assert torch.equal(generate(model, PROMPT, 6), _reference(model, 6))
    assert made == [(True, True), (True, False)]


def test_other_compile_options_are_not_what_auto_reuses(monkeypatch):
    "A step compiled by another backend (a dict of options) is not compile=True's graph: auto keeps its own count."
    model, made = _llama(), _eager_backend(monkeypatch)
    generate(model, PROMPT, 4, compile=dict(backend='eager'))
    generate(model, PROMPT, 4)
    assert made == [(dict(backend='eager'), True)]


@pytest.mark.parametrize('options', [dict(compile=False), dict(static=False), dict(use_cache=False)])
def test_auto_never_compiles_when_told_not_to_or_without_a_fixed_cache(monkeypatch, options):
    model, made = _llama(), _eager_backend(monkeypatch)
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 0.0)
    assert torch.equal(generate(model, PROMPT, 6, **options), _reference(model, 6))
    assert made == []


def test_a_step_that_does_not_compile_stays_eager_said_once_and_the_caches_count_right(monkeypatch):
    """No C++ compiler, say: the first compiled call raises after the host has counted its tokens (begin_step). The
    caches' counts are put back, the step runs eagerly, the tokens are the reference's; a warning names the error
    and compile=False, once: the model is not compiled again."""
    model, tries = _llama(), []
    real = decoding._decode_step
    def failing(model, compile, asked=True):
        if compile is False: return real(model, False)
        def step(token_ids, caches):
            tries.append(1)
            for cache in caches: cache.begin_step(token_ids.shape[1])
            raise RuntimeError('no C++ compiler found')
        return step
    monkeypatch.setattr(decoding, '_decode_step', failing)
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 0.0)
    with pytest.warns(UserWarning, match=r"did not compile \(RuntimeError: no C\+\+ compiler found\).*compile=False"):
        assert torch.equal(generate(model, PROMPT, 12), _reference(model, 12))
    assert tries == [1]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert torch.equal(generate(model, PROMPT, 12), _reference(model, 12))
    assert tries == [1]


def test_compile_takes_auto_true_false_or_options_and_names_them():
    with pytest.raises(TypeError, match=r"compile must be 'auto', True, False or a dict.*got 'fast'"):
        generate(_llama(), PROMPT, 3, compile='fast')


@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer slows torch.compile
def test_auto_compiles_by_inductor_and_writes_the_reference_tokens(monkeypatch, caplog):
    "The real thing, once: Inductor with its C++ wrapper, switched in after the first step; the compile's seconds said."
    model = _llama()
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 1e-12)
    with caplog.at_level(logging.WARNING, logger='selfattn_nbdev.decoding'):
        assert torch.equal(generate(model, PROMPT, 12), _reference(model, 12))
    said = [r.getMessage() for r in caplog.records]
    assert any('compiling the step now' in m for m in said) and any('compiled and ran once in' in m for m in said)
    made = decoding._graphs_made()
    assert torch.equal(generate(model, PROMPT, 12), _reference(model, 12))
    assert decoding._graphs_made() == made


def test_the_session_bench_records_each_call_and_when_the_step_compiled(monkeypatch):
    "bench/auto_compile.py's child on a tiny shape: a record per call; the default compiles once its rent is paid."
    pytest.importorskip('transformers')
    from bench import auto_compile, cpu_decode
    monkeypatch.setitem(cpu_decode.SHAPES, 'tiny', dict(model_type='llama', vocab_size=1000, hidden_size=32,
                                                          num_hidden_layers=1, num_attention_heads=4,
                                                          num_key_value_heads=2, intermediate_size=48,
                                                          max_position_embeddings=256))
    monkeypatch.setattr(auto_compile, 'NEW', 4)
    eager = auto_compile.child('tiny', 'eager (compile=False)', 3)
    assert len(eager['seconds']) == 3 and eager['compiled'] == [False] * 3 and eager['compiled_at_call'] is None
    assert eager['total_s'] == sum(eager['seconds']) and len(eager['tokens']) == 4
    made = _eager_backend(monkeypatch)
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 1e-12)  # paid by the first call's first step
    auto = auto_compile.child('tiny', "default (compile='auto')", 3)
    assert auto['compiled'] == [True] * 3 and auto['compiled_at_call'] == 1 and auto['tokens'] == eager['tokens']
    assert made and all(m == (True, False) for m in made)  # compile=True's options, chosen by 'auto'


@pytest.mark.slow
def test_the_switch_in_the_middle_of_a_call_writes_the_eager_tokens_in_every_family(monkeypatch, tmp_path):
    """Each native family's caches carry on from eager steps to compiled ones in the middle of a call (the host counts
    from then on): GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, DeepSeek-V3's latent attention, a hybrid
    Qwen3.5 stack and Gemma 4's shared layers, on a plain batch and a left-padded one. Dynamo traces each step whole
    (fullgraph) and runs it eagerly: the switch's bookkeeping, without Inductor's minutes."""
    pytest.importorskip('transformers')
    from bench.families import families
    from selfattn_nbdev.pretrained import from_hf
    from tests.test_crop import _qwen35
    from tests.test_gemma4 import hf_gemma4, ours_of
    _eager_backend(monkeypatch)
    monkeypatch.setattr(decoding, 'COMPILE_AFTER_SECONDS', 1e-12)  # step 1 eager, the rest compiled
    models = {'Qwen3.5 (hybrid)': _qwen35, 'Gemma 4 (shared keys)': lambda: ours_of(hf_gemma4(shared=2))}
    for name, make in families(128, 2, 256, 512).items():
        torch.manual_seed(0)
        folder = tmp_path / str(len(models))
        make().eval().save_pretrained(folder)
        models[name] = lambda folder=folder: from_hf(folder).eval()
    for name, make in models.items():
        model = make()
        vocab = model.vocab_size
        ids = torch.randint(1, min(vocab, 50), (2, 7), generator=torch.Generator().manual_seed(1))
        for prompts in (ids, [ids[0, 3:], ids[1]]):
            reference = generate(model, prompts, 6, compile=False, static=True)
            switched = generate(model, prompts, 6)
            same = (torch.equal(switched, reference) if isinstance(reference, torch.Tensor)
                    else all(torch.equal(a, b) for a, b in zip(switched, reference)))
            assert same, name
        graphs = {(torch.get_num_threads(), 2, padded) for padded in (False, True)}
        assert graphs <= model.__dict__['_step_compiled_at'], name
