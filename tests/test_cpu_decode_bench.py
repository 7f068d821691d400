"""bench/cpu_decode.py's own code on tiny models: the bytes a token reads (tied and untied heads, no position table),
the bare decode step it measures as headroom (the model's logits, weights row-major and column-major, GPT-2 and a
Llama with grouped key/value heads), the profile's breakdown of a step, and how the compile's seconds are counted."""
import pytest
import torch

pytest.importorskip('transformers')
from bench import cpu_decode  # noqa: E402
from conftest import tiny_decoder as tiny  # noqa: E402
from selfattn_nbdev.models import GPT2  # noqa: E402


def test_bytes_a_token_count_what_a_token_reads():
    g, l = tiny('gpt2'), tiny('llama')
    params = lambda m: sum(p.numel() for p in m.parameters())           # a tied table counted once
    assert cpu_decode.bytes_a_token(g) == 4 * (params(g) - 128 * 32)    # the position table is not read
    assert cpu_decode.bytes_a_token(l) == 4 * (params(l) - 97 * 32)     # one row of the untied embedding


@pytest.mark.parametrize('kind', ['gpt2', 'llama'])
@pytest.mark.parametrize('column_major', [False, True])
def test_the_bare_step_computes_the_models_logits(kind, column_major):
    model = tiny(kind)
    ids = torch.randint(0, 97, (1, 20))
    step = cpu_decode.bare_step(model, column_major)
    with torch.no_grad():
        want = model(ids)[0]                                             # (20, 97)
        got = torch.stack([step(int(t), p) for p, t in enumerate(ids[0])])
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_the_profile_accounts_for_the_step():
    prof = cpu_decode.profile_step(tiny('llama'))
    assert prof['operator_calls'] > 10 and prof['ms']['weights (linear)'] > 0
    assert sum(prof['ms'].values()) <= 1.5 * prof['profiled_step_ms']


def test_compile_seconds_is_the_first_call_less_the_next(monkeypatch):
    "The first generate(compile=True) pays the compile; the next reuses it: their difference is the compile's time."
    calls, clock = [], iter([0.0, 5.0, 5.0, 6.0])
    monkeypatch.setattr(cpu_decode.time, 'perf_counter', lambda: next(clock))
    monkeypatch.setattr(cpu_decode, 'generate', lambda *a, **k: calls.append(k))
    got = cpu_decode.compile_seconds(None, None, 4)
    assert got == dict(first_call_s=5.0, next_call_s=1.0, compile_s=4.0)
    assert [k['compile'] for k in calls] == [True, True]


@pytest.mark.slow
def test_the_compiled_profile_accounts_for_the_step():
    "The compiled step's profile: its graph's kernels hold time, and the kinds add up to no more than the step."
    prof = cpu_decode.profile_compiled_step(tiny('llama'))
    graph = cpu_decode.COMPILED_KINDS[0][0]
    assert prof['ms'][graph] > 0 and set(prof['ms']) >= {k for k, _ in cpu_decode.COMPILED_KINDS}
    assert sum(prof['ms'].values()) <= 1.5 * prof['profiled_step_ms']


def test_the_python_wrapper_row_is_compile_true_less_its_cpp_wrapper(monkeypatch):
    "The bench's `package compiled (Python wrapper)` differs from `compile=True` on a CPU by the C++ wrapper alone."
    from selfattn_nbdev import decoding
    seen = {}
    monkeypatch.setattr(torch, 'compile', lambda model, **options: seen.update(options) or model)
    decoding._decode_step(tiny('gpt2'), True)
    assert seen == {**cpu_decode.PYTHON_WRAPPER, 'options': {'cpp_wrapper': True}}


def test_a_later_process_times_the_same_first_call_and_the_run_hands_it_on(monkeypatch):
    """`later_process_compile` runs this file again as `--later-compile SHAPE THREADS` in the run's environment (its
    Inductor cache) and reads the child's last line; that flag sends `main` to the child alone."""
    import json, subprocess, sys, types
    seen = {}
    def run(cmd, **kw):
        seen.update(cmd=cmd, env=kw['env'])
        return types.SimpleNamespace(stdout='a line of the child\n' + json.dumps(dict(compile_s=4.0)) + '\n')
    monkeypatch.setattr(subprocess, 'run', run)
    assert cpu_decode.later_process_compile('llama', 2) == dict(compile_s=4.0)
    assert seen['cmd'][0] == sys.executable and seen['cmd'][-3:] == ['--later-compile', 'llama', '2']
    assert seen['cmd'][1].endswith('cpu_decode.py') and seen['env'] is cpu_decode.os.environ
    asked = []
    monkeypatch.setattr(cpu_decode, 'later_compile_child', lambda name, threads: asked.append((name, threads)))
    monkeypatch.setattr(sys, 'argv', ['cpu_decode.py', '--later-compile', 'gpt2', '1'])
    cpu_decode.main()
    assert asked == [('gpt2', 1)]


def test_host_overhead_times_both_steps_and_counts_per_layer():
    "bench/host_overhead.py: both steps timed, and the package's extra time divided over the layers, in microseconds."
    from bench import host_overhead
    out = host_overhead.per_layer('llama', rounds=1, steps=2)
    assert set(out) == {'package_ms', 'bare_ms', 'us_a_layer'} and out['package_ms'] > 0 and out['bare_ms'] > 0
    per_layer = (out['package_ms'] - out['bare_ms']) / host_overhead.LAYERS * 1e3
    assert abs(out['us_a_layer'] - per_layer) < 0.2


def test_the_small_pages_systems_run_on_the_ordinary_storages_and_give_the_moved_ones_back():
    "`small_pages` lends the weights kept in ordinary memory, and no move, within; the moved weights come back after."
    from selfattn_nbdev import decoding
    torch.manual_seed(0)
    model = GPT2(vocab_size=2048, context_length=64, d_model=512, num_heads=8, num_layers=1).eval()  # a 4 MiB table
    ordinary = cpu_decode.ordinary_storages(model)
    info = cpu_decode.moved_to_huge_pages(model)
    moved = [p.data_ptr() for p in model.parameters()]
    if decoding.huge_pages_on():
        assert info['moved_bytes'] >= 2048 * 512 * 4 and info['in_huge_pages_bytes'] > 0
    with cpu_decode.small_pages(model, ordinary):
        assert [p.data_ptr() for p in model.parameters()] == [d.data_ptr() for d in ordinary]
        assert decoding.weights_in_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == moved
    assert decoding.weights_in_huge_pages.__name__ == 'weights_in_huge_pages'  # the package's again


def test_a_cost_row_gives_each_step_its_rate_and_its_fraction_of_the_limit():
    "`costs`: medians of the rounds; a step's bytes over its time (a step writes a token to each row), over the limit."
    runs = {'package': [10.0, 30.0, 20.0], 'package compiled': [40.0, 50.0, 60.0], 'transformers dynamic': [5.0],
            'transformers static': [6.0, 8.0]}
    row = cpu_decode.cost_entry(runs, read=10**9, batch=4, bandwidth=25e9)
    assert row['tok_s'] == 20.0 and row['compiled']['tok_s'] == 50.0
    assert row['read_gb_s'] == pytest.approx(5.0) and row['fraction_of_limit'] == pytest.approx(0.2)  # 5 steps/s
    assert row['compiled']['read_gb_s'] == pytest.approx(12.5) and row['compiled']['fraction_of_limit'] == pytest.approx(0.5)
    assert row['others'] == {'transformers dynamic': 5.0, 'transformers static': 7.0, 'llama.cpp': None}
    assert 'compiled' not in cpu_decode.cost_entry({'package': [1.0]}, 1, 1, 1.0)  # not timed: no entry


def test_the_read_rate_of_a_round_is_its_best_pass(monkeypatch):
    "round_read_rate: the bytes summed over the fastest of three passes (a pass is only ever slowed)."
    clock = iter([0.0, 2.0, 2.0, 3.0, 3.0, 5.0])                       # passes of 2, 1 and 2 s
    monkeypatch.setattr(cpu_decode.time, 'perf_counter', lambda: next(clock))
    assert cpu_decode.round_read_rate(torch.ones(256)) == 1024.0      # 1 KiB in the best pass, 1 s


@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer slows torch.compile
def test_the_large_shape_is_measured_eager_and_compiled(monkeypatch):
    "large_runs on a tiny Llama config: both steps at both thread counts, the same tokens, fractions of one limit."
    monkeypatch.setattr(cpu_decode, 'LARGE', dict(
        model_type='llama', vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=128, tie_word_embeddings=True))
    threads = torch.get_num_threads()
    try: large = cpu_decode.large_runs(torch.ones(2**20), {'1_thread': {'sum': 1e10}, '2_threads': {'sum': 2e10}})
    finally: torch.set_num_threads(threads)
    assert set(large['runs']) == {'1', '2'}
    for r in large['runs'].values():
        c = r['compiled']
        assert c['tokens_equal'] and c['first_call_s'] > 0 and r['tok_s'] > 0
        assert c['fraction_of_limit'] == c['tok_s'] / r['limit_tok_s'] and len(r['read_rate_around']) == 2
