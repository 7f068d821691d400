"""SmolLM3 (nbs/23_smollm3.ipynb), the family added in one module: read by from_hf from tiny random SmolLM3 models
that transformers built and saved offline, against transformers in float64 (logits and gradients), with NoPE blocks
where the config puts them, sliding windows and tied or untied heads; transformers' own rules for a config that
leaves the lists out; what it refuses, by name; and the transformers route. Nothing is downloaded."""
import tempfile

import pytest
import torch

transformers = pytest.importorskip('transformers')
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.smollm3 import modeling_smollm3 as sm  # noqa: E402

from selfattn_nbdev.pretrained import from_hf  # noqa: E402
from selfattn_nbdev.smollm3 import NoPEAttention, SmolLM3, smollm3_config  # noqa: E402
from conftest import check_saved_and_routed  # noqa: E402

transformers.logging.set_verbosity_error()
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)


def hf_smollm3(dtype=torch.float64, **over):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("smollm3", **SMALL | over)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()


def ours_of(hf):
    with tempfile.TemporaryDirectory() as folder:  # from_hf reads it whole
        hf.save_pretrained(folder)
        return from_hf(folder).to(hf.dtype)


@pytest.fixture
def exact_transformers(monkeypatch):
    """transformers' SmolLM3 computes its norms and RoPE tables in float32 even in a float64 model; here in the
    model's dtype (and attention by SDPA), so that float64 shows the two models compute the same function."""
    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        dim, base = 2 * len(self.inv_freq), self.config.rope_parameters["rope_theta"]
        exact = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = position_ids[..., None].double() * exact
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    monkeypatch.setattr(sm.SmolLM3RMSNorm, 'forward', norm)
    monkeypatch.setattr(sm.SmolLM3RotaryEmbedding, 'forward', rope)


CASES = {'every 4th NoPE': {}, 'a list of its own': dict(no_rope_layers=[0, 1, 0, 1, 1, 0, 1, 1]),
         'sliding NoPE blocks': dict(use_sliding_window=True, sliding_window=5),
         'untied head': dict(tie_word_embeddings=False), 'all NoPE': dict(no_rope_layers=[0] * 8)}


@pytest.mark.parametrize('over', CASES.values(), ids=CASES.keys())
def test_logits_and_gradients_equal_transformers_in_float64(over, exact_transformers):
    hf = hf_smollm3(**over)
    ours = ours_of(hf)
    hf.set_attn_implementation("sdpa")  # eager's softmax is float32 even in float64
    test = [i for i, r in enumerate(hf.config.no_rope_layers) if r == 0]
    assert [i for i, b in enumerate(ours.blocks) if isinstance(b.attn, NoPEAttention)] == test
    ids = torch.randint(3, 96, (2, 30))
    theirs, mine = hf(ids).logits, ours(ids)
    assert (mine - theirs).abs().max() <= 1e-10 * theirs.abs().max()
    theirs.square().mean().backward(); mine.square().mean().backward()
    g_hf = hf.model.layers[3].self_attn.k_proj.weight.grad
    g_ours = ours.blocks[3].attn.W_key.weight.grad
    assert (g_ours - g_hf).abs().max() <= 1e-10 * g_hf.abs().max()


def test_nope_matters():
    "The same weights with RoPE in every block are far from transformers: the test above can fail."
    hf = hf_smollm3()
    ours = ours_of(hf)
    turning = SmolLM3(**smollm3_config(ours.hf_config) | dict(rope_layers=[1] * 8)).double()
    turning.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 96, (1, 30))
    with torch.no_grad(): assert (turning(ids) - hf(ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize('n,every,window', [(8, 4, None), (12, 4, 64), (6, 3, 16), (5, 2, None)])
def test_a_config_without_its_lists_reads_as_transformers_reads_it(n, every, window):
    given = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=n, num_attention_heads=4,
                 no_rope_layer_interval=every, use_sliding_window=window is not None, sliding_window=window)
    theirs = transformers.SmolLM3Config(**given)
    sizes = smollm3_config(dict(model_type="smollm3", **given))
    assert sizes["rope_layers"] == theirs.no_rope_layers
    slides = sizes["layer_types"] or ["full_attention"] * n
    assert slides == (theirs.layer_types if window else ["full_attention"] * n)
    assert sizes["num_kv_heads"] == theirs.num_key_value_heads == 4  # SmolLM3's default, not Llama's
    assert sizes["tie_embeddings"] is True


@pytest.mark.parametrize('key,value', [('attention_bias', True), ('mlp_bias', True), ('hidden_act', 'gelu')])
def test_what_it_does_not_compute_is_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"{key}={value!r} is not supported: SmolLM3"):
        smollm3_config(dict(model_type="smollm3", **SMALL, **{key: value}))


@pytest.mark.parametrize('rope_layers', [[1, 0], [1, 1, 2, 1], 'all', [1.0, 1, 1, 0]])
def test_rope_layers_are_checked(rope_layers):
    with pytest.raises(ValueError, match="rope_layers must be None or a list of 4 values 0 or 1"):
        SmolLM3(64, 32, 32, 4, 4, rope_layers=rope_layers)


def test_save_hf_and_the_transformers_route(tmp_path):
    "save_hf writes what transformers reads; transformers' SmolLM3 runs with the package's attention inside."
    hf = hf_smollm3(torch.float32, use_sliding_window=True, sliding_window=5)
    check_saved_and_routed(hf, ours_of(hf), tmp_path, torch.randint(3, 96, (2, 24)))
