"""Issue 32, point 1: queries, keys and values (and a gate and up) in one product while generating.

`stacked(model)` lays each group of linears end to end in one storage and `project` then multiplies once. These tests
check that the logits do not change, that the products really are fewer, that nothing a user holds changes (parameter
objects, names, memory, gradients, an optimizer), and that a model moved or reloaded meanwhile is never read through a
stale view."""
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
    assert '_stack_weight' not in attn.W_query._buffers  # the stack's view goes when the block ends


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
    return ['_stack_weight' in m._buffers for m in model.modules() if isinstance(m, nn.Linear)]


def test_nested_blocks_and_a_stream_left_unfinished_restore_what_was():
    model = TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=1).eval()
    first = model.blocks[0].attn.W_query
    with stacked(model):
        assert sum(stacks(model)) == 1 and '_stack_weight' not in model.state_dict(keep_vars=True)
        with stacked(model): assert sum(stacks(model)) == 1
        assert sum(stacks(model)) == 1      # the inner block leaves the outer's stack
    assert not any(stacks(model))
    from selfattn_nbdev.decoding import generate_stream
    stream = generate_stream(model, torch.randint(0, 37, (1, 4)), 5)
    next(stream); assert '_stack_weight' in first._buffers
    stream.close(); assert not any(stacks(model))


@pytest.mark.parametrize('change', ['reloaded (assign=True)', 'cast', 'a weight assigned'])
def test_a_compiled_forward_never_reads_a_stale_stack(change):
    "Inside the block, the model changes under a compiled forward: it must still compute the model as it now is."
    torch.manual_seed(0)
    model = _randomised(TinyGPT(37, 64, d_model=32, num_heads=4, num_layers=1))
    ids = torch.randint(0, 37, (1, 8))
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    with stacked(model), torch.no_grad():
        test = compiled(ids); assert (test - model(ids)).abs().max() < 1e-12
        if change == 'cast': model.float()
        elif change == 'a weight assigned':
            model.blocks[0].attn.W_key.weight = nn.Parameter(torch.randn(32, 32, dtype=torch.float64))
        else: model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()}, assign=True)
        assert (compiled(ids) - model(ids)).abs().max() < 1e-5
    separate = model(ids).detach()
    with stacked(model), torch.no_grad():   # and a new block stacks the model as it is now
        assert (compiled(ids) - separate).abs().max() < 1e-5


def test_what_cannot_be_stacked_is_left_as_it_was():
    a, b = nn.Linear(4, 3), nn.Linear(5, 3)
    assert not stack_weights(a, b)                                   # different inputs
    c = nn.Linear(4, 3).double()
    assert not stack_weights(a, c)                                   # different dtypes
    d = nn.Linear(4, 3, bias=False)
    assert not stack_weights(a, d)                                   # one biased, one not
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
