"""Issue 32, point 1: queries, keys and values (and a gate and up) in one product while generating.

`stacked(model)` lays each group of linears end to end in one storage and `project` then multiplies once. These tests
check that the logits do not change, that the products really are fewer, that nothing a user holds changes (parameter
objects, names, memory, gradients, an optimizer), and that a model moved or reloaded meanwhile is never read through a
stale view."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from selfattn_nbdev.decoding import generate, project, stack_weights, stacked
from selfattn_nbdev.generation import TinyGPT
from selfattn_nbdev.pretrained import GPT2, Gemma, Llama


class CountLinear(TorchFunctionMode):
    "Counts F.linear calls and the rows of their weights."
    def __init__(self):
        super().__init__(); self.calls, self.rows = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.calls += 1; self.rows.append(args[1].shape[0])
        return func(*args, **(kwargs or {}))


def _models():
    torch.manual_seed(0)
    return {
        'TinyGPT': (TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2), 0),
        'TinyGPT gqa rope': (TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2,
                                     rope=True), 0),
        'GPT2': (GPT2(vocab_size=37, context_length=64, d_model=32, num_heads=4, num_layers=2), 0),
        'Llama qwen2': (Llama(37, 64, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=48,
                              qkv_bias=True), 1),
        'Gemma': (Gemma(37, 64, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2, d_hidden=48, head_dim=8,
                        window=8, qk_norm=True), 1),
    }


MODELS = list(_models())


def _randomised(model):
    "Random biases too, so that a.bias in the wrong place would show."
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('bias'): p.normal_(0, 0.5)
    return model.double().eval()


@pytest.mark.parametrize('name', MODELS)
def test_same_logits_and_fewer_products(name):
    model, mlp_pairs = _models()[name]
    model = _randomised(model)
    ids = torch.randint(0, 37, (2, 11))
    with torch.no_grad(), CountLinear() as apart: separate = model(ids)
    with stacked(model), torch.no_grad(), CountLinear() as together: joined = model(ids)
    assert (joined - separate).abs().max() < 1e-12
    blocks = len(model.blocks)
    # q, k, v become one product in every block, and a gate and up another where the MLP has them
    assert apart.calls - together.calls == blocks * (2 + mlp_pairs)
    attn = model.blocks[0].attn
    assert attn.W_query.out_features + 2 * attn.W_key.out_features in together.rows


@pytest.mark.parametrize('name', MODELS)
def test_the_parameters_stay_what_they_were(name):
    "The same Parameter objects, names and values; one storage per group, of the same total size."
    model, _ = _models()[name]
    model = _randomised(model)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    names, numel = list(model.state_dict()), sum(p.numel() for p in model.parameters())
    with stacked(model): pass
    after = dict(model.named_parameters())
    assert list(model.state_dict()) == names
    for n, (p, value) in before.items():
        assert after[n] is p and torch.equal(p, value)
    assert sum(p.numel() for p in model.parameters()) == numel
    attn = model.blocks[0].attn
    storages = {attn.W_query.weight.untyped_storage().data_ptr(), attn.W_key.weight.untyped_storage().data_ptr(),
                attn.W_value.weight.untyped_storage().data_ptr()}
    assert len(storages) == 1
    assert attn.W_query.weight.untyped_storage().nbytes() == sum(
        w.weight.numel() * 8 for w in (attn.W_query, attn.W_key, attn.W_value))
    assert attn.W_query.__dict__.get('_stacked', 0) == 0  # no holder once the block ends


def test_gradients_take_the_separate_products_and_training_reaches_the_stack():
    "With gradients recorded, three products (and the same gradients); an optimizer's step is seen by the stack."
    model = _randomised(TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2))
    ids = torch.randint(0, 37, (2, 9))
    reference = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2).double()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with stacked(model):
        with CountLinear() as counted: loss = model(ids).logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
    assert counted.calls == len(model.blocks) * 6 + 1   # q, k, v, out, two MLP layers; the head
    reference_loss = reference(ids).logsumexp(-1).mean(); reference_loss.backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-12), n
    with torch.no_grad():
        for q in reference.parameters(): q -= 0.5 * q.grad
        with stacked(model): stepped = model(ids)
    assert (stepped - reference(ids).detach()).abs().max() < 1e-12


def test_a_model_moved_or_reloaded_is_never_read_through_a_stale_view():
    model = _randomised(TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2))
    ids = torch.randint(0, 37, (1, 8))
    with stacked(model), torch.no_grad():
        model.float()                        # every parameter a new tensor: the stack is gone
        with CountLinear() as counted: moved = model(ids)
        assert counted.calls == len(model.blocks) * 6 + 1      # three products again
        new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(new, assign=True)
        reloaded = model(ids)
    fresh = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2).float().eval()
    fresh.load_state_dict(new)
    assert torch.equal(reloaded, fresh(ids).detach())
    assert moved.dtype == torch.float32
    with stacked(model), torch.no_grad(), CountLinear() as counted: model(ids)
    assert counted.calls == len(model.blocks) * 4 + 1           # stacked again


def stacks(model):
    return [m.__dict__.get('_stacked', 0) for m in model.modules() if isinstance(m, nn.Linear)]


def test_nested_blocks_and_a_stream_left_unfinished_restore_what_was():
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=1).eval()
    with stacked(model):
        assert sum(stacks(model)) == 1
        with stacked(model): assert sum(stacks(model)) == 2
        assert sum(stacks(model)) == 1      # the inner block leaves the outer's hold
    assert not any(stacks(model))
    from selfattn_nbdev.decoding import generate_stream
    stream = generate_stream(model, torch.randint(0, 37, (1, 4)), 5)
    next(stream); assert sum(stacks(model)) == 1
    stream.close(); assert not any(stacks(model))


CHANGES = ['reloaded (assign=True)', 'cast', 'a weight assigned', '.data assigned', 'parametrized', 'hooked',
           'deep-copied', 'functional_call']


@pytest.mark.parametrize('change', CHANGES)
def test_a_model_changed_inside_the_block_is_computed_as_it_now_is(change):
    "Eager and compiled (by the caller, inside the block): always the model as it now is, never a stale stack."
    import copy
    from torch.nn.utils import parametrize
    torch.manual_seed(0)
    model = _randomised(TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=1))
    ids = torch.randint(0, 37, (1, 8))
    key = model.blocks[0].attn.W_key
    with stacked(model), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
        assert (compiled(ids) - model(ids)).abs().max() < 1e-12
        call = None
        if change == 'cast': model.float()
        elif change == 'a weight assigned': key.weight = nn.Parameter(torch.randn(32, 32, dtype=torch.float64))
        elif change == '.data assigned': key.weight.data = torch.randn(32, 32, dtype=torch.float64)
        elif change == 'parametrized':
            class Twice(nn.Module):
                def forward(self, W): return 2 * W
            parametrize.register_parametrization(key, 'weight', Twice())
        elif change == 'hooked': key.register_forward_hook(lambda m, a, out: out * 3)
        elif change == 'deep-copied':
            model = copy.deepcopy(model)
            model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
            compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
        elif change == 'functional_call':
            other = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
            call = lambda m, x: torch.func.functional_call(m, other, (x,))
        else: model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()}, assign=True)
        with stacked(model):
            with CountLinear() as counted: truth = (model(ids) if call is None else call(model, ids)).detach()
            if change in ('parametrized', 'hooked'):   # F.linear would skip them: three calls of the layers
                assert counted.calls == len(model.blocks) * 6 + 1
            if change == 'hooked': return   # torch.compile does not see a hook added after it traced
            got = compiled(ids) if call is None else call(compiled, ids)
            assert (got - truth).abs().max() < 1e-5


@pytest.mark.heavy
def test_the_compiled_decode_step_reads_the_stack_and_only_it():
    "generate's compiled step multiplies once per group (its host checks the stack before each call)."
    from selfattn_nbdev.decoding import _decode_step
    graphs = []
    def counting(gm, example_inputs):
        graphs.append(sum(n.op == 'call_function' and n.target in (F.linear, torch._C._nn.linear)
                          for n in gm.graph.nodes))
        return gm.forward
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2).eval()
    prompt = torch.randint(0, 37, (1, 5))
    step = _decode_step(model, dict(backend=counting, fullgraph=True))
    for stack in (True, False):
        caches = model.new_caches(16)
        with (stacked(model) if stack else contextlib.nullcontext()), torch.no_grad():
            ids = model(prompt, caches)[:, -1].argmax(-1, keepdim=True)
            step(ids, caches)
    assert graphs == [len(model.blocks) * 4 + 1, len(model.blocks) * 6 + 1]
    assert not model.blocks[0].attn.W_query.__dict__.get('_stack_checked', False)  # reset after the call


@pytest.mark.heavy
def test_the_compiled_decode_step_checks_the_stack_before_every_step():
    "A weight moved out of the stack between two steps is caught by the host's check: the model as it now is."
    from selfattn_nbdev.decoding import _decode_step
    torch.manual_seed(0)
    model = _randomised(TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2))
    prompt = torch.randint(0, 37, (1, 5))
    step = _decode_step(model, dict(backend='aot_eager', fullgraph=True))
    caches, reference = model.new_caches(16), model.new_caches(16)
    with stacked(model), torch.no_grad():
        ids = model(prompt, caches)[:, -1].argmax(-1, keepdim=True)
        model(prompt, reference)
        assert (step(ids, caches) - model(ids, reference)).abs().max() < 1e-12
        model.blocks[1].attn.W_key.weight.data = torch.randn(32, 32, dtype=torch.float64)  # out of the stack
        assert (step(ids, caches) - model(ids, reference)).abs().max() < 1e-12



@pytest.mark.heavy
def test_the_decode_step_makes_room_for_its_graphs_when_other_models_filled_it(monkeypatch):
    """Dynamo counts the graphs of every model that shares a forward against one limit. A step that needs a new graph
    (a new bound, or a weight moved out of its stack) still compiles when other models' graphs fill the limit: it
    retries with more room (doubling from _GRAPH_ROOM), where it used to fail with fullgraph=True."""
    from selfattn_nbdev import decoding
    monkeypatch.setattr(decoding, '_GRAPH_ROOM', 1)             # so the doubling runs, not only the first room
    options = dict(backend='aot_eager', fullgraph=True, dynamic=False)
    torch.manual_seed(0)
    with torch._dynamo.config.patch(recompile_limit=1):
        for d_model in (16, 24):                                # other models of the class, other graphs
            generate(TinyGPT(37, 64, d_model=d_model, num_heads=4, num_layers=1).eval(),
                     torch.randint(0, 37, (1, 4)), 3, compile=options)
        model = _randomised(TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2))
        prompt = torch.randint(0, 37, (1, 5))
        step = decoding._decode_step(model, options)
        caches, reference = model.new_caches(16), model.new_caches(16)
        with stacked(model), torch.no_grad():
            ids = model(prompt, caches)[:, -1].argmax(-1, keepdim=True)
            model(prompt, reference)
            assert (step(ids, caches) - model(ids, reference)).abs().max() < 1e-12
            model.blocks[1].attn.W_key.weight.data = torch.randn(32, 32, dtype=torch.float64)  # a new graph
            assert (step(ids, caches) - model(ids, reference)).abs().max() < 1e-12

def test_the_room_doubles_up_to_dynamos_cap_on_all_graphs_and_no_further():
    """Past the accumulated limit (all the graphs of a function) no room for one function's graphs helps: the
    doubling stops there and the error comes through, whatever Dynamo's message says."""
    from selfattn_nbdev import decoding
    config, name = torch._dynamo.config, decoding._limit_name()
    full = decoding._room_full()[0]
    rooms = []
    def never(x):                                            # the limit is hit at any room
        rooms.append(getattr(config, name)); raise full('a message that names no limit')
    def at_100(x):                                           # room for 100 graphs is enough
        rooms.append(getattr(config, name))
        if rooms[-1] < 100: raise full('the recompile limit')
        return x + 1
    with config.patch(**{name: 8}), config.patch(accumulated_recompile_limit=200):
        with pytest.raises(full, match='names no limit'): decoding._with_room(never, 0)
        assert rooms == [32, 64, 128, 200]
        rooms.clear()
        assert decoding._with_room(at_100, 1) == 2 and rooms == [32, 64, 128]
        assert getattr(config, name) == 8                    # the user's limit, as it was


class _Rescaled(TinyGPT):
    "Reads a Python int its caller changes before every step: a new graph every call."
    def forward(self, *args, **kwargs): return super().forward(*args, **kwargs) * self.scale


@pytest.mark.heavy
def test_a_step_that_needs_a_new_graph_every_call_fails_after_a_few_calls(monkeypatch):
    """Retries for a bound already compiled are capped (_RETRIES), so a step that recompiles every call is a loud
    error after the limit and a few retries, not a slow run until Dynamo's cap on all graphs."""
    from selfattn_nbdev import decoding
    monkeypatch.setattr(decoding, '_GRAPH_ROOM', 2)
    monkeypatch.setattr(decoding, '_RETRIES', 2)
    torch.manual_seed(0)
    model = _Rescaled(37, 64, d_model=16, num_heads=4, num_layers=1).eval()
    step = decoding._decode_step(model, dict(backend='eager', fullgraph=True, dynamic=False))
    caches = model.new_caches(64)
    calls = 0
    with torch._dynamo.config.patch(**{decoding._limit_name(): 2, 'accumulated_recompile_limit': 16}):
        with torch.no_grad(), pytest.raises(decoding._room_full()):
            model.scale = 1; model(torch.randint(0, 37, (1, 4)), caches)
            for calls in range(1, 17):
                model.scale = calls; step(torch.randint(0, 37, (1, 1)), caches)
    assert calls == 2 + 2 + 1                                # the limit, the retries, and the one that raised

def test_generate_under_inference_mode_leaves_a_model_that_trains():
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=1)
    with torch.inference_mode(): generate(model, torch.randint(0, 37, (1, 4)), 3)
    assert not model.blocks[0].attn.W_query.weight.is_inference()
    model.train(); model(torch.randint(0, 37, (2, 6))).sum().backward()   # no "inference tensors" error


def test_a_generated_model_is_freed_when_deleted():
    import gc, weakref
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=1)
    generate(model, torch.randint(0, 37, (1, 4)), 3)
    gone = weakref.ref(model.blocks[0].attn.W_query)
    del model; gc.collect()
    assert gone() is None


def test_tied_and_shared_weights_are_left_as_they_were():
    "q and k tied in one group, or one Parameter in two blocks' groups: no stack, the same tokens."
    torch.manual_seed(0)
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=2).eval()
    attn0, attn1 = model.blocks[0].attn, model.blocks[1].attn
    attn0.W_key.weight = attn0.W_query.weight                    # shared-QK attention
    attn1.W_value.weight = attn0.W_value.weight                  # one value matrix for two blocks
    before = [p.data_ptr() for p in model.parameters()]
    prompt = torch.randint(0, 37, (1, 4))
    with torch.no_grad():
        ids = prompt
        for _ in range(5): ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(generate(model, prompt, 5), ids)
    assert [p.data_ptr() for p in model.parameters()] == before


def test_what_cannot_be_stacked_is_left_as_it_was():
    a, b = nn.Linear(4, 3), nn.Linear(5, 3)
    assert not stack_weights(a, b)                                   # different inputs
    c = nn.Linear(4, 3).double()
    assert not stack_weights(a, c)                                   # different dtypes
    d = nn.Linear(4, 3, bias=False)
    assert not stack_weights(a, d)                                   # one biased, one not
    f = nn.Linear(4, 3); f.bias = nn.Parameter(f.bias.detach().double())
    assert not stack_weights(a, f) and f.bias.dtype == torch.float64  # biases of two dtypes
    with torch.device('meta'): m1, m2 = nn.Linear(4, 3), nn.Linear(4, 3)
    assert not stack_weights(m1, m2)                                 # nothing to copy
    x = torch.randn(2, 4)
    e = nn.Linear(4, 2)
    assert stack_weights(a, e)
    pointers = (a.weight.data_ptr(), e.weight.data_ptr())
    assert stack_weights(a, e) and (a.weight.data_ptr(), e.weight.data_ptr()) == pointers  # no second copy
    pair = nn.Module(); pair.a, pair.e = a, e; pair.stacked_linears = (('a', 'e'),)
    with stacked(pair), torch.no_grad(), CountLinear() as counted:
        ya, ye = project(x, a, e)
    assert counted.calls == 1 and torch.allclose(ya, a(x)) and torch.allclose(ye, e(x))


@pytest.mark.heavy
@pytest.mark.parametrize('name', ['GPT2', 'Llama qwen2'])
def test_compiled_generation_writes_the_eager_tokens(name):
    "generate stacks the weights; compiled (one graph reading the stack through a view) equals eager unstacked."
    model, _ = _models()[name]
    model = model.eval()
    prompt = torch.randint(0, 37, (1, 5))
    with torch.no_grad():  # by hand, without stacked: the reference tokens
        ids = prompt
        for _ in range(8):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(generate(model, prompt, 8), ids)
    assert torch.equal(generate(model, prompt, 8, compile=True), ids)


def test_a_weight_of_a_tensor_subclass_is_never_read_through_the_stack():
    "A subclass (as a DTensor or a quantized weight is) at the stacked address: the linears are called, not one view."
    class Marked(torch.Tensor):
        pass
    torch.manual_seed(0)
    a, e = nn.Linear(4, 3), nn.Linear(4, 2)
    pair = nn.Module(); pair.a, pair.e = a, e; pair.stacked_linears = (('a', 'e'),)
    x = torch.randn(2, 4)
    with stacked(pair), torch.no_grad():
        with CountLinear() as counted: project(x, a, e)
        assert counted.calls == 1                                         # stacked: one product
        e.weight = nn.Parameter(torch.Tensor._make_subclass(Marked, e.weight.detach()))
        assert type(e.weight) is Marked and e.weight.data_ptr() == a.weight.data_ptr() + 12 * 4
        with CountLinear() as counted: ya, ye = project(x, a, e)
        assert counted.calls == 2 and torch.allclose(ye, F.linear(x, e.weight, e.bias))
