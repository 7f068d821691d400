"""OLMo 2 and 3 (nbs/26_olmo.ipynb), a family whose block differs from Llama's, added in one module: read by from_hf
from tiny random models that transformers built and saved offline, against transformers in float64 (logits and
gradients; transformers' OLMo norms run in float32 whatever the dtype, so the tests give them the input's dtype),
with OLMo 3's sliding blocks where the config puts them or where transformers' rule puts them, an older rope_scaling
on the full blocks only, tied or untied heads; what it refuses, by name; saving; the transformers route. Its
compiled decode step is tested with every family's (tests/test_static_cache.py). Nothing is downloaded."""
import tempfile

import pytest
import torch

transformers = pytest.importorskip('transformers')
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.olmo2 import modeling_olmo2  # noqa: E402
from transformers.models.olmo3 import modeling_olmo3  # noqa: E402

from selfattn_nbdev.olmo import Olmo, OlmoAttention, olmo_config, olmo_weight_map  # noqa: E402
from selfattn_nbdev.pretrained import FAMILIES, from_hf  # noqa: E402
from conftest import check_saved_and_routed  # noqa: E402

transformers.logging.set_verbosity_error()
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)


@pytest.fixture
def exact_transformers(monkeypatch):
    """transformers' OLMo computes its norms and RoPE tables in float32 even in a float64 model; here in the
    model's dtype (default RoPE), so that float64 shows the two models compute the same function."""
    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def angles(x, position_ids, rope, dim):
        assert rope['rope_type'] == 'default'
        exact = 1.0 / (rope['rope_theta'] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        turned = position_ids[..., None].double() * exact
        turned = torch.cat((turned, turned), dim=-1)
        return turned.cos().to(x.dtype), turned.sin().to(x.dtype)

    def rope2(self, x, position_ids):
        return angles(x, position_ids, self.config.rope_parameters, 2 * len(self.inv_freq))

    def rope3(self, x, position_ids, layer_type):
        dim = 2 * len(getattr(self, f'{layer_type}_inv_freq'))
        return angles(x, position_ids, self.config.rope_parameters[layer_type], dim)

    for module in (modeling_olmo2.Olmo2RMSNorm, modeling_olmo3.Olmo3RMSNorm):
        monkeypatch.setattr(module, 'forward', norm)
    monkeypatch.setattr(modeling_olmo2.Olmo2RotaryEmbedding, 'forward', rope2)
    monkeypatch.setattr(modeling_olmo3.Olmo3RotaryEmbedding, 'forward', rope3)


def hf_olmo(kind='olmo3', dtype=torch.float64, **over):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(kind, **SMALL | over)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()
    with torch.no_grad():  # norms away from 1, so that a norm in the wrong place shows
        for name, p in model.named_parameters():
            if 'norm' in name: p.add_(0.3 * torch.randn_like(p))
    return model


def ours_of(hf):
    with tempfile.TemporaryDirectory() as folder:  # from_hf reads it whole
        hf.save_pretrained(folder)
        return from_hf(folder).to(hf.dtype)


CASES = {'olmo2': ('olmo2', {}), 'olmo3 sliding 3 in 4': ('olmo3', dict(sliding_window=5)),
         'olmo3 tied head': ('olmo3', dict(sliding_window=6, tie_word_embeddings=True)),
         'olmo3 listed blocks': ('olmo3', dict(sliding_window=6,
                                               layer_types=['full_attention', 'sliding_attention'] * 4))}


@pytest.mark.parametrize('kind,over', CASES.values(), ids=CASES.keys())
def test_logits_and_gradients_equal_transformers_in_float64(exact_transformers, kind, over):
    hf = hf_olmo(kind, **over)
    ours = ours_of(hf)
    hf.set_attn_implementation("sdpa")  # eager's softmax is float32 even in float64
    assert type(ours) is Olmo
    ids = torch.randint(3, 96, (2, 40))
    theirs, mine = hf(ids).logits, ours(ids)
    assert (mine - theirs).abs().max() <= 1e-10 * theirs.abs().max()
    theirs.pow(2).mean().backward(); mine.pow(2).mean().backward()
    for hf_name, (name,), _ in olmo_weight_map(len(ours.blocks), ours.head.weight is ours.token_emb.weight):
        g, h = ours.get_parameter(name).grad, hf.get_parameter('model.' * ('lm_head' not in hf_name) + hf_name).grad
        assert (g - h).abs().max() <= 1e-9 * h.abs().max(), hf_name


def test_olmo3_blocks_slide_where_transformers_slides_them():
    for n in (4, 6, 8, 12):
        given = dict(SMALL, num_hidden_layers=n)
        sizes = olmo_config(dict(model_type='olmo3', **given))
        assert sizes['layer_types'] == transformers.Olmo3Config(**given).layer_types
        assert sizes['window'] == 4096 and sizes['rope_base'] == 500000.0     # Olmo3Config's defaults
    olmo2 = olmo_config(dict(model_type='olmo2', **SMALL))
    assert (olmo2['layer_types'], olmo2['window'], olmo2['rope_base']) == (None, None, 10000.0)


def test_an_older_rope_scaling_rescales_the_full_blocks_only():
    "YaRN given as rope_scaling turns the full blocks only, as Olmo3Config reads it; the logits match (float32)."
    yarn = dict(rope_type='yarn', factor=4.0, original_max_position_embeddings=32)
    sizes = olmo_config(dict(model_type='olmo3', **SMALL, sliding_window=6, rope_scaling=yarn))
    scalings = {b.attn.window: b.attn.rope_scaling for b in Olmo(**sizes).blocks}
    assert scalings[6] is None and scalings[None]['rope_type'] == 'yarn'
    hf = hf_olmo('olmo3', torch.float32, sliding_window=6, rope_scaling=yarn)
    assert hf.config.rope_parameters['sliding_attention']['rope_type'] == 'default'
    ours, ids = ours_of(hf), torch.randint(3, 96, (2, 100))  # past the 32 positions YaRN stretches
    with torch.no_grad(): theirs, mine = hf(ids).logits, ours(ids)
    assert (mine - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    everywhere = Olmo(**sizes | dict(sliding_rope=(500000.0, sizes['rope_scaling'])))
    everywhere.load_state_dict(ours.state_dict())
    with torch.no_grad(): assert (everywhere(ids) - theirs).abs().max() > 1e-3 * theirs.abs().max()


@pytest.mark.parametrize('key,value', [('attention_bias', True), ('hidden_act', 'gelu')])
def test_what_it_does_not_compute_is_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"{key}={value!r} is not supported: Olmo"):
        olmo_config(dict(model_type="olmo3", **SMALL, **{key: value}))


def test_the_whole_vector_norm_is_not_the_per_head_one():
    """_project itself: a query whose first head is five times larger keeps its lead after the norm, one RMS over all
    heads (position 0: RoPE turns nothing); keys the same over their 2 heads."""
    attn = OlmoAttention(32, 16, num_heads=4, num_kv_heads=2).eval()
    with torch.no_grad():
        attn.W_query.weight[:8] *= 5                                      # head 0's rows
        q, k, _ = attn._project(torch.randn(1, 3, 32), torch.zeros(1, 3, dtype=torch.long))
    assert torch.allclose(q.pow(2).mean(dim=(1, 3)), torch.ones(1, 3), atol=1e-4)  # each token's whole query
    assert torch.allclose(k.pow(2).mean(dim=(1, 3)), torch.ones(1, 3), atol=1e-4)  # and whole key: RMS 1
    assert q[:, 0].pow(2).mean() > 5 * q[:, 1].pow(2).mean()                      # a head alone: not


@pytest.mark.parametrize('kind,over', [('olmo2', {}), ('olmo3', dict(sliding_window=5))])
def test_save_hf_and_the_transformers_route(tmp_path, kind, over):
    "Both families: save_hf writes what transformers reads; transformers' OLMo runs with the package's attention."
    assert FAMILIES[kind][0] is Olmo
    hf = hf_olmo(kind, torch.float32, **over)
    check_saved_and_routed(hf, ours_of(hf), tmp_path, torch.randint(3, 96, (2, 24)))
