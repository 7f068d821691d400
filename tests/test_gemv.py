"The kernel of one token's products: `gemv_kernel` measures, `faster_products` routes, `generate` holds it."
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import selfattn_nbdev.decoding as decoding
from selfattn_nbdev import generate
from selfattn_nbdev.models import GPT2, Llama
from selfattn_nbdev.decoding import (GEMM_PROBE_ROWS, GEMV_ROWS, KERNELS, LOOP_ROWS, compiled_gemv_kernel,
                                     faster_products, gemm_kernel, gemv_kernel, onednn_linear, row_bucket, row_dot,
                                     rows_kernel, stacked)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason='a build without oneDNN')


def _llama():
    torch.manual_seed(0)
    return Llama(vocab_size=64, context_length=64, d_model=32, num_heads=4, num_layers=2,
                 num_kv_heads=2).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2(vocab_size=64, context_length=64, d_model=32, num_heads=4, num_layers=2).eval()


def _routed(model) -> int:
    return sum('forward' in m.__dict__ for m in model.modules())


def _count(monkeypatch) -> list:
    "Rows handed to oneDNN, one entry a call."
    calls, real = [], decoding.onednn_linear
    def counted(x, weight, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return real(x, weight, bias)
    monkeypatch.setattr(decoding, 'onednn_linear', counted)
    return calls


def test_onednn_linear_is_f_linear():
    "Within a bound any correct float32 product meets: the same numbers, summed in another order."
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 1, 300), torch.randn(70, 300), torch.randn(70)
    expected = (x.double() @ w.double().T + b.double())
    bound = 300 * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T + b.abs()).max()
    assert (onednn_linear(x, w, b).double() - expected).abs().max() <= bound
    assert (onednn_linear(x, w) - F.linear(x, w)).abs().max() <= bound
    w.mul_(-2)   # written in place between two calls (an optimizer step): read anew
    assert (onednn_linear(x, w) - F.linear(x, w)).abs().max() <= 2 * bound


@pytest.mark.parametrize('build', [_llama, _gpt2], ids=['llama', 'gpt2'])
def test_every_plain_linear_is_routed_in_the_block_and_none_after(build, monkeypatch):
    model = build()
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    one = torch.randint(0, 64, (1, 1))
    with torch.no_grad():
        by_blas = model(one)
        calls = _count(monkeypatch)
        with faster_products(model, 'onednn'):
            assert _routed(model) == len(linears)
            by_onednn = model(one)
    assert len(calls) == len(linears) and set(calls) == {1}   # every product, one row each
    assert _routed(model) == 0
    torch.testing.assert_close(by_onednn, by_blas, rtol=1e-5, atol=1e-5)


def _choose(monkeypatch, few, many):
    "rows_kernel answers `few` up to GEMV_ROWS rows and `many` above, unmeasured."
    monkeypatch.setattr(decoding, 'rows_kernel',
                        lambda m, rows, linears=None: few if rows <= GEMV_ROWS else many)


@pytest.mark.parametrize('few, many', [('onednn', 'blas'), ('blas', 'onednn')])
def test_few_rows_and_many_take_their_own_kernel_and_a_gradient_stays_f_linear(few, many, monkeypatch):
    model, calls = _llama(), _count(monkeypatch)
    _choose(monkeypatch, few, many)
    with faster_products(model):
        with torch.no_grad(): model(torch.randint(0, 64, (1, GEMV_ROWS + 1)))   # a prompt
        assert bool(calls) == (many == 'onednn') and set(calls) <= {GEMV_ROWS + 1}
        calls.clear()
        with torch.no_grad(): model(torch.randint(0, 64, (GEMV_ROWS, 1)))        # a batch's step
        assert bool(calls) == (few == 'onednn') and set(calls) <= {GEMV_ROWS}
        calls.clear()
        model(torch.randint(0, 64, (1, 1))).sum().backward()                    # training: autograd's
        assert calls == [] and model.head.weight.grad is not None
    half = _llama().to(torch.bfloat16)
    with faster_products(half, 'onednn'): assert _routed(half) == 0


def test_a_subclass_a_hook_or_a_forward_of_your_own_is_left_alone():
    model = _llama()
    own = model.blocks[1].attn.out_proj
    handle = model.head.register_forward_hook(lambda *a: None)
    mine = lambda x: F.linear(x, own.weight, own.bias)
    own.forward = mine
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    with faster_products(model, 'onednn'):
        assert 'forward' not in model.head.__dict__ and own.forward is mine
        assert _routed(model) == len(linears) - 1  # all but the hooked head (own: its own)
    assert own.forward is mine and _routed(model) == 1
    handle.remove()


def test_nested_holders_keep_the_routing_until_the_last_leaves():
    model = _llama()
    with faster_products(model, 'onednn'):
        with faster_products(model, 'onednn'): pass
        assert _routed(model) > 0        # the outer block still holds it
    assert _routed(model) == 0


def test_the_stacked_product_uses_the_kernel_too(monkeypatch):
    model, calls = _llama(), _count(monkeypatch)
    with torch.no_grad(), stacked(model), faster_products(model, 'onednn'):
        model(torch.randint(0, 64, (1, 1)))
    # per block: q, k, v as one product, out_proj, gate and up as one, down; and the head
    assert len(calls) == 2 * 4 + 1, calls


def test_gemv_kernel_measures_once_and_keeps_a_clear_win_only(monkeypatch):
    model = _llama()
    monkeypatch.setattr(decoding, '_MEASURED', {})
    timed = []
    def fake(kernel, weights, xs):  # oneDNN takes `ratio` of BLAS's time
        timed.append(kernel)
        return ratio if kernel is decoding.onednn_linear else 1.0
    monkeypatch.setattr(decoding, '_timed', fake)
    ratio = 0.8
    assert gemv_kernel(model) == 'onednn' and len(timed) == 14  # seven passes each
    assert gemv_kernel(model) == 'onednn' and len(timed) == 14  # kept: not measured again
    assert gemm_kernel(model) == 'onednn' and len(timed) == 28  # a prompt's rows: its own
    timed.clear()
    decoding._MEASURED.clear(); ratio = 0.97                # within 5 %: BLAS stays
    assert gemv_kernel(model) == 'blas'
    threads = torch.get_num_threads()
    try:                                                        # another thread count:
        torch.set_num_threads(threads + 1); ratio = 0.5         # measured again
        assert gemv_kernel(model) == 'onednn'
    finally: torch.set_num_threads(threads)
    before, ratio = len(timed), 2.0                             # a model of other widths:
    wider = Llama(vocab_size=64, context_length=64, d_model=48, num_heads=4, num_layers=1)
    assert gemv_kernel(wider) == 'blas' and len(timed) == before + 14  # its own measurement
    assert gemv_kernel(model) == 'blas'                         # (kept from above)


def test_an_entry_finds_the_linears_once_and_the_kernels_answer_alike_inside(monkeypatch):
    "faster_products walks the model once an entry (a serving step enters it each step); inside, the choice holds."
    model = _llama()
    monkeypatch.setattr(decoding, '_MEASURED', {})
    monkeypatch.setattr(decoding, '_timed', lambda kernel, weights, xs: 0.5 if kernel is decoding.onednn_linear else 1.0)
    walks, find = [], decoding._linears
    monkeypatch.setattr(decoding, '_linears', lambda m: walks.append(m) or find(m))
    outside = gemv_kernel(model), gemm_kernel(model)
    assert outside == ('onednn', 'onednn') and len(walks) == 2
    walks.clear()
    with faster_products(model):
        assert len(walks) == 1                                  # one walk for both choices
        assert (gemv_kernel(model), gemm_kernel(model)) == outside  # the routed linears count too


def test_a_few_disturbed_passes_do_not_decide_the_kernel(monkeypatch):
    """oneDNN at 0.87 of BLAS's time, three of its seven passes slowed by a neighbour: each kernel's best pass keeps
    oneDNN (0.87 / 0.95 < 0.95), where the best of three passes each against 0.9 (the rule before) chose BLAS."""
    monkeypatch.setattr(decoding, '_MEASURED', {})
    blas = [1.0, 1.0, 0.95, 1.0, 1.0, 1.0, 1.0]
    onednn = [0.87, 1.3, 0.87, 0.87, 1.4, 0.87, 1.2]
    passes = iter(t for pair in zip(blas, onednn) for t in pair)             # alternated, seven each
    monkeypatch.setattr(decoding, '_timed', lambda kernel, weights, xs: next(passes))
    assert gemv_kernel(_llama()) == 'onednn'                                  # 0.87 / 0.95 = 0.92 < 0.95
    assert min(onednn[:3]) / min(blas[:3]) > 0.9                              # the old rule's answer: BLAS


@pytest.mark.parametrize('broken', ['raises', 'wrong'])
def test_a_broken_onednn_leaves_blas(broken, monkeypatch):
    monkeypatch.setattr(decoding, '_MEASURED', {})
    def bad(x, weight, bias=None):
        if broken == 'raises': raise RuntimeError('no oneDNN here')
        return torch.zeros(*x.shape[:-1], weight.shape[0])
    monkeypatch.setattr(decoding, 'onednn_linear', bad)
    assert gemv_kernel(_llama()) == 'blas'


def test_no_linear_to_route_is_blas_and_a_bad_kernel_is_named():
    assert gemv_kernel(nn.Sequential(nn.ReLU())) == 'blas'
    assert gemv_kernel(_llama().to(torch.bfloat16)) == 'blas'
    with pytest.raises(ValueError, match=r"kernel must be None or one of \('onednn', 'blas'\); got 'mkl'"):
        with faster_products(_llama(), 'mkl'): pass


@pytest.mark.parametrize('chosen', ['onednn', 'blas'])
def test_generate_takes_the_measured_kernel_for_its_eager_steps(chosen, monkeypatch):
    "The default: no flag. The tokens are the same either way (greedy, random weights)."
    model = _gpt2()
    _choose(monkeypatch, chosen, chosen)
    calls = _count(monkeypatch)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    out = generate(model, prompt, 6)
    assert (len(calls) > 0) == (chosen == 'onednn') and _routed(model) == 0
    assert set(calls) <= {2, 10}    # the steps' 2 rows, and the prefill's 2 x 5 (few too)
    _choose(monkeypatch, 'blas', 'blas')
    assert torch.equal(out, generate(model, prompt, 6))


def test_the_serving_engine_steps_by_the_measured_kernel(monkeypatch):
    "Its decode rows go to oneDNN when it is the faster; its tokens are generate's."
    from selfattn_nbdev.serving import serve
    model = _llama()
    _choose(monkeypatch, 'onednn', 'blas')
    calls = _count(monkeypatch)
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7)]
    served = serve(model, prompts, 5, num_blocks=16)
    assert calls and _routed(model) == 0
    for prompt, tokens in zip(prompts, served):
        assert list(tokens) == generate(model, prompt[None], 5)[0].tolist()


def test_row_dot_is_the_product():
    "One row, or several (a batch of one token each, a few tokens, rows read across a transpose): F.linear's."
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 1, 40), torch.randn(24, 40), torch.randn(24)
    torch.testing.assert_close(row_dot(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row_dot(x[0, 0], w), F.linear(x[0, 0], w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row_dot(x[:1], w, b), F.linear(x[:1], w, b), rtol=1e-5, atol=1e-5)
    for rows in (torch.randn(4, 1, 40), torch.randn(2, 2, 40), torch.randn(40, 3).T):   # (3, 40): strided
        got = row_dot(rows, w, b)
        assert got.shape == (*rows.shape[:-1], 24)
        torch.testing.assert_close(got, F.linear(rows, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_row_dot_computes_its_input_once_not_per_row():
    """Inductor would inline the ops that make row_dot's input (a layer norm, SiLU(gate) * up) into the loop over the
    weight's rows, recomputing them for every row: row_dot fixes its input first. In the generated C++, the loop
    that reads the weight (its index 768L*x0) holds no square root, and one before it does."""
    from torch._inductor.utils import run_and_get_code
    import torch._inductor.inductor_prims  # noqa: F401 (compiled_gemv_kernel imports it before a step)
    w, g, b, x = torch.randn(64, 768), torch.randn(768), torch.randn(768), torch.randn(1, 768)
    f = torch.compile(lambda x: row_dot(F.layer_norm(x, (768,), g, b), w), fullgraph=True, dynamic=False)
    with torch.no_grad():
        got, (code,) = run_and_get_code(f, x)
    torch.testing.assert_close(got, F.linear(F.layer_norm(x, (768,), g, b), w), rtol=1e-4, atol=1e-4)
    loops = code.split('for(int64_t x0=')[1:]                       # each kernel's outer loop, to the next
    reads_w = [l for l in loops if '768L*x0' in l]
    assert reads_w and not any('sqrt' in l for l in reads_w), reads_w
    assert 'sqrt' in code                                            # the norm, computed once, apart


@pytest.mark.slow
def test_compiled_row_dot_of_a_few_rows_reads_each_weight_row_once_along_its_length():
    """Four rows: each weight row is read once for all four while it is in the cache, and the loop runs along the
    row (d_in), 16 floats at a time. Without row_dot's row-major layout, the second product's input (GELU of the
    first's (d_out, rows) result) arrived transposed, and Inductor vectorized that loop along the 4 rows instead,
    masking 12 of 16 lanes (`sum_masked_reduce`) and reading the weight one float at a time: the compiled step of
    a batch of 4 then took 1.3 times as long as with oneDNN."""
    from torch._inductor.utils import run_and_get_code
    import torch._inductor.inductor_prims  # noqa: F401
    torch.manual_seed(0)
    w1, w2, x = torch.randn(256, 64), torch.randn(64, 256), torch.randn(4, 1, 64)
    f = torch.compile(lambda x: row_dot(F.gelu(row_dot(F.layer_norm(x, (64,)), w1)), w2), fullgraph=True,
                      dynamic=False)
    with torch.no_grad():
        got, (code,) = run_and_get_code(f, x)
    torch.testing.assert_close(got, F.linear(F.gelu(F.linear(F.layer_norm(x, (64,)), w1)), w2), rtol=1e-4,
                               atol=1e-4)
    assert got.shape == (4, 1, 64) and 'sum_masked_reduce' not in code, code
    for d_in in (64, 256):                                           # both products: d_in the vectorized loop
        assert f'x2<static_cast<int64_t>({d_in}L); x2+=static_cast<int64_t>(16L)' in code, code


@pytest.mark.parametrize('compiled,measured', [(True, 'loop'), (True, 'blas'), (False, 'loop')])
def test_a_compiled_step_takes_row_dot_for_one_row_only_where_measured_faster(compiled, measured, monkeypatch):
    """Traced by Dynamo (is_compiling): told it is compiled and row_dot measured faster, one row is row_dot; row_dot
    slower (the graph calls the BLAS), or not told, F.linear; more rows, the kernel measured for them (here oneDNN,
    through its operator)."""
    model, dots = _llama(), []
    real = decoding.row_dot
    monkeypatch.setattr(decoding, 'row_dot', lambda *a: dots.append(a[0].shape) or real(*a))
    monkeypatch.setattr(decoding, 'compiled_gemv_kernel', lambda model, linears=None, rows=1: measured)
    calls = _count(monkeypatch)
    with torch.no_grad(), faster_products(model, 'onednn', compiled=compiled):
        eager = model(torch.randint(0, 64, (1, 1), generator=torch.Generator().manual_seed(0)))
        monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
        try:
            traced = model(torch.randint(0, 64, (1, 1), generator=torch.Generator().manual_seed(0)))
            model(torch.randint(0, 64, (2, 1)))                   # two rows: oneDNN's operator
        finally:  # Dynamo's map of torch's functions, if made meanwhile, holds the stand-in: made again later
            monkeypatch.undo(); torch._dynamo.trace_rules.clear_lru_cache()
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert len(dots) == (linears if compiled and measured == 'loop' else 0)
    one_row = 0 if compiled and measured == 'loop' else linears   # traced one row: oneDNN unless row_dot
    assert calls == [1] * (linears + one_row) + [2] * linears     # the eager row, the traced, two rows
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="compiled must be True or False; got 'yes'"):
        with faster_products(model, compiled='yes'): pass


@pytest.mark.slow
def test_a_compiled_step_of_several_rows_multiplies_by_the_kernel_measured_for_them(monkeypatch):
    """Inductor lowers oneDNN's linear for frozen weights only, and F.linear in a graph is the BLAS: where oneDNN was
    measured faster, a compiled step of two rows calls it (the package's operator) for every product, and its logits
    are the eager step's."""
    model, ids = _llama(), torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    calls = _count(monkeypatch)
    monkeypatch.setattr(decoding, 'compiled_gemv_kernel', lambda model, linears=None, rows=1: 'onednn')
    with torch.no_grad(), decoding.stacked(model), faster_products(model, 'onednn', compiled=True, rows=(2, 16)):
        compiled_caches, eager_caches = model.new_caches(64), model.new_caches(64)
        model(ids, compiled_caches); nxt = model(ids, eager_caches)[:, -1:].argmax(-1)       # (2, 1)
        step = decoding._decode_step(model, True)
        for _ in range(2):
            calls.clear()
            got, want = step(nxt, compiled_caches), model(nxt, eager_caches)              # (2, 1, vocab)
            products = len(calls) // 2                                     # the compiled step's, then eager's
            assert calls == [2] * 2 * products and products == 2 * 4 + 1   # q k v, out, gate up, down; head
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            nxt = want[:, -1:].argmax(-1)


@pytest.mark.slow
def test_a_compiled_step_of_a_few_rows_takes_row_dot_where_measured_faster(monkeypatch):
    """A batch of 3, told on entry, where the loop was measured faster for its bucket (4): every product of the
    compiled step is row_dot of 3 rows, none calls oneDNN, and its logits are the eager step's. Only the step's
    rows (the first told) are asked about, and never more than LOOP_ROWS."""
    model, ids = _llama(), torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    calls, asked, dots = _count(monkeypatch), [], []
    monkeypatch.setattr(decoding, 'compiled_gemv_kernel',
                        lambda model, linears=None, rows=1: asked.append(rows) or 'loop')
    real = decoding.row_dot
    monkeypatch.setattr(decoding, 'row_dot', lambda *a: dots.append(a[0].numel() // a[0].shape[-1]) or real(*a))
    with faster_products(model, 'onednn', compiled=True, rows=(LOOP_ROWS + 1, 2)): pass
    assert asked == []                                               # a step of 5 rows; 2: eager's rows
    with torch.no_grad(), decoding.stacked(model), faster_products(model, 'onednn', compiled=True,
                                                                   rows=(3, 24)):
        assert asked == [3]                                          # the step's; 24: the prompt's, eager
        compiled_caches, eager_caches = model.new_caches(64), model.new_caches(64)
        model(ids, compiled_caches); nxt = model(ids, eager_caches)[:, -1:].argmax(-1)       # (3, 1)
        step = decoding._decode_step(model, True)
        for _ in range(3):
            calls.clear(); dots.clear()
            got = step(nxt, compiled_caches)                           # (3, 1, vocab)
            want = model(nxt, eager_caches)                            # eager: oneDNN
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # Dynamo replays the appends to `dots` after each run of its graph: q k v, out, gate up, down in
            # 2 layers, and the head, each row_dot of 3 rows; only the eager step called oneDNN
            assert dots == [3] * (2 * 4 + 1) and calls == [3] * (2 * 4 + 1)
            nxt = want[:, -1:].argmax(-1)


@pytest.mark.parametrize('one_row', KERNELS)
def test_compiled_gemv_kernel_measures_once_and_keeps_the_loop_unless_the_library_wins_clearly(one_row, monkeypatch,
                                                                                            caplog):
    """The compiled loop against the kernel `gemv_kernel` chose for one row (what the graph calls without the loop),
    seven passes each on the largest group of one shape; kept per thread count. The library's kernel is taken only
    on a clear win (under 0.95 of the loop's time): in a step the loop also fuses with its neighbours. Each
    measurement (a compile's pause) is said at INFO with its choice and seconds; a kept answer says nothing."""
    import logging
    caplog.set_level(logging.INFO, logger='selfattn_nbdev.decoding')
    said = lambda: [r.getMessage() for r in caplog.records if r.name == 'selfattn_nbdev.decoding']
    model = _llama()
    monkeypatch.setattr(decoding, '_LOOPED', {})
    monkeypatch.setattr(decoding, 'rows_kernel', lambda model, rows, linears=None: one_row)
    monkeypatch.setattr(torch, 'compile', lambda fn, **options: fn)   # eager row_dot: the rule, not Inductor
    base = {'blas': F.linear, 'onednn': onednn_linear}[one_row]
    timed, bases = [], []
    def fake(kernel, weights, xs):  # the loop takes `ratio` of the other kernel's time
        timed.append(len(weights))
        if kernel in (F.linear, onednn_linear): bases.append(kernel); return 1.0
        return ratio
    monkeypatch.setattr(decoding, '_timed', fake)
    ratio = 0.8
    assert compiled_gemv_kernel(model) == 'loop' and len(timed) == 14
    assert compiled_gemv_kernel(model) == 'loop' and len(timed) == 14  # kept: not measured again
    assert bases == [base] * 7                                       # against the one-row kernel only
    assert len(said()) == 1 and said()[0].startswith(
        f'compiled_gemv_kernel: loop for 1 row(s) at {torch.get_num_threads()} thread(s), measured in '), said()
    # the largest group of one shape: the MLP's gate and up weights (128, 32), two a layer: four, repeated until
    # they hold the bytes a step reads (here the whole small model's: 2 copies), timed one by one by the other
    # kernel, and all at once by the loop
    step_bytes = sum(w.nbytes for w in decoding._step_weights(decoding._linears(model), 64 * 2 ** 20)[0])
    copies = -(-step_bytes // (4 * 128 * 32 * 4))
    assert sorted(set(timed)) == [1, 4 * copies] and [*decoding._LOOPED][0][1:] == (1, 4 * copies, 128, 32, one_row)
    decoding._LOOPED.clear(); ratio = 1.03                          # the loop 3 % slower: within 5 %, kept
    assert compiled_gemv_kernel(model) == 'loop'
    decoding._LOOPED.clear(); ratio = 1.1                           # 10 % slower: the library wins clearly
    assert compiled_gemv_kernel(model) == one_row
    assert len(said()) == 3 and said()[2].startswith(f'compiled_gemv_kernel: {one_row} for 1 row(s)'), said()


def test_compiled_gemv_kernel_measures_a_few_rows_by_their_bucket(monkeypatch):
    """A batch of 2 to LOOP_ROWS: its bucket's rows, against the kernel rows_kernel chose for that bucket; 3 rows
    take 4's answer, measured once. More than LOOP_ROWS is refused by name: there the libraries' blocked kernels
    won in a step (bench/row_loop.py)."""
    model, shapes, kernels = _llama(), [], []
    monkeypatch.setattr(decoding, '_LOOPED', {})
    monkeypatch.setattr(decoding, 'rows_kernel', lambda model, rows, linears=None: kernels.append(rows) or 'onednn')
    monkeypatch.setattr(torch, 'compile', lambda fn, **options: fn)
    def fake(kernel, weights, xs):
        shapes.extend(tuple(x.shape) for x in xs.values())
        return 1.0 if kernel is onednn_linear else 0.9
    monkeypatch.setattr(decoding, '_timed', fake)
    assert compiled_gemv_kernel(model, rows=4) == 'loop' and kernels == [4] and set(shapes) == {(4, 32)}
    shapes.clear()
    assert compiled_gemv_kernel(model, rows=3) == 'loop' and shapes == []      # bucket 4: kept
    assert compiled_gemv_kernel(model, rows=2) == 'loop' and set(shapes) == {(2, 32)}
    assert sorted(key[1] for key in decoding._LOOPED) == [2, 4]
    for bad in (LOOP_ROWS + 1, 0, 2.0):
        with pytest.raises(ValueError, match=r"rows must be"):
            compiled_gemv_kernel(model, rows=bad)


def test_a_row_dot_that_does_not_compile_leaves_the_blas_and_says_so(monkeypatch):
    model = _llama()
    monkeypatch.setattr(decoding, '_LOOPED', {})
    monkeypatch.setattr(decoding, 'rows_kernel', lambda model, rows, linears=None: 'blas')
    def no_compiler(fn, **options): raise RuntimeError('no C++ compiler found')
    monkeypatch.setattr(torch, 'compile', no_compiler)
    with pytest.warns(UserWarning, match=r"row_dot did not compile \(RuntimeError: no C\+\+ compiler found\)"):
        assert compiled_gemv_kernel(model) == 'blas'
    assert decoding._LOOPED == {}                                   # not kept: asked again next time


def test_compiled_gemv_kernel_really_compiles_row_dot_here():
    "Inductor's loop, compiled for a small model's weights on this machine: a kernel named, kept for the next call."
    model = _llama()
    answer = compiled_gemv_kernel(model)
    assert answer in ('loop', *KERNELS) and compiled_gemv_kernel(model) == answer
    assert any(key[0] == torch.get_num_threads() for key in decoding._LOOPED)


def _family(kind):
    "A small random model of transformers' `kind`, saved and read back by from_hf."
    import tempfile
    from transformers import AutoConfig, AutoModelForCausalLM
    from test_configs import FAMILIES
    from test_hybrid import qwen35_text_config
    from selfattn_nbdev.pretrained import from_hf
    torch.manual_seed(0)
    config = (qwen35_text_config() if kind == 'qwen3_5_text' else
              AutoConfig.for_model('smollm3', **FAMILIES['llama'], pad_token_id=0, eos_token_id=None)
              if kind == 'smollm3' else AutoConfig.for_model(kind, **FAMILIES[kind]))
    with tempfile.TemporaryDirectory() as folder:  # from_hf reads it whole
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        return from_hf(folder).eval()


@pytest.mark.parametrize('kind', ['gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3_text',
                                  'deepseek_v3', 'qwen3_5_text', 'smollm3'])
def test_every_native_family_decodes_by_onednn_to_the_same_tokens(kind, monkeypatch):
    "Every family from_hf builds natively routes its linears, and writes BLAS's greedy tokens."
    model, prompt = _family(kind), torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    calls = _count(monkeypatch)
    _choose(monkeypatch, 'onednn', 'onednn')
    by_onednn = generate(model, prompt, 8)
    assert len(calls) >= 8 and _routed(model) == 0
    _choose(monkeypatch, 'blas', 'blas')
    assert torch.equal(by_onednn, generate(model, prompt, 8))


@pytest.mark.parametrize('compile,loops', [(dict(backend='eager'), False), (dict(backend='aot_eager'), False),
                                           (dict(fullgraph=True, dynamic=False), True)])
def test_generate_asks_for_row_dot_only_when_inductor_compiles_the_step(compile, loops, monkeypatch):
    "Another backend runs row_dot as written, a (d_out, d_in) product a linear: the step keeps the BLAS there."
    model, told = _llama(), []
    monkeypatch.setattr(decoding, 'compiled_gemv_kernel',
                        lambda model, linears=None, rows=1: told.append(model) or 'blas')
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))
    if loops: monkeypatch.setattr(decoding, '_decode_step', lambda model, compile: model)  # no real compile here
    assert torch.equal(generate(model, prompt, 3, compile=compile), generate(model, prompt, 3))
    assert len(told) == loops


def test_row_bucket_is_the_power_of_two_at_or_above_at_most_the_prompt_probe():
    assert [row_bucket(r) for r in (0, 1, 2, 3, 4, 5, 16, 17, 33, 64, 65, 4096)] == \
        [1, 1, 2, 4, 4, 8, 16, 32, 64, 64, 64, 64]
    assert row_bucket(10 ** 6) == GEMM_PROBE_ROWS


def test_each_product_takes_the_kernel_measured_for_its_own_rows(monkeypatch):
    """A kernel per bucket of rows: oneDNN measured faster for 4 rows only. The rows told on entry are measured there;
    a number of rows first met inside is measured at its first product, once for the block."""
    model, calls, asked = _llama(), _count(monkeypatch), []
    def measured(m, rows, linears=None):
        asked.append(rows)
        return 'onednn' if row_bucket(rows) == 4 else 'blas'
    monkeypatch.setattr(decoding, 'rows_kernel', measured)
    with torch.no_grad(), faster_products(model, rows=(1, 4)):
        assert asked == [1, 4]                                                  # on entry
        for batch in (1, 3, 4, 8, 3):
            model(torch.randint(0, 64, (batch, 1)))
        assert asked == [1, 4, 3, 8]                                            # 3 and 8: when first met
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert calls == [3] * linears + [4] * linears + [3] * linears                # bucket 4: oneDNN
    calls.clear()
    with torch.no_grad(), faster_products(model, rows=8):                      # all BLAS: left unrouted
        assert _routed(model) == 0
        model(torch.randint(0, 64, (4, 1)))
    assert calls == []


def test_rows_is_checked_by_name():
    for bad, named in ((0, 'rows'), (-1, 'rows'), (2.0, 'rows'), (True, 'rows'), ([], 'rows'),
                       ([1, 'a'], r'rows\[1\]'), ((4, 0), r'rows\[1\]'), (None, 'rows')):
        with pytest.raises(ValueError, match=named + r" must be a positive integer.*; got"):
            with faster_products(_llama(), rows=bad): pass
    with faster_products(_llama(), rows=[1, 4]), faster_products(_llama(), rows=3): pass   # a list, an int


def test_the_probe_multiplies_by_the_matrices_the_step_multiplies_by(monkeypatch, caplog):
    """Inside `stacked`, q, k, v are one (d_q + 2 d_kv, d_in) product and gate and up one (2 d_hidden, d_in): the
    probe times those shapes, not the linears one by one; each measurement is said at INFO, once."""
    import logging
    caplog.set_level(logging.INFO, logger='selfattn_nbdev.decoding')
    model, seen = _llama(), []
    monkeypatch.setattr(decoding, '_MEASURED', {})
    monkeypatch.setattr(decoding, '_timed', lambda kernel, weights, xs: seen.append(
        sorted({tuple(w.shape) for w in weights})) or (0.5 if kernel is decoding.onednn_linear else 1.0))
    assert rows_kernel(model, 3) == 'onednn'                    # alone: the linears' own shapes
    alone = seen[-1]
    with stacked(model):
        assert rows_kernel(model, 3) == 'onednn'
    together = seen[-1]
    # d_model 32, 4 heads of 8 sharing 2 key/value heads, d_hidden 128, a vocabulary of 64 (the head's (64, 32))
    assert alone == [(16, 32), (32, 32), (32, 128), (64, 32), (128, 32)], alone
    assert together == [(32, 32), (32, 128), (32 + 2 * 16, 32), (2 * 128, 32)], together
    assert rows_kernel(model, 5) == 'onednn' and seen[-1] == alone    # after the block: one by one again
    said = [r.getMessage() for r in caplog.records if r.name == 'selfattn_nbdev.decoding']
    assert len(said) == 3 and all(m.startswith('rows_kernel: onednn for ') for m in said), said


def test_generate_tells_the_block_its_step_rows_and_its_prompt_rows(monkeypatch):
    "A batch of 3 prompts of 5 tokens: the step's 3 rows and the prompt's 15, measured before the first product."
    model, asked = _gpt2(), []
    monkeypatch.setattr(decoding, 'rows_kernel', lambda m, rows, linears=None: asked.append(rows) or 'blas')
    generate(model, torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(0)), 4)
    assert asked[:2] == [3, 15] and set(asked) == {3, 15}
