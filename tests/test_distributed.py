"""The splits of nbs/15_parallel.ipynb on gloo CPU ranks (forked from a server process): tensor parallelism on 4 ranks,
FSDP2, and run_ranks itself: its results, its report of which rank failed first, its timeout; every check on one rank
in this process too, so that coverage sees the code the ranks run. The ring's tests are in tests/test_ring.py."""
import json, os, re, subprocess, sys, tempfile, time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from selfattn_nbdev.distributed import (_failure_report, _importable, _rank_main, _save_whole, check_fsdp,
                                        check_tensor_parallel, free_port, run_ranks, tensor_parallel)
from selfattn_nbdev.multihead import MultiHeadAttention

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(d_in=16, d_out=32, context_length=8, num_heads=4)


# Functions for the ranks: run_ranks pickles them by name, and the ranks import this module to find them.
def fail_on_rank_1(rank, world_size):
    "Rank 1 raises at once; rank 0 waits for it in a barrier and fails when it leaves (the knock-on error)."
    if rank == 1: raise ValueError('boom')
    dist.barrier()


def rank_and_sum(rank, world_size):
    "Every rank's number, and the sum of all of them (an all-reduce)."
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, total.item()


@pytest.mark.heavy
def test_run_ranks_names_the_rank_that_failed_first():
    "Rank 1's own error (ValueError: boom) leads the report, before rank 0's knock-on one; 8 runs of 8 (0.1 s each)."
    for _ in range(8):
        with pytest.raises(RuntimeError) as failure:
            run_ranks(fail_on_rank_1, 2, timeout=60)
        message = str(failure.value)
        assert 'rank 1 raised ValueError: boom (the first)' in message, message
        assert "rank 1's traceback:" in message and message.rstrip().endswith('ValueError: boom'), message
        assert re.search(r'rank 0 (raised \w+Error: .*|was stopped by run_ranks) \(after it\)', message), message


@pytest.mark.heavy
def test_run_ranks_returns_every_rank_result():
    assert run_ranks(rank_and_sum, 3) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_failure_report_orders_root_cause_first():
    "A rank that died without saving anything, then saved errors by time, then the ranks run_ranks stopped."
    outcomes = {0: {'error': 'RuntimeError: Connection closed by peer', 'time': 2.0, 'traceback': 'tb0\n'},
                1: {'error': 'ValueError: boom', 'time': 1.0, 'traceback': 'tb1\n'}, 2: {}, 3: {}}
    report = _failure_report('step', outcomes, died=[0, 1, 3])
    lines = report.splitlines()[1:5]
    assert [l.strip() for l in lines] == ['rank 3 exited before it could save its error (the first)',
                     'rank 1 raised ValueError: boom (after it)',
                     'rank 0 raised RuntimeError: Connection closed by peer (after it)',
                     'rank 2 was stopped by run_ranks (after it)'], lines
    assert report.endswith("rank 3's traceback:\n(no traceback saved)\n")
    assert _failure_report('step', {1: outcomes[1], 0: outcomes[0]}, died=[0, 1]).endswith('tb1\n')


def test_importable_finds_the_exported_copy():
    "A function defined in __main__ (a notebook) runs as the package's exported copy; an unknown one is refused."
    def check_fsdp(): pass
    def not_in_the_package(): pass
    for fn in (check_fsdp, not_in_the_package): fn.__module__ = '__main__'
    from selfattn_nbdev import distributed, ring
    assert _importable(check_fsdp) is distributed.check_fsdp
    check_fsdp.__name__ = 'ring_attention'
    assert _importable(check_fsdp) is ring.ring_attention
    with pytest.raises(ValueError, match='not_in_the_package is defined in __main__'):
        _importable(not_in_the_package)
    assert _importable(rank_and_sum) is rank_and_sum


@pytest.mark.slow  # starts ranks twice: make test-slow, in CI
def test_run_ranks_errors_and_timeout():
    "A rank's error comes back with its traceback; a run past its timeout is stopped."
    with pytest.raises(RuntimeError, match='missing 1 required positional argument'):
        run_ranks(check_fsdp, 2, dict(d_in=4, d_out=4))
    with pytest.raises(TimeoutError, match='timeout=0.1'):
        run_ranks(check_tensor_parallel, 2, [SMALL] * 50, timeout=0.1)


@pytest.mark.slow
def test_tensor_parallel_four_ranks():
    "8 heads and 4 key/value heads on 4 ranks: 2 and 1 each; with a window and RoPE."
    config = dict(d_in=16, d_out=32, context_length=8, num_heads=8, num_kv_heads=4, window=3, rope=True)
    for r in run_ranks(check_tensor_parallel, 4, [config]):
        assert max(r[0][k] for k in ('output', 'explicit', 'cache', 'grad')) < 1e-6
        assert r[0]['local_heads'] == (2, 1)


@pytest.fixture
def one_rank():
    "A gloo group of one rank in this process."
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_checks_on_one_rank(one_rank):
    "Tensor parallelism and FSDP2 in this process on one rank (the code the ranks run, under coverage)."
    r = check_tensor_parallel(0, 1, [dict(SMALL, num_kv_heads=2, rope=True)])[0]
    assert r['output'] == r['grad'] == 0.0 and r['local_heads'] == (4, 2)
    r = check_fsdp(0, 1, SMALL, steps=2)
    assert r['loaded'] == r['params'] == r['loss'] == 0.0 and r['shard_rows'] == 32


def test_tensor_parallel_keeps_whole_groups_on_one_rank(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh('cpu', (1,))
    m = tensor_parallel(MultiHeadAttention(**SMALL, num_kv_heads=2), mesh)
    assert (m.num_heads, m.num_kv_heads) == (4, 2)


def test_rank_main_saves_result_and_error():
    "A rank's main saves what fn returned, or its error on one line, the traceback and when it was raised."
    with tempfile.TemporaryDirectory() as folder:
        _rank_main(0, 1, free_port(), check_tensor_parallel, ([dict(SMALL)],), folder, 30)
        assert torch.load(os.path.join(folder, 'rank0.pt'), weights_only=False)['result'][0]['grad'] == 0.0
        before = time.monotonic()
        with pytest.raises(SystemExit):
            _rank_main(0, 1, free_port(), check_fsdp, ({},), folder, 30)
        saved = torch.load(os.path.join(folder, 'rank0.pt'), weights_only=False)
        assert saved['error'].startswith('TypeError: ') and '\n' not in saved['error']
        assert 'Traceback' in saved['traceback'] and before <= saved['time'] <= time.monotonic()


def test_rank_main_shortens_a_long_error():
    with tempfile.TemporaryDirectory() as folder:
        with pytest.raises(SystemExit):
            _rank_main(0, 1, free_port(), check_fsdp, (dict(SMALL, **{'x' * 300: 1}),), folder, 30)
        error = torch.load(os.path.join(folder, 'rank0.pt'), weights_only=False)['error']
        assert len(error) == 160 and error.endswith('…'), error


def test_a_failed_save_leaves_no_result_file():
    "A save that stops halfway (here: a lambda cannot be pickled) leaves no file where run_ranks looks for results."
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, 'rank0.pt')
        with pytest.raises(Exception): _save_whole({'result': lambda: 0}, path)
        assert not os.path.exists(path)
        _save_whole({'result': 1}, path)
        assert torch.load(path)['result'] == 1 and not os.path.exists(path + '.part')


@pytest.mark.heavy
def test_bench_counts_what_the_page_says():
    """bench/distributed.py's counts, run on 2 ranks at small sizes, are the page's formulas: 4 all-reduces of (T, d)
    for tensor parallelism, the layer's parameters gathered and scattered once for FSDP2."""
    from bench.distributed import fsdp_rank, tp_rank
    mha = dict(d_in=32, d_out=32, context_length=16, num_heads=4, num_kv_heads=2, out_bias=False)
    tp = run_ranks(tp_rank, 2, mha, timeout=120)[0]
    tokens_bytes = mha['context_length'] * mha['d_out'] * 4                   # (b·T, d_out) float32, b = 1
    assert tp['calls'] == {'all_reduce': 4} and tp['bytes'] == 4 * tokens_bytes
    kv_dim = mha['d_out'] // mha['num_heads'] * mha['num_kv_heads']
    params = (2 * mha['d_out'] * mha['d_in'] + 2 * kv_dim * mha['d_in']) * 4  # W_query, out_proj; W_key, W_value
    assert run_ranks(fsdp_rank, 2, mha, timeout=120)[0]['bytes'] == 2 * params


SCRIPT = re.compile(r'```python\n(# (\w+\.py)\n.*?)```', re.S)


def scripts(notebook: str) -> dict:
    "The torchrun scripts a page shows as text: {file name: source}."
    nb = json.loads((ROOT/'nbs'/notebook).read_text())
    text = '\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'markdown')
    return {name: src for src, name in SCRIPT.findall(text)}


# Runs a page's script as torchrun would, after registering an exit hook that runs last (atexit runs its hooks in
# reverse): it counts the gloo worker threads still alive when Python is about to shut down. Any left then may be
# ended mid-destructor by the shutdown and abort the rank, at random (SIGABRT; see release_process_groups).
EXIT_REPORT = """import atexit, os, runpy, sys
def report():
    tasks = os.listdir('/proc/self/task') if os.path.isdir('/proc/self/task') else []
    names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in tasks]
    print(f"rank {os.environ['RANK']}: gloo workers at exit {names.count('pt_gloo_runloop')}", flush=True)
atexit.register(report)
if len(sys.argv) > 2: import selfattn_nbdev.distributed; atexit.unregister(selfattn_nbdev.distributed.release_process_groups)
runpy.run_path(sys.argv[1], run_name='__main__')
"""


def run_script(tmp_path, name: str, source: str, ranks: int, *, release=True):
    "Run `source` under torchrun on `ranks` CPU ranks, with EXIT_REPORT around it (its atexit release removed if not `release`)."
    (tmp_path/name).write_text(source)
    (tmp_path/'exit_report.py').write_text(EXIT_REPORT)
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', str(ranks),
                           '--master-port', str(free_port()), 'exit_report.py', name, *([] if release else ['-'])],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def workers_at_exit(stdout: str) -> dict:
    "{rank: gloo worker threads alive as Python shut down}, from EXIT_REPORT's lines."
    return {int(r): int(n) for r, n in re.findall(r'rank (\d+): gloo workers at exit (\d+)', stdout)}


def torchrun(tmp_path, name: str, source: str, ranks: int, line: str) -> list:
    "Run a page's script under torchrun on `ranks` CPU ranks; the lines it printed that match regex `line`, sorted."
    res = run_script(tmp_path, name, source, ranks)
    assert res.returncode == 0, res.stderr[-3000:]     # any rank's non-zero exit or abort fails the test: no retry
    assert 'unwaited collective' not in res.stderr, res.stderr[-3000:]   # every result used before the end
    assert workers_at_exit(res.stdout) == {r: 0 for r in range(ranks)}, res.stdout[-3000:]   # every group ended
    # the ranks print at once into one pipe: their lines may interleave, so each is found where it is
    found = sorted(re.findall(line, res.stdout))
    assert found, f'no line matching {line!r} in:\n{res.stdout[-3000:]}'
    return found


@pytest.mark.slow  # starts torchrun twice
def test_the_pages_torchrun_scripts_run_as_shown(tmp_path):
    "The scripts the parallel page shows run under torchrun, and print what the page says they print."
    shown = scripts('15_parallel.ipynb')
    assert sorted(shown) == ['hello_ranks.py', 'split_heads.py']
    assert torchrun(tmp_path, 'hello_ranks.py', shown['hello_ranks.py'], 4, r'rank \d+ of \d+: sum of ranks \d+') == [
        f'rank {r} of 4: sum of ranks 6' for r in range(4)]
    found = torchrun(tmp_path, 'split_heads.py', shown['split_heads.py'], 2,
                     r'rank \d+: \d+ heads, output \([\d, ]+\), sum -?[\d.]+')
    assert [line.split(', sum')[0] for line in found] == [f'rank {r}: 2 heads, output (2, 8, 32)' for r in range(2)]
    assert len({line.split(', sum')[1] for line in found}) == 1        # every rank holds the whole output


@pytest.mark.slow  # starts torchrun
def test_without_the_release_torch_keeps_the_group_of_a_mesh(tmp_path):
    """The cause, kept in view: without release_process_groups, split_heads.py's ranks still run gloo workers when
    Python shuts down, after dist.destroy_process_group() (torch 2.13). If this fails, torch ends such groups itself
    and the release can go."""
    res = run_script(tmp_path, 'split_heads.py', scripts('15_parallel.ipynb')['split_heads.py'], 1, release=False)
    assert res.returncode == 0 or 'terminate called' in res.stderr, res.stderr[-3000:]
    assert workers_at_exit(res.stdout) == {0: 2}, res.stdout[-3000:]     # ProcessGroupGloo's 2 worker threads


def test_release_process_groups_leaves_a_live_group_alone():
    "While a group is initialized, nothing is dropped: the mesh still reaches its group."
    from torch.distributed.device_mesh import init_device_mesh
    from selfattn_nbdev.distributed import release_process_groups
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)
    try:
        mesh = init_device_mesh('cpu', (1,))
        release_process_groups()
        assert mesh._pg_registry and mesh.get_group() is dist.group.WORLD
    finally: dist.destroy_process_group()
    release_process_groups()
    assert mesh._pg_registry == {}


def test_check_tp_degree_takes_sinks_and_copies_of_key_value_heads():
    """Sinks split with the heads (they were refused); fewer key/value heads than ranks are copied (they were refused);
    a degree that neither divides num_kv_heads nor is a multiple of it is still refused, by name."""
    from selfattn_nbdev.distributed import check_tp_degree
    from selfattn_nbdev.llama_attention import LlamaAttention
    check_tp_degree(LlamaAttention(16, 8, num_heads=4, num_kv_heads=2, sinks=True), 2)
    check_tp_degree(LlamaAttention(16, 8, num_heads=4, num_kv_heads=2, softcap=5.0), 2)   # the cap splits with the heads
    check_tp_degree(MultiHeadAttention(**SMALL, num_kv_heads=1), 4)                        # 1 key/value head, 4 copies
    check_tp_degree(MultiHeadAttention(d_in=16, d_out=32, context_length=8, num_heads=8, num_kv_heads=2), 8)
    with pytest.raises(ValueError, match=r'divide num_kv_heads .* or be a multiple of it .*num_kv_heads=3, degree=2'):
        check_tp_degree(MultiHeadAttention(24, 24, 8, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match='num_heads=4, degree=8'):
        check_tp_degree(MultiHeadAttention(**SMALL, num_kv_heads=1), 8)


def test_torchs_activation_checkpointing_wraps_the_models_blocks(tmp_path):
    """PyTorch's apply_activation_checkpointing (what torchtune applies before fully_shard) on a Llama's blocks: the
    state dict keeps its names, padded and packed training steps give the plain model's loss and gradients, generate
    writes its tokens, and the peak memory of a step (the profiler's timeline) is less than half the plain model's."""
    import copy, json, warnings
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.profiler import ProfilerActivity, profile
    from selfattn_nbdev.decoding import generate
    from selfattn_nbdev.masks import sliding_window
    from selfattn_nbdev.models import Llama
    torch.manual_seed(0)
    plain = Llama(vocab_size=256, context_length=256, d_model=64, num_heads=4, num_kv_heads=2, num_layers=6)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, type(plain.blocks[0])))
    assert type(wrapped.blocks[0]).__name__ == 'CheckpointWrapper' and list(wrapped.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 256, (2, 256))
    padding = torch.zeros(2, 256, dtype=torch.bool); padding[0, :40] = True
    documents = (torch.arange(256) >= 100).long().expand(2, -1)
    def step(model, **inputs):
        model.zero_grad(set_to_none=True)
        loss = model(ids, **inputs)[~padding].logsumexp(-1).mean()
        loss.backward()
        return loss.item(), [p.grad for p in model.parameters()]
    for inputs in ({}, dict(key_padding_mask=padding), dict(document_ids=documents), dict(mask_mod=sliding_window(8))):
        (a, grads), (b, their) = step(plain, **inputs), step(wrapped, **inputs)
        assert abs(a - b) < 1e-6 and max((g - h).abs().max().item() for g, h in zip(grads, their)) < 1e-6, inputs
    def peak(model) -> float:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            step(model)
        with warnings.catch_warnings():  # deprecated for CUDA's snapshots; a CPU has no other timeline
            warnings.simplefilter('ignore', FutureWarning)
            p.export_memory_timeline(str(tmp_path / 'timeline.json'), 'cpu')
        return max(map(sum, json.loads((tmp_path / 'timeline.json').read_text())[1]))
    assert peak(wrapped) < peak(plain) / 2
    plain.eval(); wrapped.eval()
    assert torch.equal(generate(wrapped, ids[:1, :20], 8), generate(plain, ids[:1, :20], 8))


# --- a whole model split: every block's attention by heads, its MLP by columns then rows. On 2 ranks the Parallel
# page's cells check it (Llama, GPT-2, a Llama with one key/value head), as they check sinks and copied key/value
# heads on 4 and 2 ranks; make test runs them. Here: the code on one rank, and what is refused.
def _llama():
    from selfattn_nbdev.models import Llama
    return Llama(vocab_size=64, context_length=16, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_hidden=48,
                 window=6)


class _Mesh:
    "What the whole-model split reads of a DeviceMesh before it splits anything."
    def __init__(self, n): self.n = n
    def size(self): return self.n


def test_tensor_parallel_model_on_one_rank(one_rank):
    "The same check in this process (its code under coverage): one rank holds every head; with sequence parallelism too."
    from selfattn_nbdev.distributed import check_tensor_parallel_model
    r = check_tensor_parallel_model(0, 1, _llama)
    assert r['logits'] == 0.0 and r['grad'] == 0.0 and r['tokens_equal'] and r['local_heads'] == (4, 2)
    r = check_tensor_parallel_model(0, 1, _llama, 12, True)
    assert r['logits'] < 1e-6 and r['grad'] < 1e-6 and r['tokens_equal'] is None, r
    r = check_tensor_parallel_model(0, 1, _llama, 12, False, True)   # the token table and head by vocabulary
    assert r['logits'] < 1e-6 and r['grad'] < 1e-6 and r['tokens_equal'], r


def test_vocab_parallel_keeps_a_tied_head_one_table(one_rank):
    "GPT-2's head is its token table: split by vocabulary, it is still one parameter, with one gradient."
    from torch.distributed.device_mesh import init_device_mesh
    from selfattn_nbdev.distributed import tensor_parallel_model
    from selfattn_nbdev.models import GPT2
    model = tensor_parallel_model(GPT2(vocab_size=64, context_length=16, d_model=32, num_heads=4, num_layers=1),
                                  init_device_mesh('cpu', (1,)), vocab_parallel=True)
    assert model.head.weight is model.token_emb.weight and hasattr(model.head.weight, 'to_local')
    assert sum(p is model.head.weight for p in model.parameters()) == 1


def _sequence_parallel_gemma(rank, world_size):
    """On each rank: a Gemma (norms after the attention and the MLP too, scaled embeddings, a capped head) split with
    sequence parallelism, against the whole model; then the token counts it refuses, by name."""
    from functools import partial
    from selfattn_nbdev.distributed import check_tensor_parallel_model, tensor_parallel_model
    from selfattn_nbdev.gemma import Gemma
    from torch.distributed.device_mesh import init_device_mesh
    make = partial(Gemma, vocab_size=64, context_length=16, d_model=32, num_heads=4, num_layers=2, num_kv_heads=2,
                   d_hidden=48, head_dim=8, window=6, softcap=5.0, final_softcap=10.0)
    result = check_tensor_parallel_model(rank, world_size, make, 12, True)
    for sp in (False, True):   # and the tied table split by a vocabulary of 63, which 2 ranks do not divide
        vocab = check_tensor_parallel_model(rank, world_size, partial(make, vocab_size=63), 12, sp, True)
        result = {k: max(result[k], vocab[k]) for k in ('logits', 'grad')}
    torch.manual_seed(0)
    split = tensor_parallel_model(make(), init_device_mesh('cpu', (world_size,)), sequence_parallel=True)
    errors = []
    for ids in (torch.zeros(2, 11, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)):  # odd; one decode step
        try: split(ids)
        except ValueError as e: errors.append(str(e))
    return result, errors


@pytest.mark.slow  # starts 2 ranks
def test_sequence_parallel_gemma_two_ranks():
    """Post-norms under sequence parallelism equal the whole model, and with the tied table split by an odd vocabulary;
    11 tokens, or 1 (a decode step), refused by name."""
    for result, errors in run_ranks(_sequence_parallel_gemma, 2):
        assert result['logits'] < 1e-4 and result['grad'] < 1e-4, result
        assert len(errors) == 2 and 'multiple of 2; got 11' in errors[0] and 'got 1. To decode' in errors[1], errors


def test_tensor_parallel_model_refuses_before_it_splits_anything():
    """A block it cannot split (a latent attention, a gated query, a norm over all heads, an MLP of another kind, a
    width the degree does not divide) is refused by name, and no block before it has been split."""
    from torch import nn
    from selfattn_nbdev.distributed import tensor_parallel_model
    from selfattn_nbdev.hybrid import GatedAttention
    from selfattn_nbdev.models import Llama
    from selfattn_nbdev.olmo import OlmoAttention
    model = _llama()
    model.blocks[1].attn = OlmoAttention(32, 16, num_heads=4, num_kv_heads=2)
    with pytest.raises(TypeError, match=r'OlmoAttention norms q over all its heads \(q_norm of 32, not head_dim=8\)'):
        tensor_parallel_model(model, _Mesh(2))
    assert type(model.blocks[0].attn.W_query.weight) is nn.Parameter                       # block 0 left whole
    model.blocks[1].attn = GatedAttention(32, 16, num_heads=4, num_kv_heads=2)
    with pytest.raises(TypeError, match=r'GatedAttention makes its queries, keys and values its own way'):
        tensor_parallel_model(model, _Mesh(2))
    model.blocks[1].attn = nn.Identity()
    with pytest.raises(TypeError, match=r'splits a MultiHeadAttention by heads; blocks\[1\].attn is Identity'):
        tensor_parallel_model(model, _Mesh(2))
    model = _llama()
    model.blocks[0].mlp = nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 32))  # weights in the middle
    with pytest.raises(TypeError, match=r'blocks\[0\].mlp is Sequential'):
        tensor_parallel_model(model, _Mesh(2))
    model = _llama()
    model.blocks[1].extra = nn.Linear(32, 32)   # not token by token alone: no share of the tokens
    with pytest.raises(TypeError, match=r"which a norm or dropout allows; blocks\[1\].extra is Linear"):
        tensor_parallel_model(model, _Mesh(2), sequence_parallel=True)
    assert type(model.blocks[0].attn.W_query.weight) is nn.Parameter
    model = _llama()
    model.blocks[0].norm2 = nn.GroupNorm(1, 16)   # statistics over the tokens: not on a share of them
    with pytest.raises(TypeError, match=r"blocks\[0\].norm2 is GroupNorm"):
        tensor_parallel_model(model, _Mesh(2), sequence_parallel=True)
    model = _llama()
    model.token_emb = nn.Identity()
    with pytest.raises(TypeError, match=r"vocab_parallel splits the model's token_emb .* Llama.token_emb is Identity"):
        tensor_parallel_model(model, _Mesh(2), vocab_parallel=True)
    assert type(model.blocks[0].attn.W_query.weight) is nn.Parameter
    model = _llama()
    del model.norm
    with pytest.raises(TypeError, match=r"before the model's final norm and head; Llama has no 'norm'"):
        tensor_parallel_model(model, _Mesh(2), sequence_parallel=True)
    with pytest.raises(ValueError, match=r'hidden width; got 48 in blocks\[0\].mlp, degree=32'):
        tensor_parallel_model(Llama(vocab_size=64, context_length=16, d_model=64, num_heads=32, num_layers=1,
                                    d_hidden=48), _Mesh(32))            # 32 heads split, 48 hidden units not
