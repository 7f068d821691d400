"""bench/any_capacity.py's own code on a tiny model: each way compiles a graph of its own, `fixed` for its capacity
and `any` for every capacity, both choose the same token, and every round times both."""
import pytest
import torch

pytest.importorskip('transformers')
from bench import any_capacity, decode_reads  # noqa: E402
from selfattn_nbdev.models import GPT2  # noqa: E402


@pytest.mark.slow
@pytest.mark.no_cover  # coverage's tracer slows torch.compile
def test_measure_times_a_graph_of_one_capacity_against_one_of_any(monkeypatch):
    from torch._dynamo.utils import counters
    monkeypatch.setattr(decode_reads, 'STEPS', 3)
    monkeypatch.setattr(any_capacity, 'ROUNDS', 2)
    torch.manual_seed(0)
    model = GPT2(vocab_size=97, context_length=1024, d_model=32, num_heads=4, num_layers=2).eval()
    graphs = {'fixed': [], 'any': []}
    def counting(way):  # Dynamo's graphs of each function, run as traced
        def backend(gm, example_inputs): graphs[way].append(gm); return gm.forward
        return backend
    def fixed(ids, caches): return model(ids, caches)
    def any_capacity_step(ids, caches): return model(ids, caches)
    options = dict(fullgraph=True, dynamic=False)
    steps = dict(fixed=any_capacity.hosted(torch.compile(fixed, backend=counting('fixed'), **options)),
                 any=any_capacity.hosted(torch.compile(any_capacity_step, backend=counting('any'), **options)))
    torch._dynamo.reset(); counters.clear()
    with torch.no_grad():
        entry = any_capacity.measure(model, steps, 5)
        assert entry['same_token'] and entry['capacity'] == 256
        assert all(len(t) == 2 and min(t) > 0 for t in entry['ms_each_round'].values())
        assert entry['ratio_any_over_fixed'] == entry['ms']['any'] / entry['ms']['fixed']
        assert len(graphs['fixed']) == len(graphs['any']) == 1
        any_capacity.measure(model, steps, 300)                  # storage of 512 columns:
    assert len(graphs['fixed']) == 2 and len(graphs['any']) == 1  # the fixed way compiles again, the other not
