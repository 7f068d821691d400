"""Weights in 2 MiB pages (Batches, "Weights in 2 MiB pages"): the memory `huge_page_buffer` gives, what
`weights_in_huge_pages` moves and keeps (values, ties, stacked groups, gradients, saving), that `generate` and the
serving engine move them, and that nothing moves where the system has no huge pages."""
import copy, io

import pytest
import torch

import selfattn_nbdev.decoding as decoding
from selfattn_nbdev.decoding import (HUGE_PAGE, generate, huge_page_buffer, huge_page_bytes, huge_pages_on,
                                     stacked, weights_in_huge_pages)
from selfattn_nbdev.generation import TinyGPT
from selfattn_nbdev.models import GPT2

ON = huge_pages_on()
needs_huge_pages = pytest.mark.skipif(not ON, reason="this system gives no transparent huge pages")


def wide(tied=False):
    "A model with storages above and below 2 MiB: a 4 MiB token table (the head tied to it or not), 1 MiB projections."
    torch.manual_seed(0)
    model = GPT2(vocab_size=2048, context_length=64, d_model=512, num_heads=8, num_layers=1).eval()
    if not tied: model.head.weight = torch.nn.Parameter(model.token_emb.weight.detach().clone())
    assert (model.head.weight is model.token_emb.weight) == tied
    return model


def test_huge_pages_on_reads_the_kernels_setting():
    try: mode = open('/sys/kernel/mm/transparent_hugepage/enabled').read()
    except OSError: mode = None
    assert ON == (mode is not None and '[never]' not in mode)


def test_the_buffer_is_writable_memory_of_the_size_asked_on_a_2_mib_boundary():
    b = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert b.dtype == torch.uint8 and b.shape == (3 * HUGE_PAGE + 5,) and b.device.type == 'cpu'
    b.fill_(7); assert int(b[-1]) == 7 and int(b.sum()) == 7 * b.numel()
    if ON: assert b.data_ptr() % HUGE_PAGE == 0 and b.untyped_storage().data_ptr() == b.data_ptr()


@needs_huge_pages
def test_linux_backs_the_buffer_with_huge_pages():
    "The advice is taken: after it is written, Linux reports most of 64 MiB in 2 MiB pages (it may refuse a few)."
    b = huge_page_buffer(2 ** 26).fill_(1)
    assert huge_page_bytes(b) >= 2 ** 25, huge_page_bytes(b)
    assert huge_page_bytes(b, b[10:], b.view(torch.float32)) == huge_page_bytes(b)  # one mapping, counted once


@pytest.mark.parametrize('tied', [False, True])
def test_moving_keeps_the_numbers_the_ties_and_the_parameters(tied):
    model = wide(tied)
    ids = torch.randint(0, 2048, (1, 9))
    params = list(model.parameters())
    with torch.no_grad(): want = model(ids)
    moved = weights_in_huge_pages(model)
    with torch.no_grad(): got = model(ids)
    assert torch.equal(got, want)
    assert list(model.parameters()) == params                  # the same Parameter objects
    assert (model.head.weight is model.token_emb.weight) == tied
    table = 2048 * 512 * 4
    if not ON: assert moved == 0; return
    assert moved >= table * (1 if tied else 2)                 # the 4 MiB table (and an untied head)
    assert model.token_emb.weight.data_ptr() % HUGE_PAGE == 0
    assert model.blocks[0].attn.out_proj.weight.data_ptr() % HUGE_PAGE != 0  # 1 MiB: left where it was
    assert weights_in_huge_pages(model) == 0                   # once


@needs_huge_pages
def test_a_stacked_group_moves_as_one_storage_and_stays_stacked():
    model = wide()
    attn = model.blocks[0].attn
    with torch.no_grad(), stacked(model):
        weights_in_huge_pages(model)
        pointers = [l.weight.data_ptr() for l in (attn.W_query, attn.W_key, attn.W_value)]
    assert pointers[0] % HUGE_PAGE == 0                        # 3 MiB stacked: moved
    assert pointers[1] - pointers[0] == pointers[2] - pointers[1] == 512 * 512 * 4  # end to end still
    with torch.no_grad(), stacked(model): pass                 # no copy in ordinary memory again
    assert attn.W_query.weight.data_ptr() == pointers[0]


def test_a_moved_model_trains_saves_loads_copies_and_shares():
    model = wide()
    weights_in_huge_pages(model)
    ids = torch.randint(0, 2048, (2, 9))
    before = model.token_emb.weight.detach().clone()
    model.train(); model(ids).logsumexp(-1).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()        # written in place, in the advised memory
    assert not torch.equal(model.token_emb.weight.detach(), before)
    buffer = io.BytesIO(); torch.save(model.state_dict(), buffer); buffer.seek(0)
    again = wide(); again.load_state_dict(torch.load(buffer, weights_only=True))
    twin = copy.deepcopy(model)
    model.share_memory()                                       # moved again, into shared memory
    model.eval(); again.eval(); twin.eval()
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids)) and torch.equal(twin(ids), model(ids))


def test_nothing_moves_where_the_system_has_no_huge_pages(monkeypatch):
    monkeypatch.setattr(decoding, 'huge_pages_on', lambda: False)
    model = wide()
    pointer = model.token_emb.weight.data_ptr()
    assert weights_in_huge_pages(model) == 0 and model.token_emb.weight.data_ptr() == pointer
    assert huge_page_buffer(10).shape == (10,)                 # ordinary memory, of the size asked


def test_meta_and_small_models_are_left_alone():
    with torch.device('meta'): meta = wide()
    assert weights_in_huge_pages(meta) == 0
    small = TinyGPT(10, 16, d_model=8, num_heads=2, num_layers=1)
    assert weights_in_huge_pages(small) == 0


@needs_huge_pages
def test_generate_and_the_engine_move_the_weights_and_write_the_same_tokens(monkeypatch):
    model, ids = wide(), torch.randint(0, 2048, (1, 6))
    with monkeypatch.context() as m:                          # the tokens of weights left in place
        m.setattr(decoding, 'weights_in_huge_pages', lambda model, min_bytes=None: 0)
        want = generate(model, ids, 5, stop_ids=[], compile=False)
    assert model.token_emb.weight.data_ptr() % HUGE_PAGE != 0
    got = generate(model, ids, 5, stop_ids=[], compile=False)
    assert torch.equal(got, want) and model.token_emb.weight.data_ptr() % HUGE_PAGE == 0
    from selfattn_nbdev.serving import Engine
    fresh = wide()
    Engine(fresh, num_blocks=8)
    assert fresh.token_emb.weight.data_ptr() % HUGE_PAGE == 0


def test_weights_shared_with_other_processes_stay_where_they_are():
    "share_memory_() puts a storage where other processes map it: moving it would part them from the model's weights."
    model = wide()
    model.token_emb.weight.share_memory_()
    pointer = model.token_emb.weight.data_ptr()
    weights_in_huge_pages(model)
    assert model.token_emb.weight.data_ptr() == pointer and model.token_emb.weight.is_shared()
    if ON: assert model.head.weight.data_ptr() % HUGE_PAGE == 0   # the rest still moves


def test_weights_moved_under_inference_mode_still_train():
    "generate may run under torch.inference_mode(): the moved weights must stay ordinary tensors, as stack_weights keeps them."
    model = wide()
    with torch.inference_mode():
        weights_in_huge_pages(model)
        generate(model, torch.randint(0, 2048, (1, 4)), 2, stop_ids=[], compile=False)
    assert not any(p.is_inference() for p in model.parameters())
    model.train(); model(torch.randint(0, 2048, (1, 5))).sum().backward()
    assert model.token_emb.weight.grad is not None
