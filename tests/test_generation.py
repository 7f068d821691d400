"""The generation page's model: the cache never changes a token, and bad input gets a clear error."""
import pytest
import torch

from selfattn_nbdev.generation import CharTokenizer, TinyGPT, train_tiny_gpt, zen_of_python
from selfattn_nbdev.decoding import generate


@pytest.fixture(scope='module')
def trained():
    text = zen_of_python()
    tokenizer = CharTokenizer(text)
    torch.manual_seed(0)
    model = TinyGPT(len(tokenizer), context_length=96, d_model=32, num_heads=2, num_layers=2)
    losses = train_tiny_gpt(model, tokenizer.encode(text), steps=40, block_size=32, batch_size=8)
    return tokenizer, model, losses


def test_text_and_tokenizer():
    text = zen_of_python()
    assert text.startswith('The Zen of Python, by Tim Peters') and 'Namespaces' in text
    tokenizer = CharTokenizer(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    with pytest.raises(ValueError, match=r"not in the vocabulary: \['ü'\]"):
        tokenizer.encode('ü')


def test_training_lowers_the_loss(trained):
    _, _, losses = trained
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize('temperature', [0.0, 0.9])
@pytest.mark.parametrize('batch', [1, 3])
def test_cache_writes_the_same_tokens(trained, temperature, batch):
    tokenizer, model, _ = trained
    prompt = tokenizer.encode('Beautiful is')[None].repeat(batch, 1)
    runs = [generate(model, prompt, 60, use_cache=c, temperature=temperature,
                     generator=torch.Generator().manual_seed(3)) for c in (True, False)]
    assert runs[0].shape == (batch, 12 + 60)
    assert torch.equal(runs[0], runs[1])


def test_step_times_and_limits(trained):
    tokenizer, model, _ = trained
    times = []
    generate(model, tokenizer.encode('Simple')[None], 5, step_times=times)
    assert len(times) == 5 and all(t > 0 for t in times)
    with pytest.raises(ValueError, match="make 97, more than the model's context_length=96"):
        generate(model, tokenizer.encode('Simple')[None], 91)
    with pytest.raises(ValueError, match='more than context_length=96'):
        model(torch.zeros(1, 97, dtype=torch.long))
    with pytest.raises(ValueError, match='needs more than block_size=64'):
        train_tiny_gpt(model, torch.zeros(10, dtype=torch.long), steps=1)


@pytest.mark.parametrize('side', ['left', 'right'])
def test_a_tokenizers_padded_batch_with_its_attention_mask_is_the_list_of_its_prompts(side):
    """generate(model, input_ids, n, attention_mask=mask), as a tokenizer pads a batch (1 = a real token, 0 = padding,
    on either side): each row writes what its real tokens write alone; the tensor comes back as given, then the new
    tokens. A bool mask does the same."""
    from selfattn_nbdev import TinyGPT, generate
    torch.manual_seed(0)
    model = TinyGPT(20, 64, d_model=16, num_heads=2).eval()
    prompts = [torch.randint(0, 19, (n,)) for n in (5, 2, 4)]
    alone = generate(model, prompts, 6)
    T, pad = 5, torch.full((5,), 19)
    if side == 'left':
        ids = torch.stack([torch.cat([pad[:T - len(p)], p]) for p in prompts])
        mask = torch.stack([torch.arange(T) >= T - len(p) for p in prompts]).long()
    else:
        ids = torch.stack([torch.cat([p, pad[:T - len(p)]]) for p in prompts])
        mask = torch.stack([torch.arange(T) < len(p) for p in prompts]).long()
    for m in (mask, mask.bool()):
        out = generate(model, ids, 6, attention_mask=m)
        assert torch.equal(out[:, :T], ids)
        for row, prompt, one in zip(out, prompts, alone): assert torch.equal(row[T:], one[len(prompt):])
    unmasked = generate(model, ids, 6)          # without the mask, the padding is read as prompt
    assert not torch.equal(unmasked[:, T:], out[:, T:])


def test_generation_stops_at_the_models_end_of_text_ids():
    "from_hf keeps a checkpoint's eos_token_id as model.eos_token_ids: generate stops there unless told otherwise."
    from selfattn_nbdev.decoding import generate, generate_stream
    torch.manual_seed(0)
    model = TinyGPT(20, 64, d_model=16, num_heads=2).eval()
    prompt = torch.tensor([3, 1, 4])
    free = generate(model, [prompt], 12)[0][3:]                   # no end-of-text ids: 12 tokens
    assert len(free) == 12
    model.eos_token_ids = [int(free[4])]
    first = int((free == free[4]).nonzero()[0, 0])                # where that id is first written
    stopped = generate(model, [prompt], 12)[0][3:]
    assert stopped.tolist() == free[:first + 1].tolist()          # cut after the end-of-text id
    assert len(list(generate_stream(model, prompt[None], 12))) == first + 1
    assert generate(model, [prompt], 12, stop_ids=[])[0][3:].tolist() == free.tolist()  # [] : no stop
    other = int(free[first + 1]) if first + 1 < 12 else None
    if other is not None and other != free[4]:                    # the caller's ids win over the model's
        cut = int((free == other).nonzero()[0, 0])
        assert generate(model, [prompt], 12, stop_ids=other)[0][3:].tolist() == free[:cut + 1].tolist()


def test_transformers_generate_options_are_named_with_what_takes_them():
    """generate refuses options it lacks by name: transformers' spellings name the package's (eos_token_id: stop_ids),
    and beam search and the two kinds of speculative decoding name transformers' generate on the package's
    attention, which runs them (tests/test_hf_mask_forms.py)."""
    from selfattn_nbdev import TinyGPT, generate
    model = TinyGPT(20, 64, d_model=16, num_heads=2).eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match=r'does not support eos_token_id; eos_token_id \(here: stop_ids\)'):
        generate(model, ids, 2, eos_token_id=5)
    for name in ('num_beams', 'assistant_model', 'prompt_lookup_num_tokens'):
        with pytest.raises(TypeError, match=f"does not support {name}; {name} \\(here: transformers' generate, with "
                                            f"the model's attention through the package\\). It supports: use_cache"):
            generate(model, ids, 2, **{name: 3})
