"""The generation page's model: the cache never changes a token, and bad input gets a clear error."""
import pytest
import torch

from selfattn_nbdev.generation import CharTokenizer, TinyGPT, generate, train_tiny_gpt, zen_of_python


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
