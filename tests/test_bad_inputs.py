"""Every public name, given what users get wrong: each case must raise, with the package's own message naming the
argument and the value given (the rules are on the Core page, "The rules every check follows").

A case is (callable, error type, the words its message must contain: the argument's name and the value given).
The last tests check the answers that must be right rather than raise: empty inputs, counts of zero, eval mode."""
import math

import pytest
import torch
from torch import nn

from selfattn_nbdev import (CausalAttention, KVCache, MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttention,
                            SelfAttentionV1, SelfAttentionV2, apply_rope, causal_allowed, check_context, check_count,
                            check_dropout, check_flag, check_heads, check_range, check_size, check_token_ids,
                            check_tokens, leaks_future, package_attention, repeat_kv, rope_angles, simple_attention,
                            softmax_stable, to_torch_multihead, window_allowed)
import selfattn_nbdev.distributed as D
import selfattn_nbdev.ring as R  # noqa: E402
import selfattn_nbdev.masks as M
import selfattn_nbdev.kernels as kernels
import selfattn_nbdev.pretrained as P
import selfattn_nbdev.llama_attention as RC
from selfattn_nbdev.explorer import AttentionExplorer, reference_module
from selfattn_nbdev.generation import CharTokenizer, TinyGPT, TransformerBlock, train_tiny_gpt
from selfattn_nbdev.decoding import sample_next
from selfattn_nbdev.decoding import StaticKVCache, generate, generate_stream
from selfattn_nbdev.caches import CacheProtocol
from selfattn_nbdev.models import Llama
from selfattn_nbdev.olmo import OlmoAttention
from selfattn_nbdev.gqa_window_rope import check_kv_heads, check_rope, check_window
from selfattn_nbdev.gqa_window_rope import rope_rotate as R_rope_rotate
from selfattn_nbdev.tiled import online_softmax, tiled_attention
from selfattn_nbdev.training import (VOCAB, BankSenseClassifier, accuracy, check_labels, check_sentences,
                                     make_bank_sentences, train_classifier)

torch.manual_seed(0)
X = torch.randn(2, 5, 4)                      # (batch, num_tokens, d_in)


def _old(name):
    "A deprecated name of the package, its FutureWarning silenced (tests/test_masks.py checks the warning)."
    import warnings, selfattn_nbdev
    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', FutureWarning)
            return getattr(selfattn_nbdev, name)(*args, **kwargs)
    return call


def _forced(kernel, **mods):
    "A module call with gradients under attention_kernel(kernel)."
    with kernels.attention_kernel(kernel): return MultiHeadAttention(4, 8, 8)(X, **mods)
TOK = CharTokenizer('abc de')
GPT = TinyGPT(len(TOK), context_length=16, d_model=8, num_heads=2, num_layers=1)
IDS, LABELS, POS = make_bank_sentences(6, seed=0)
CLF = BankSenseClassifier()
EXPLORER = AttentionExplorer(['a', 'b'], torch.eye(2), torch.eye(2), torch.eye(2), torch.eye(2))
Q = torch.randn(1, 2, 6, 4)                   # (batch, heads, T, head_dim)

GPT2_CFG = dict(n_embd=8, n_head=2, n_layer=1, vocab_size=10, n_positions=8)
LLAMA_CFG = dict(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, vocab_size=10, intermediate_size=16,
                 max_position_embeddings=8)


def _llama_of(config: dict):
    "The Llama a config describes, as from_hf builds it (random weights): what save_hf may be asked to write."
    build, sizes, *_ = P._family(dict(config, model_type='llama'))
    return build(**sizes)


def _with_lora(model):
    "An adapter left unmerged, as peft leaves one beside a linear: a tensor no config describes."
    model.blocks[0].attn.W_query.lora_A = torch.nn.Linear(8, 2, bias=False)
    return model


def _bad_gpt2_state():
    "A GPT-2 state dict in Hugging Face's names whose token table has 3 rows, not 10."
    from transformers import GPT2Config, GPT2LMHeadModel
    state = GPT2LMHeadModel(GPT2Config(**GPT2_CFG)).state_dict()
    state['transformer.wte.weight'] = torch.zeros(3, 8)
    return state


def _append_twice():
    cache = KVCache()
    cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    cache.append(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))


def _static_after_cast():
    m = MultiHeadAttention(4, 4, 8)
    cache = StaticKVCache(8)
    with torch.no_grad(): m(torch.randn(1, 2, 4), cache=cache)
    m.double()
    with torch.no_grad(): m(torch.randn(1, 1, 4, dtype=torch.float64), cache=cache)


def _second_order_through_tiled():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    grad, = torch.autograd.grad(tiled_attention(q, q, q).sum(), q, create_graph=True)
    grad.sum().backward()


def _fill(cache, num_tokens):
    "Give `cache` num_tokens tokens through a module with context_length 16."
    m = MultiHeadAttention(4, 4, 16)
    with torch.no_grad(): m(torch.randn(1, num_tokens, 4), cache=cache)


def _ring_chunk():
    m, cache = MultiHeadAttention(4, 4, 16, window=3), StaticKVCache(8)
    with torch.no_grad():
        m(torch.randn(1, 4, 4), cache=cache)
        m(torch.randn(1, 2, 4), cache=cache)


def _two_modules(cache):
    a, b = MultiHeadAttention(4, 4, 8), MultiHeadAttention(4, 4, 8)
    with torch.no_grad():
        a(X[:1, :2], cache=cache)
        b(X[:1, :2], cache=cache)


class _Mesh:
    "A stand-in for a DeviceMesh of `n` ranks: what a check reads before anything is split."
    def __init__(self, n): self.n = n
    def size(self): return self.n


CASES = {
    # --- the shared checks
    'check_size zero': (lambda: check_size(0, 'd_in'), ValueError, ['d_in', 'got 0']),
    'check_size float': (lambda: check_size(2.5, 'd_out'), ValueError, ['d_out', '2.5']),
    'check_size bool': (lambda: check_size(True, 'num_heads'), ValueError, ['num_heads', 'True']),
    'check_size str': (lambda: check_size('4', 'd_in'), ValueError, ['d_in', "'4'"]),
    'check_size None': (lambda: check_size(None, 'd_in'), ValueError, ['d_in', 'None']),
    'check_count negative': (lambda: check_count(-1, 'steps'), ValueError, ['steps', '-1']),
    'check_count float': (lambda: check_count(1.0, 'steps'), ValueError, ['steps', '1.0']),
    'check_count bool': (lambda: check_count(False, 'steps'), ValueError, ['steps', 'False']),
    'check_flag str': (lambda: check_flag('False', 'causal'), TypeError, ['causal', "'False'"]),
    'check_flag int': (lambda: check_flag(1, 'qkv_bias'), TypeError, ['qkv_bias', 'got 1']),
    'check_flag None': (lambda: check_flag(None, 'rope'), TypeError, ['rope', 'None']),
    'check_range below': (lambda: check_range(-0.5, 'lr', 0), ValueError, ['lr', '-0.5']),
    'check_range open low': (lambda: check_range(0, 'lr', 0, low_open=True), ValueError, ['lr', '(0', 'got 0']),
    'check_range above': (lambda: check_range(2, 'p', 0, 1), ValueError, ['p', '[0, 1]', 'got 2']),
    'check_range nan': (lambda: check_range(math.nan, 'temperature', 0), ValueError, ['temperature', 'nan']),
    'check_range str': (lambda: check_range('1', 'lr', 0), ValueError, ['lr', "'1'"]),
    'check_range bool': (lambda: check_range(True, 'lr', 0), ValueError, ['lr', 'True']),
    'check_token_ids list': (lambda: check_token_ids([1, 2], 5), TypeError, ['token_ids', 'list']),
    'check_token_ids float': (lambda: check_token_ids(torch.ones(3), 5), TypeError, ['token_ids', 'float32']),
    'check_token_ids bool': (lambda: check_token_ids(torch.ones(3, dtype=torch.bool), 5), TypeError,
                             ['token_ids', 'torch.bool']),
    'check_token_ids 3-D': (lambda: check_token_ids(torch.zeros(1, 1, 1, dtype=torch.long), 5), ValueError,
                            ['token_ids', '(1, 1, 1)']),
    'check_token_ids too big': (lambda: check_token_ids(torch.tensor([5]), 5), ValueError, ['token_ids', '[0, 5)', '5']),
    'check_token_ids negative': (lambda: check_token_ids(torch.tensor([-1, 0]), 5), ValueError,
                                 ['token_ids', 'from -1']),
    'check_tokens list': (lambda: check_tokens([[1.0]], 1), TypeError, ['x', 'list']),
    'check_tokens 1-D': (lambda: check_tokens(torch.ones(3), 3), ValueError, ['x', '1 dims']),
    'check_tokens 4-D': (lambda: check_tokens(torch.ones(1, 1, 1, 3), 3), ValueError, ['x', '4 dims']),
    'check_tokens d_in': (lambda: check_tokens(torch.ones(2, 3), 4), ValueError, ['d_in=4', '(2, 3)']),
    'check_tokens int': (lambda: check_tokens(torch.ones(2, 3, dtype=torch.long), 3), TypeError, ['x', 'int64']),
    'check_tokens dtype': (lambda: check_tokens(torch.ones(2, 3), 3, dtype=torch.float64), TypeError,
                           ['float32', 'float64']),
    'check_dropout negative': (lambda: check_dropout(-0.1), ValueError, ['dropout', '-0.1']),
    'check_dropout one': (lambda: check_dropout(1.0), ValueError, ['dropout', '1.0']),
    'check_dropout str': (lambda: check_dropout('0.1'), (TypeError, ValueError), ['dropout', "'0.1'"]),
    'check_context too long': (lambda: check_context(9, 8), ValueError, ['context_length=8', '9']),
    'check_heads no divisor': (lambda: check_heads(6, 4), ValueError, ['num_heads', 'num_heads=4']),
    'check_heads zero': (lambda: check_heads(6, 0), ValueError, ['num_heads', 'got 0']),
    'check_kv_heads no divisor': (lambda: check_kv_heads(4, 3), ValueError, ['num_kv_heads', '3']),
    'check_kv_heads zero': (lambda: check_kv_heads(4, 0), ValueError, ['num_kv_heads', '0']),
    'check_window zero': (lambda: check_window(0, True), ValueError, ['window', '0']),
    'check_window not causal': (lambda: check_window(4, False), ValueError, ['window=4', 'causal']),
    'check_rope base one': (lambda: check_rope(True, 1.0, 4), ValueError, ['rope_base', '1.0']),
    'check_rope flag': (lambda: check_rope('yes', 10000.0, 4), TypeError, ['rope', "'yes'"]),
    'check_rope odd': (lambda: check_rope(True, 10000.0, 3), ValueError, ['head_dim', '3']),
    # --- the story's functions and modules
    'softmax_stable +inf': (lambda: softmax_stable(torch.tensor([1.0, math.inf, 2.0])), ValueError, ['x', '+inf', '[1]']),
    'simple_attention list': (lambda: simple_attention([[1.0, 2.0]]), TypeError, ['inputs', 'list']),
    'simple_attention 1-D': (lambda: simple_attention(torch.ones(3)), ValueError, ['inputs', '1 dims']),
    'simple_attention int': (lambda: simple_attention(torch.ones(2, 3, dtype=torch.long)), TypeError,
                             ['inputs', 'int64']),
    'simple_attention flag': (lambda: simple_attention(X[0], return_attn_weights='False'), TypeError,
                              ['return_attn_weights', "'False'"]),
    'SelfAttention d_in': (lambda: SelfAttention(0, 3), ValueError, ['d_in', '0']),
    'SelfAttention d_out': (lambda: SelfAttention(4, -1), ValueError, ['d_out', '-1']),
    'SelfAttention x': (lambda: SelfAttention(4, 3)(torch.ones(5, 3)), ValueError, ['d_in=4', '(5, 3)']),
    'SelfAttention flag': (lambda: SelfAttention(4, 3)(X, return_attn_weights='False'), TypeError,
                           ['return_attn_weights', "'False'"]),
    'SelfAttention float64 x': (lambda: SelfAttention(4, 3)(X.double()), TypeError, ['float64', 'float32']),
    'SelfAttentionV1 d_in': (lambda: SelfAttentionV1(2.0, 3), ValueError, ['d_in', '2.0']),
    'SelfAttentionV1 flag': (lambda: SelfAttentionV1(4, 3)(X, return_attn_weights=1), TypeError,
                             ['return_attn_weights', 'got 1']),
    'SelfAttentionV1 x': (lambda: SelfAttentionV1(4, 3)(torch.ones(5)), ValueError, ['x', '1 dims']),
    'SelfAttentionV2 qkv_bias': (lambda: SelfAttentionV2(4, 3, qkv_bias='no'), TypeError, ['qkv_bias', "'no'"]),
    'SelfAttentionV2 flag': (lambda: SelfAttentionV2(4, 3)(X, return_attn_weights='False'), TypeError,
                             ['return_attn_weights', "'False'"]),
    'SelfAttentionV2 x': (lambda: SelfAttentionV2(4, 3)(torch.ones(2, 5, 3)), ValueError, ['d_in=4', '(2, 5, 3)']),
    'CausalAttention context': (lambda: CausalAttention(4, 3, 0), ValueError, ['context_length', '0']),
    'CausalAttention dropout': (lambda: CausalAttention(4, 3, 8, dropout=1.5), ValueError, ['dropout', '1.5']),
    'CausalAttention too long': (lambda: CausalAttention(4, 3, 4)(X), ValueError, ['context_length=4', '5']),
    'CausalAttention flag': (lambda: CausalAttention(4, 3, 8)(X, return_attn_weights='False'), TypeError,
                             ['return_attn_weights', "'False'"]),
    'CausalAttention qkv_bias': (lambda: CausalAttention(4, 3, 8, qkv_bias=0), TypeError, ['qkv_bias', 'got 0']),
    'causal_allowed negative': (lambda: causal_allowed(-1), ValueError, ['num_tokens', '-1']),
    'causal_allowed float': (lambda: causal_allowed(2.5), ValueError, ['num_tokens', '2.5']),
    'causal_allowed str': (lambda: causal_allowed('3'), ValueError, ['num_tokens', "'3'"]),
    'causal_allowed few keys': (lambda: causal_allowed(3, num_keys=2), ValueError, ['num_keys=2', 'num_tokens=3']),
    'causal_mask (old name) few keys': (lambda: _old('causal_mask')(3, num_keys=2), ValueError, ['num_keys=2']),
    'leaks_future t': (lambda: leaks_future(CausalAttention(4, 3, 8), X, 4), ValueError, ['t', 'got t=4']),
    'leaks_future negative t': (lambda: leaks_future(CausalAttention(4, 3, 8), X, -1), ValueError, ['t', '-1']),
    'Wrapper heads': (lambda: MultiHeadAttentionWrapper(4, 6, 8, num_heads=4), ValueError, ['num_heads', '4']),
    'Wrapper d_out': (lambda: MultiHeadAttentionWrapper(4, 0, 8), ValueError, ['d_out', '0']),
    'MHA d_in': (lambda: MultiHeadAttention(0, 4, 8), ValueError, ['d_in', '0']),
    'MHA context_length': (lambda: MultiHeadAttention(4, 4, -2), ValueError, ['context_length', '-2']),
    'MHA heads': (lambda: MultiHeadAttention(4, 6, 8, num_heads=4), ValueError, ['num_heads', '4']),
    'MHA kv heads': (lambda: MultiHeadAttention(4, 8, 8, num_heads=4, num_kv_heads=3), ValueError,
                     ['num_kv_heads', '3']),
    'MHA window': (lambda: MultiHeadAttention(4, 8, 8, window=0), ValueError, ['window', '0']),
    'MHA window causal': (lambda: MultiHeadAttention(4, 8, 8, causal=False, window=2), ValueError, ['window=2']),
    'MHA rope flag': (lambda: MultiHeadAttention(4, 8, 8, rope='True'), TypeError, ['rope', "'True'"]),
    'MHA rope base': (lambda: MultiHeadAttention(4, 8, 8, rope=True, rope_base=0.5), ValueError,
                      ['rope_base', '0.5']),
    'MHA causal flag': (lambda: MultiHeadAttention(4, 8, 8, causal='False'), TypeError, ['causal', "'False'"]),
    'MHA qkv_bias flag': (lambda: MultiHeadAttention(4, 8, 8, qkv_bias='no'), TypeError, ['qkv_bias', "'no'"]),
    'MHA out_bias flag': (lambda: MultiHeadAttention(4, 8, 8, out_bias=None), TypeError, ['out_bias', 'None']),
    'MHA dropout': (lambda: MultiHeadAttention(4, 8, 8, dropout=-0.2), ValueError, ['dropout', '-0.2']),
    'MHA flag': (lambda: MultiHeadAttention(4, 8, 8)(X, return_attn_weights='False'), TypeError,
                 ['return_attn_weights', "'False'"]),
    'MHA x d_in': (lambda: MultiHeadAttention(4, 8, 8)(torch.ones(2, 5, 3)), ValueError, ['d_in=4', '(2, 5, 3)']),
    'MHA x too long': (lambda: MultiHeadAttention(4, 8, 4)(X), ValueError, ['context_length=4', '5']),
    'MHA padding dtype': (lambda: MultiHeadAttention(4, 8, 8)(X, key_padding_mask=torch.zeros(2, 5)), TypeError,
                          ['key_padding_mask', 'float32']),
    'MHA padding shape': (lambda: MultiHeadAttention(4, 8, 8)(X, key_padding_mask=torch.zeros(2, 4, dtype=bool)),
                          ValueError, ['key_padding_mask', '(2, 4)']),
    'MHA padding list': (lambda: MultiHeadAttention(4, 8, 8)(X, key_padding_mask=[[False] * 5] * 2), TypeError,
                         ['key_padding_mask', 'list']),
    'MHA cache with padding': (lambda: MultiHeadAttention(4, 8, 8)(X, key_padding_mask=torch.zeros(2, 5, dtype=bool),
                                                                   cache=KVCache()), ValueError, ['key_padding_mask']),
    'to_torch d_in': (lambda: to_torch_multihead(MultiHeadAttention(4, 8, 8)), ValueError, ['d_in=4', 'd_out=8']),
    'to_torch window': (lambda: to_torch_multihead(MultiHeadAttention(8, 8, 8, window=2)), ValueError, ['window=2']),
    'to_torch rope': (lambda: to_torch_multihead(MultiHeadAttention(8, 8, 8, rope=True)), ValueError, ['rope=True']),
    'to_torch gqa': (lambda: to_torch_multihead(MultiHeadAttention(8, 8, 8, num_heads=4, num_kv_heads=2)),
                     ValueError, ['num_kv_heads=2']),
    # --- since 2017
    'repeat_kv zero': (lambda: repeat_kv(Q, 0), ValueError, ['group_size', '0']),
    'repeat_kv float': (lambda: repeat_kv(Q, 2.0), ValueError, ['group_size', '2.0']),
    'repeat_kv 3-D': (lambda: repeat_kv(Q[0], 2), ValueError, ['t', '(batch, num_kv_heads', '[2, 6, 4]']),
    'repeat_kv list': (lambda: repeat_kv([1, 2], 2), ValueError, ['t', 'list']),
    'window_allowed negative tokens': (lambda: window_allowed(-2, 3), ValueError, ['num_tokens', '-2']),
    'window_allowed zero': (lambda: window_allowed(4, 0), ValueError, ['window', '0']),
    'window_mask (old name) zero': (lambda: _old('window_mask')(4, 0), ValueError, ['window', '0']),
    'rope_angles base negative': (lambda: rope_angles(torch.arange(4), 4, base=-10), ValueError, ['base', '-10']),
    'rope_angles base one': (lambda: rope_angles(torch.arange(4), 4, base=1), ValueError, ['base', 'got 1']),
    'rope_angles odd': (lambda: rope_angles(torch.arange(4), 5), ValueError, ['head_dim', '5']),
    'rope_angles zero dim': (lambda: rope_angles(torch.arange(4), 0), ValueError, ['head_dim', '0']),
    'rope_angles 2-D positions': (lambda: rope_angles(torch.zeros(2, 3), 4), ValueError, ['positions', '[2, 3]']),
    'rope_angles list positions': (lambda: rope_angles([0, 1], 4), ValueError, ['positions', 'list']),
    'apply_rope int x': (lambda: apply_rope(torch.ones(5, 4, dtype=torch.long), torch.arange(5)), TypeError,
                         ['x', 'int64']),
    'apply_rope 1-D x': (lambda: apply_rope(torch.ones(4), torch.arange(1)), TypeError, ['x', '(4,)']),
    'apply_rope one position': (lambda: apply_rope(torch.ones(5, 4), torch.tensor([3])), ValueError,
                                ['positions', '(5,)', '[1]']),
    'apply_rope base zero': (lambda: apply_rope(torch.ones(5, 4), torch.arange(5), base=0), ValueError,
                             ['base', 'got 0']),
    # --- how fused attention is fast
    'tiled_attention scale': (lambda: tiled_attention(Q, Q, Q, scale=-1.0), ValueError, ['scale', '-1.0']),
    'attention_kernel name': (lambda: kernels.attention_kernel('fast').__enter__(), ValueError, ['kernel', "'fast'"]),
    'MHA mask_mod': (lambda: MultiHeadAttention(4, 8, 8)(X, mask_mod='causal'), TypeError, ['mask_mod', 'str']),
    'MHA score_mod': (lambda: MultiHeadAttention(4, 8, 8)(X, score_mod=3), TypeError, ['score_mod', 'int']),
    'MHA scale': (lambda: MultiHeadAttention(4, 8, 8)(X, scale=float('inf')), ValueError, ['scale', 'inf']),
    'MHA scale bool': (lambda: MultiHeadAttention(4, 8, 8)(X, scale=True), ValueError, ['scale', 'True']),
    'MHA mask_mod cache': (lambda: MultiHeadAttention(4, 8, 8)(X, mask_mod=M.causal, cache=KVCache()), ValueError,
                           ['mask_mod', 'cache']),
    'attention_kernel dense score': (lambda: _forced('dense', score_mod=lambda s, b, h, q, k: s), ValueError,
                                     ["'dense'", 'score function']),
    'attention_kernel flex backward': (lambda: _forced('flex_eager', mask_mod=M.causal), ValueError,
                                       ["'flex_eager'", 'backward']),
    'attention_kernel varlen mask_mod': (lambda: _forced('varlen', mask_mod=M.causal), ValueError,
                                         ["'varlen'", 'mask_mod']),
    'tiled queries list': (lambda: tiled_attention([1.0], Q, Q), (TypeError, ValueError), ['queries']),
    'tiled int queries': (lambda: tiled_attention(Q.long(), Q.long(), Q.long()), TypeError, ['queries', 'int64']),
    'tiled block_size': (lambda: tiled_attention(Q, Q, Q, block_size=0), ValueError, ['block_size', '0']),
    'tiled causal flag': (lambda: tiled_attention(Q, Q, Q, causal='True'), TypeError, ['causal', "'True'"]),
    'tiled head_dim': (lambda: tiled_attention(Q, Q[..., :3], Q), ValueError, ['keys']),
    'online_softmax int': (lambda: online_softmax(torch.ones(3, dtype=torch.long)), TypeError,
                           ['attn_scores', 'int64']),
    'online_softmax block': (lambda: online_softmax(torch.ones(3), block_size=0), ValueError, ['block_size', '0']),
    'tiled second order': (lambda: _second_order_through_tiled(), RuntimeError, ['create_graph=True', 'second-order']),
    # --- masks as functions
    'sliding_window zero': (lambda: M.sliding_window(0), ValueError, ['window', '0']),
    'sliding_window float': (lambda: M.sliding_window(2.5), ValueError, ['window', '2.5']),
    'key_padding float mask': (lambda: M.key_padding(torch.zeros(2, 3)), TypeError, ['padding', 'float32']),
    'key_padding negative length': (lambda: M.key_padding(torch.tensor([-1, 2])), ValueError, ['padding', '-1']),
    'key_padding list': (lambda: M.key_padding([3, 2]), TypeError, ['padding', 'list']),
    'documents float': (lambda: M.documents(torch.zeros(2, 3)), TypeError, ['document_ids', 'float32']),
    'documents 1-D': (lambda: M.documents(torch.zeros(3, dtype=torch.long)), ValueError, ['document_ids', '(3,)']),
    'documents negative': (lambda: M.documents(torch.tensor([[0, -1]])), ValueError, ['document_ids', '-1']),
    'document_positions float': (lambda: M.document_positions(torch.zeros(1, 3)), TypeError,
                                 ['document_ids', 'float32']),
    'and_masks none': (lambda: M.and_masks(), TypeError, ['and_masks', 'got []']),
    'or_masks str': (lambda: M.or_masks('causal'), TypeError, ['or_masks', "['str']"]),
    'and_layer_mask str': (lambda: M.and_layer_mask('causal'), TypeError, ['and_layer_mask', "['str']"]),
    'or_layer_mask none': (lambda: M.or_layer_mask(None), TypeError, ['or_layer_mask', "['NoneType']"]),
    'or_layer_mask asked directly': (lambda: M.or_layer_mask(M.causal)(0, 0, 1, 1), TypeError,
                                     ["or_layer_mask(causal) joins each layer's own mask", 'for_layer']),
    'dense_mask not a predicate': (lambda: M.dense_mask('causal', 3), TypeError, ['dense_mask', "['str']"]),
    'dense_mask negative': (lambda: M.dense_mask(M.causal, -1), ValueError, ['num_tokens', '-1']),
    'dense_mask batch': (lambda: M.dense_mask(M.causal, 3, batch=-1), ValueError, ['batch', '-1']),
    'block_mask block': (lambda: M.block_mask(M.causal, 8, block_size=0), ValueError, ['block_size', '0']),
    'MHA document ids float': (lambda: MultiHeadAttention(4, 8, 8)(X, document_ids=torch.zeros(2, 5)), TypeError,
                               ['document_ids', 'float32']),
    # --- attention across devices
    'tp_plan not attention': (lambda: D.tp_plan(nn.Linear(2, 2)), TypeError, ['MultiHeadAttention', 'Linear']),
    'check_tp_degree module': (lambda: D.check_tp_degree(nn.Linear(2, 2), 2), TypeError, ['module', 'Linear']),
    'check_tp_degree heads': (lambda: D.check_tp_degree(MultiHeadAttention(8, 8, 8, num_heads=2), 4), ValueError,
                              ['num_heads=2', 'degree=4']),
    'check_tp_degree kv heads': (lambda: D.check_tp_degree(MultiHeadAttention(12, 12, 8, num_heads=6, num_kv_heads=3),
                                                           2), ValueError, ['num_kv_heads=3', 'degree=2']),
    'check_tp_degree by heads': (lambda: D.check_tp_degree(OlmoAttention(8, 8, num_heads=2), 2), TypeError,
                                 ['whole heads', 'OlmoAttention', 'q_norm of 8', 'head_dim=4']),
    'tensor_parallel_model blocks': (lambda: D.tensor_parallel_model(nn.Linear(2, 2), _Mesh(2)), TypeError,
                                     ['blocks', 'Linear']),
    'tensor_parallel_model mlp width': (lambda: D.tensor_parallel_model(
        Llama(8, 8, d_model=8, num_heads=4, num_layers=1, d_hidden=6), _Mesh(4)), ValueError,
        ['hidden width', '6', 'blocks[0].mlp', 'degree=4']),
    'tensor_parallel_model sequence_parallel': (lambda: D.tensor_parallel_model(
        Llama(8, 8, d_model=8, num_heads=4, num_layers=1), _Mesh(2), sequence_parallel='yes'), TypeError,
        ['sequence_parallel', "'yes'"]),
    'tensor_parallel_model vocab_parallel': (lambda: D.tensor_parallel_model(
        Llama(8, 8, d_model=8, num_heads=4, num_layers=1), _Mesh(2), vocab_parallel=None), TypeError,
        ['vocab_parallel', 'None']),
    'tp_plan sequence_parallel': (lambda: D.tp_plan(MultiHeadAttention(8, 8, 8), sequence_parallel=1), TypeError,
                                  ['sequence_parallel', '1']),
    'check_tp_degree zero': (lambda: D.check_tp_degree(MultiHeadAttention(8, 8, 8), 0), ValueError, ['degree', '0']),
    'run_ranks world_size': (lambda: D.run_ranks(print, 0), ValueError, ['world_size', '0']),
    'sequence_chunks order': (lambda: R.sequence_chunks(0, 2, order='bad'), ValueError, ['order', "'bad'"]),
    'shard_sequence length': (lambda: R.shard_sequence(torch.zeros(1, 1, 8, 2), 0, 3), ValueError,
                              ['num_tokens=8', '6']),
    # --- the attention inside GPT-2 and Llama
    'GPT2 layers': (lambda: P.GPT2(num_layers=0), ValueError, ['num_layers', '0']),
    'Llama kv heads': (lambda: P.Llama(10, 8, 8, 4, 1, num_kv_heads=3), ValueError, ['num_kv_heads=3']),
    'gpt2_weight_map layers': (lambda: P.gpt2_weight_map(-1), ValueError, ['num_layers', '-1']),
    'llama_weight_map layers': (lambda: P.llama_weight_map(0), ValueError, ['num_layers', '0']),
    'gpt2_config not a dict': (lambda: P.gpt2_config('gpt2'), TypeError, ['config', 'str']),
    'gpt2_config missing': (lambda: P.gpt2_config({}), KeyError, ['n_embd']),
    'gpt2_config n_inner': (lambda: P.gpt2_config(dict(GPT2_CFG, n_inner=7)), ValueError, ['n_inner=7']),
    'gpt2_from_hf heads': (lambda: P.gpt2_from_hf({}, dict(GPT2_CFG, n_head=3)), ValueError, ['num_heads=3']),
    'gpt2_from_hf empty': (lambda: P.gpt2_from_hf({}, GPT2_CFG), KeyError, ['wte.weight']),
    'llama_config rope_scaling': (lambda: P.llama_config(dict(LLAMA_CFG, rope_scaling={'rope_type': 'llama3'})),
                                  ValueError, ['rope_scaling', 'llama3']),
    'llama_config activation': (lambda: P.llama_config(dict(LLAMA_CFG, hidden_act='gelu')), ValueError,
                                ["hidden_act='gelu'"]),
    'llama_config bias': (lambda: P.llama_config(dict(LLAMA_CFG, attention_bias=True)), ValueError,
                          ['attention_bias=True']),
    'llama_from_hf empty': (lambda: P.llama_from_hf({}, LLAMA_CFG), KeyError, ['embed_tokens.weight']),
    'llama_config rope_type': (lambda: P.llama_config(dict(LLAMA_CFG, rope_scaling={'rope_type': 'yarn'})),
                               ValueError, ['rope_scaling', "'yarn'"]),
    'llama_config model_type': (lambda: P.llama_config(dict(LLAMA_CFG, model_type='gemma2')), ValueError,
                                ["model_type='gemma2'"]),
    'from_hf source': (lambda: P.from_hf(3), TypeError, ['source', 'int']),
    'from_hf path': (lambda: P.from_hf('no/such/file.pt'), FileNotFoundError, ['source', "'no/such/file.pt'"]),
    'from_hf no config': (lambda: P.from_hf({}), ValueError, ['config', 'None']),
    'from_hf model_type': (lambda: P.from_hf({}, dict(LLAMA_CFG, model_type='deepseek_v2')), ValueError,
                           ["model_type='deepseek_v2'"]),
    'deepseek_config experts': (lambda: P.deepseek_config(dict(LLAMA_CFG, model_type='deepseek_v3',
                                                               first_k_dense_replace=0)),
                                ValueError, ['first_k_dense_replace=0', 'num_hidden_layers=1', 'MoE']),
    'deepseek_config rope_type': (lambda: P.deepseek_config(dict(LLAMA_CFG, model_type='deepseek_v3',
                                                                 rope_scaling={'type': 'dynamic'})),
                                  ValueError, ["rope_type='dynamic'"]),
    'check_yarn factor': (lambda: P.check_yarn({'rope_type': 'yarn', 'factor': 0.5,
                                                'original_max_position_embeddings': 64}),
                          ValueError, ['factor', '0.5']),
    'LatentAttention rope_dim': (lambda: P.LatentAttention(8, 8, 2, kv_rank=4, rope_dim=3, nope_dim=4, v_dim=4),
                                 ValueError, ['rope_dim', '3']),
    'LatentAttention document_ids': (lambda: P.LatentAttention(8, 8, 2, 4, 2, 2, 2)(
        torch.randn(1, 3, 8), document_ids=torch.zeros(1, 3, dtype=torch.long)), ValueError, ['document_ids']),
    'deepseek_weight_map layers': (lambda: P.deepseek_weight_map(0), ValueError, ['num_layers', '0']),
    'from_hf config': (lambda: P.from_hf({}, 'config.json'), TypeError, ['config', 'str']),
    'save_hf no config': (lambda: P.save_hf(GPT, 'unwritten'), ValueError, ['config is None', 'hf_config']),
    'save_hf model': (lambda: P.save_hf(GPT, 'unwritten', dict(LLAMA_CFG, model_type='llama')), TypeError,
                      ['Llama', 'model=TinyGPT']),
    'save_hf unmerged LoRA': (lambda: P.save_hf(_with_lora(_llama_of(LLAMA_CFG)), 'unwritten',
                                                 dict(LLAMA_CFG, model_type='llama')), ValueError,
                              ['lora_A.weight', 'no such tensor', 'merge_and_unload()']),
    'save_hf folder': (lambda: P.save_hf(_llama_of(LLAMA_CFG), 3, dict(LLAMA_CFG, model_type='llama')), TypeError,
                       ['folder', 'int']),
    'save_hf overwrite': (lambda: P.save_hf(_llama_of(LLAMA_CFG), 'unwritten', dict(LLAMA_CFG, model_type='llama'),
                                            overwrite='yes'), TypeError, ['overwrite', "'yes'"]),
    # --- attention since 2023
    'LlamaAttention head_dim': (lambda: RC.LlamaAttention(8, 8, 2, head_dim=0), ValueError, ['head_dim', '0']),
    'LlamaAttention qk_norm': (lambda: RC.LlamaAttention(8, 8, 2, qk_norm='yes'), TypeError, ['qk_norm', "'yes'"]),
    'LlamaAttention sinks': (lambda: RC.LlamaAttention(8, 8, 2, sinks=1), TypeError, ['sinks', '1']),
    'LlamaAttention softcap': (lambda: RC.LlamaAttention(8, 8, 2, softcap=-1.0), ValueError, ['softcap', '-1.0']),
    'LlamaAttention rope_scaling': (lambda: RC.LlamaAttention(8, 8, 2, rope_scaling=[8.0]), TypeError,
                                    ['rope_scaling', 'list']),
    'LlamaAttention llama3 factor': (lambda: RC.LlamaAttention(8, 8, 2, rope_scaling=dict(
        factor=0.5, low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=64)), ValueError,
                                     ['factor', '0.5']),
    'layer_windows types': (lambda: RC.layer_windows(2, 4, ['local', 'global']), ValueError, ['layer_types', "'local'"]),
    'layer_windows no window': (lambda: RC.layer_windows(1, None, ['sliding_attention']), ValueError,
                                ['window is None']),
    'soft_cap zero': (lambda: RC.soft_cap(torch.ones(2), 0), ValueError, ['cap', '0']),
    'soft_cap bool': (lambda: RC.soft_cap(torch.ones(2), True), ValueError, ['cap', 'True']),
    'softmax_with_sink heads': (lambda: RC.softmax_with_sink(torch.ones(2, 3, 3), torch.zeros(3)), ValueError,
                                ['sink', '(3,)']),
    'kv_cache_bytes tokens': (lambda: RC.kv_cache_bytes(-1, 2, 8), ValueError, ['num_tokens', '-1']),
    'kv_cache_bytes per_token': (lambda: RC.kv_cache_bytes(4, 2, 0), ValueError, ['per_token', '0']),
    'kv_cache_bytes window': (lambda: RC.kv_cache_bytes(4, 2, 8, window=-5), ValueError, ['window', '-5']),
    'gpt2_from_hf shape': (lambda: P.gpt2_from_hf(_bad_gpt2_state(), GPT2_CFG), ValueError, ['wte.weight', '(3, 8)']),
    'from_torch_multihead kdim': (lambda: P.from_torch_multihead(nn.MultiheadAttention(8, 2, kdim=4, vdim=4), 8),
                                  ValueError, ['kdim']),
    'from_torch_multihead bias_kv': (lambda: P.from_torch_multihead(nn.MultiheadAttention(8, 2, add_bias_kv=True), 8),
                                     ValueError, ['add_bias_kv']),
    'from_torch_multihead module': (lambda: P.from_torch_multihead(nn.Linear(2, 2), 8), TypeError, ['ref', 'Linear']),
    'from_torch_multihead context': (lambda: P.from_torch_multihead(nn.MultiheadAttention(8, 2), 0), ValueError,
                                     ['context_length', '0']),
    'from_torch_multihead causal': (lambda: P.from_torch_multihead(nn.MultiheadAttention(8, 2), 8, causal='no'),
                                    TypeError, ['causal', "'no'"]),
    # --- watching attention learn
    'make_bank n': (lambda: make_bank_sentences(0, seed=0), ValueError, ['n', '0']),
    'make_bank length': (lambda: make_bank_sentences(3, seed=0, num_tokens=1), ValueError, ['num_tokens', '1']),
    'make_bank seed': (lambda: make_bank_sentences(3, seed='0'), TypeError, ['seed', "'0'"]),
    'make_bank seed float': (lambda: make_bank_sentences(3, seed=1.5), TypeError, ['seed', '1.5']),
    'classifier vocab': (lambda: BankSenseClassifier(vocab_size=0), ValueError, ['vocab_size', '0']),
    'classifier classes': (lambda: BankSenseClassifier(num_classes=-1), ValueError, ['num_classes', '-1']),
    'classifier d_model': (lambda: BankSenseClassifier(d_model=0), ValueError, ['d_model', '0']),
    'classifier ids float': (lambda: CLF(IDS.float(), POS), TypeError, ['token_ids', 'float32']),
    'classifier ids range': (lambda: CLF(IDS + 100, POS), ValueError, ['token_ids', f'[0, {len(VOCAB)})']),
    'classifier ids 1-D': (lambda: CLF(IDS[0], POS), ValueError, ['token_ids', '(batch, num_tokens)']),
    'classifier bank -1': (lambda: CLF(IDS, POS - 10), ValueError, ['bank_positions', '[0, 5)']),
    'classifier bank past end': (lambda: CLF(IDS, POS + 5), ValueError, ['bank_positions', '[0, 5)']),
    'classifier bank count': (lambda: CLF(IDS, POS[:3]), ValueError, ['bank_positions', '(6,)', '(3,)']),
    'classifier bank float': (lambda: CLF(IDS, POS.float()), TypeError, ['bank_positions', 'float32']),
    'classifier flag': (lambda: CLF(IDS, POS, return_attn_weights='False'), TypeError,
                        ['return_attn_weights', "'False'"]),
    'train_classifier steps': (lambda: train_classifier(CLF, IDS, LABELS, POS, steps=-5), ValueError, ['steps', '-5']),
    'train_classifier lr': (lambda: train_classifier(CLF, IDS, LABELS, POS, lr=0), ValueError, ['lr', 'got 0']),
    'train_classifier labels': (lambda: train_classifier(CLF, IDS, LABELS[:, None], POS), ValueError,
                                ['labels', '(6,)', '(6, 1)']),
    'accuracy labels 2-D': (lambda: accuracy(CLF, IDS, LABELS[:, None], POS), ValueError, ['labels', '(6, 1)']),
    'accuracy labels float': (lambda: accuracy(CLF, IDS, LABELS.float(), POS), ValueError, ['labels', 'float32']),
    'accuracy labels list': (lambda: accuracy(CLF, IDS, LABELS.tolist(), POS), ValueError, ['labels', 'list']),
    'check_labels short': (lambda: check_labels(LABELS[:2], 6), ValueError, ['labels', '(2,)']),
    'check_sentences ids': (lambda: check_sentences(IDS.float(), POS, 10), TypeError, ['token_ids']),
    # --- generation
    'CharTokenizer empty': (lambda: CharTokenizer(''), ValueError, ['text', "''"]),
    'CharTokenizer list': (lambda: CharTokenizer(['a', 'b']), ValueError, ['text', "['a', 'b']"]),
    'encode unknown': (lambda: TOK.encode('xyz'), ValueError, ['characters not in the vocabulary', "'x'"]),
    'encode bytes': (lambda: TOK.encode(b'abc'), TypeError, ['text', 'bytes']),
    'decode negative': (lambda: TOK.decode([0, -1]), ValueError, ['token_ids', 'from -1']),
    'decode too big': (lambda: TOK.decode(torch.tensor([0, 6])), ValueError, ['token_ids', '[0, 6)', '6']),
    'decode float': (lambda: TOK.decode(torch.tensor([0.0])), TypeError, ['token_ids', 'float32']),
    'decode 2-D': (lambda: TOK.decode(torch.zeros(1, 2, dtype=torch.long)), ValueError, ['token_ids', '(1, 2)']),
    'TinyGPT layers': (lambda: TinyGPT(10, 16, num_layers=-1), ValueError, ['num_layers', '-1']),
    'TinyGPT layers zero': (lambda: TinyGPT(10, 16, num_layers=0), ValueError, ['num_layers', '0']),
    'TinyGPT vocab': (lambda: TinyGPT(0, 16), ValueError, ['vocab_size', '0']),
    'TinyGPT context': (lambda: TinyGPT(10, 0), ValueError, ['context_length', '0']),
    'TinyGPT heads': (lambda: TinyGPT(10, 16, d_model=10, num_heads=4), ValueError, ['num_heads', '4']),
    'TinyGPT window': (lambda: TinyGPT(10, 16, window=0), ValueError, ['window', '0']),
    'TinyGPT rope': (lambda: TinyGPT(10, 16, rope='yes'), TypeError, ['rope', "'yes'"]),
    'TinyGPT ids float': (lambda: GPT(torch.zeros(1, 3)), TypeError, ['token_ids', 'float32']),
    'TinyGPT ids range': (lambda: GPT(torch.tensor([[0, 99]])), ValueError, ['token_ids', f'[0, {len(TOK)})', '99']),
    'TinyGPT ids 1-D': (lambda: GPT(torch.tensor([0, 1])), ValueError, ['token_ids', '(batch, num_tokens)', '(2,)']),
    'TinyGPT too long': (lambda: GPT(torch.zeros(1, 17, dtype=torch.long)), ValueError, ['context_length=16', '17']),
    'TinyGPT caches': (lambda: GPT(torch.zeros(1, 2, dtype=torch.long), caches=[]), ValueError, ['caches', 'got []']),
    'TransformerBlock heads': (lambda: TransformerBlock(10, 16, num_heads=4), ValueError, ['num_heads', '4']),
    'TransformerBlock dropout': (lambda: TransformerBlock(8, 16, 2, dropout=2.0), ValueError, ['dropout', '2.0']),
    'TransformerBlock x': (lambda: TransformerBlock(8, 16, 2)(torch.ones(1, 3, 4)), ValueError, ['d_in=8', '(1, 3, 4)']),
    'train_tiny_gpt steps': (lambda: train_tiny_gpt(GPT, TOK.encode('abc de' * 5), steps=-5), ValueError,
                             ['steps', '-5']),
    'train_tiny_gpt lr': (lambda: train_tiny_gpt(GPT, TOK.encode('abc de' * 5), lr=-1.0), ValueError, ['lr', '-1.0']),
    'train_tiny_gpt batch': (lambda: train_tiny_gpt(GPT, TOK.encode('abc de' * 5), batch_size=0), ValueError,
                             ['batch_size', '0']),
    'train_tiny_gpt block': (lambda: train_tiny_gpt(GPT, TOK.encode('abc de' * 5), block_size=2.5), ValueError,
                             ['block_size', '2.5']),
    'train_tiny_gpt data float': (lambda: train_tiny_gpt(GPT, torch.zeros(40)), TypeError, ['data', 'float32']),
    'train_tiny_gpt data range': (lambda: train_tiny_gpt(GPT, torch.full((40,), 50)), ValueError, ['data', '50']),
    'train_tiny_gpt data short': (lambda: train_tiny_gpt(GPT, TOK.encode('abc'), block_size=8), ValueError,
                                  ['data has 3 tokens', 'block_size=8']),
    'generate max_new_tokens': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), -3), ValueError,
                                ['max_new_tokens', '-3']),
    'generate temperature': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, temperature=-1e-4),
                             ValueError, ['temperature', '-0.0001']),
    'generate temperature str': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, temperature='0'),
                                 ValueError, ['temperature', "'0'"]),
    'generate use_cache': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, use_cache='no'), TypeError,
                           ['use_cache', "'no'"]),
    'generate prompt float': (lambda: generate(GPT, torch.zeros(1, 2), 2), TypeError, ['prompt_ids', 'float32']),
    'generate prompt 1-D': (lambda: generate(GPT, torch.zeros(2, dtype=torch.long), 2), ValueError,
                            ['prompt_ids', '(2,)']),
    'generate prompt range': (lambda: generate(GPT, torch.tensor([[0, 7]]), 2), ValueError, ['prompt_ids', '7']),
    'generate too long': (lambda: generate(GPT, torch.zeros(1, 10, dtype=torch.long), 7), ValueError,
                          ['17', 'context_length=16']),
    # --- the fixed-shape cache, sampling, stop ids, streaming (issue 20)
    'StaticKVCache capacity': (lambda: StaticKVCache(0), ValueError, ['capacity', 'got 0']),
    'StaticKVCache capacity float': (lambda: StaticKVCache(8.0), ValueError, ['capacity', '8.0']),
    'StaticKVCache pads float': (lambda: StaticKVCache(8, pads=torch.tensor([0.5])), TypeError, ['pads', 'float32']),
    'StaticKVCache pads range': (lambda: StaticKVCache(8, pads=torch.tensor([0, 8])), ValueError, ['pads', '8']),
    'StaticKVCache pads negative': (lambda: StaticKVCache(8, pads=torch.tensor([-1])), ValueError, ['pads', '-1']),
    'StaticKVCache pads 2-D': (lambda: StaticKVCache(8, pads=torch.zeros(1, 2, dtype=torch.long)), ValueError,
                               ['pads', '(1, 2)']),
    'StaticKVCache full': (lambda: _fill(StaticKVCache(4), 5), ValueError, ['capacity=4', '5']),
    'StaticKVCache batch': (lambda: _fill(StaticKVCache(8, pads=torch.tensor([0, 1])), 2), ValueError,
                            ['batch of 2', 'batch size 1']),
    'StaticKVCache beyond context': (lambda: _fill(StaticKVCache(32), 1), ValueError,
                                     ['capacity=32', 'context_length=16']),
    'StaticKVCache padding mask': (lambda: MultiHeadAttention(4, 4, 8)(X[:1], cache=StaticKVCache(8),
                                                                       key_padding_mask=torch.zeros(1, 5, dtype=bool)),
                                   ValueError, ['key_padding_mask', 'a list of prompts']),
    'StaticKVCache ring chunk': (lambda: _ring_chunk(), ValueError, ['one token at a time', 'got 2']),
    'StaticKVCache two modules': (lambda: _two_modules(StaticKVCache(8)), ValueError, ['another module']),
    'KVCache two modules': (lambda: _two_modules(KVCache()), ValueError, ['another module']),
    'TinyGPT new_caches pads': (lambda: GPT.new_caches(pads=torch.tensor([0])), ValueError, ['pads', 'capacity']),
    'generate top_k zero': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, temperature=1, top_k=0),
                            ValueError, ['top_k', 'got 0']),
    'generate top_k float': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, top_k=2.5), ValueError,
                             ['top_k', '2.5']),
    'generate top_p zero': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, top_p=0), ValueError,
                            ['top_p', '(0, 1]', 'got 0']),
    'generate top_p above 1': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, top_p=1.5), ValueError,
                               ['top_p', '1.5']),
    'generate stop_ids str': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, stop_ids='\n'), TypeError,
                              ['stop_ids', "'\\n'"]),
    'generate stop_ids range': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, stop_ids=[1, 99]),
                                ValueError, ['stop_ids', '99']),
    'generate stop_ids bool': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, stop_ids=True), TypeError,
                               ['stop_ids', 'True']),
    'generate pad_id negative': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, stop_ids=1, pad_id=-1),
                                 ValueError, ['pad_id', '-1']),
    'generate pad_id range': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, stop_ids=1, pad_id=6),
                              ValueError, ['pad_id', '6']),
    'generate compile without cache': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, use_cache=False,
                                                       compile=True), ValueError, ['compile=True', 'use_cache=False']),
    'generate pad_id without stop_ids': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, pad_id=0),
                                         ValueError, ['pad_id=0', 'stop_ids=None']),
    'generate compile str': (lambda: generate(GPT, torch.zeros(1, 2, dtype=torch.long), 2, compile='yes'), TypeError,
                             ['compile', "'yes'"]),
    'generate prompts empty list': (lambda: generate(GPT, [], 2), ValueError, ['prompt_ids', '[]']),
    'generate prompt empty row': (lambda: generate(GPT, [torch.tensor([1]), torch.tensor([], dtype=torch.long)], 2),
                                  ValueError, ['prompt_ids[1]', 'empty']),
    'generate prompt no tokens': (lambda: generate(GPT, torch.zeros(2, 0, dtype=torch.long), 2), ValueError,
                                  ['prompt_ids', '(2, 0)']),
    'generate prompt list 2-D': (lambda: generate(GPT, [torch.zeros(1, 2, dtype=torch.long)], 2), ValueError,
                                 ['prompt_ids[0]', '(1, 2)']),
    'generate prompt list range': (lambda: generate(GPT, [torch.tensor([1, 9])], 2), ValueError,
                                   ['prompt_ids[0]', '9']),
    'generate_stream temperature': (lambda: next(generate_stream(GPT, torch.zeros(1, 2, dtype=torch.long), 2,
                                                                 temperature=-1)), ValueError, ['temperature', '-1']),
    'sample_next temperature': (lambda: sample_next(torch.zeros(1, 3), temperature=-0.5), ValueError,
                                ['temperature', '-0.5']),
    'sample_next top_k': (lambda: sample_next(torch.zeros(1, 3), 1.0, top_k=-2), ValueError, ['top_k', '-2']),
    'sample_next top_p': (lambda: sample_next(torch.zeros(1, 3), 1.0, top_p='0.9'), ValueError, ['top_p', "'0.9'"]),
    'sample_next 1-D logits': (lambda: sample_next(torch.zeros(3), 1.0), ValueError,
                               ['logits', '(b, vocab_size)', 'torch.float32 (3,)']),
    'sample_next 3-D logits greedy': (lambda: sample_next(torch.zeros(2, 1, 3)), ValueError,
                                      ['logits', '(b, vocab_size)', '(2, 1, 3)']),
    'sample_next no vocabulary': (lambda: sample_next(torch.zeros(2, 0), 1.0), ValueError, ['logits', '(2, 0)']),
    'sample_next integer logits': (lambda: sample_next(torch.zeros(2, 3, dtype=torch.long)), ValueError,
                                   ['logits', 'floating', 'torch.int64']),
    'sample_next NaN logits': (lambda: sample_next(torch.tensor([[float('nan'), 0.0]]), 1.0), ValueError,
                               ['logits must be finite or -inf', 'NaN or +inf']),
    'sample_next +inf logits': (lambda: sample_next(torch.tensor([[float('inf'), 0.0]]), 1.0), ValueError,
                                ['logits must be finite or -inf']),
    'sample_next generator int': (lambda: sample_next(torch.zeros(1, 3), 1.0, generator=0), TypeError,
                                  ['generator', 'torch.Generator', 'int']),
    'sample_next generator elsewhere': (lambda: sample_next(torch.zeros(1, 3, device='meta'), 1.0,
                                                            generator=torch.Generator()), TypeError,
                                        ['generator', "logits' device, meta", 'cpu']),
    'TinyGPT int8 ids': (lambda: TinyGPT(10, 8, d_model=8, num_heads=2)(torch.zeros(1, 3, dtype=torch.int8)),
                         TypeError, ['token_ids', 'int64 or int32', 'torch.int8']),
    'TinyGPT uint16 ids': (lambda: TinyGPT(10, 8, d_model=8, num_heads=2)(torch.zeros(1, 3, dtype=torch.uint16)),
                           TypeError, ['token_ids', 'int64 or int32', 'torch.uint16']),
    'TinyGPT ids on another device': (lambda: TinyGPT(10, 8, d_model=8, num_heads=2)(
                                          torch.zeros(1, 3, dtype=torch.long, device='meta')),
                                      ValueError, ['token_ids', "model's device, cpu", 'meta']),
    'TinyGPT documents on another device': (lambda: TinyGPT(10, 8, d_model=8, num_heads=2)(
                                                torch.zeros(1, 3, dtype=torch.long, device='meta'),
                                                document_ids=torch.zeros(1, 3, dtype=torch.long)),
                                            ValueError, ['token_ids', "model's device, cpu", 'meta']),
    'generate attention_mask float': (lambda: generate(GPT, torch.zeros(1, 3, dtype=torch.long), 2,
                                                       attention_mask=torch.ones(1, 3)),
                                      ValueError, ['attention_mask', 'bool or integer', 'torch.float32 (1, 3)']),
    'generate attention_mask shape': (lambda: generate(GPT, torch.zeros(1, 3, dtype=torch.long), 2,
                                                       attention_mask=torch.ones(1, 2, dtype=torch.long)),
                                      ValueError, ['attention_mask', 'shaped like prompt_ids, (1, 3)', '(1, 2)']),
    'generate attention_mask with a list': (lambda: generate(GPT, [torch.zeros(3, dtype=torch.long)], 2,
                                                             attention_mask=torch.ones(1, 3, dtype=torch.long)),
                                            ValueError, ['attention_mask', 'a list of prompts needs none']),
    'generate attention_mask with a gap': (lambda: generate(GPT, torch.zeros(1, 3, dtype=torch.long), 2,
                                                            attention_mask=torch.tensor([[1, 0, 1]])),
                                           ValueError, ['one run of 1s in each row', '[[1, 0, 1]]']),
    'generate attention_mask of 2s': (lambda: generate(GPT, torch.zeros(1, 3, dtype=torch.long), 2,
                                                       attention_mask=torch.tensor([[0, 2, 2]])),
                                      ValueError, ['0s and 1s', '[[0, 2, 2]]']),
    'generate attention_mask no tokens': (lambda: generate(GPT, torch.zeros(1, 0, dtype=torch.long), 2,
                                                           attention_mask=torch.zeros(1, 0, dtype=torch.long)),
                                          ValueError, ['one run of 1s in each row']),
    'generate attention_mask empty row': (lambda: generate(GPT, torch.zeros(2, 3, dtype=torch.long), 2,
                                                           attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])),
                                          ValueError, ['one run of 1s in each row']),
    'generate int8 prompt': (lambda: generate(TinyGPT(10, 8, d_model=8, num_heads=2),
                                              torch.zeros(1, 3, dtype=torch.int8), 2),
                             TypeError, ['prompt_ids', 'int64 or int32', 'torch.int8']),
    'generate prompt on another device': (lambda: generate(TinyGPT(10, 8, d_model=8, num_heads=2),
                                                           torch.zeros(1, 3, dtype=torch.long, device='meta'), 2),
                                          ValueError, ['prompt_ids', "model's device, cpu", 'meta']),
    'TinyGPT document_ids shape': (lambda: GPT(torch.zeros(2, 5, dtype=torch.long), document_ids=torch.zeros(2, 6)),
                                   ValueError, ['document_ids', '(2, 5)', '(2, 6)']),
    'TinyGPT document_ids float': (lambda: GPT(torch.zeros(1, 3, dtype=torch.long), document_ids=torch.zeros(1, 3)),
                                   TypeError, ['document_ids', 'float32']),
    'TinyGPT document_ids with caches': (lambda: GPT(torch.zeros(1, 3, dtype=torch.long), GPT.new_caches(),
                                                     document_ids=torch.zeros(1, 3, dtype=torch.long)),
                                         ValueError, ['document_ids', 'cache']),
    # --- the explorer
    'package_attention causal': (lambda: package_attention(EXPLORER.inputs(), causal='False'), TypeError,
                                 ['causal', "'False'"]),
    'reference_module causal': (lambda: reference_module(EXPLORER, causal=1), TypeError, ['causal', 'got 1']),
    # --- robustness: inputs found wanting after the first release
    'explorer from_module not attention': (lambda: AttentionExplorer.from_module(
        nn.Linear(4, 4), ['a', 'b'], torch.eye(2, 4)), TypeError, ['W_query, W_key and W_value', 'Linear']),
    'explorer embeddings strings': (lambda: AttentionExplorer(['a', 'b'], [['x', 'y'], ['z', 'w']], torch.eye(2),
                                                              torch.eye(2), torch.eye(2)), TypeError,
                                    ['embeddings', 'list']),
    'explorer from_inputs keys': (lambda: AttentionExplorer.from_inputs({'tokens': ['a']}), KeyError,
                                  ['inputs lacks', 'embeddings', "['tokens']"]),
    'explorer from_inputs list': (lambda: AttentionExplorer.from_inputs([1]), TypeError, ['inputs', 'list']),
    'accuracy no sentences': (lambda: accuracy(CLF, IDS[:0], LABELS[:0], POS[:0]), ValueError,
                              ['at least one sentence', '(0, ']),
    'accuracy labels beyond classes': (lambda: accuracy(CLF, IDS, torch.full_like(LABELS, 5), POS), ValueError,
                                       ['labels', 'classes 0 to 1', 'from 5 to 5']),
    'train_classifier labels beyond classes': (lambda: train_classifier(CLF, IDS, LABELS - 1, POS, steps=1),
                                               ValueError, ['labels', 'classes 0 to 1', 'from -1']),
    'rope_rotate odd size': (lambda: R_rope_rotate(torch.randn(1, 3, 5), torch.ones(3, 5), torch.ones(3, 5)),
                             ValueError, ['even', 'x (1, 3, 5)']),
    'rope_rotate cos size': (lambda: R_rope_rotate(torch.randn(1, 3, 4), torch.ones(3, 6), torch.ones(3, 6)),
                             ValueError, ['cos (3, 6)']),
    'softmax_stable list': (lambda: softmax_stable([1.0, 2.0]), TypeError, ['x', 'floating-point', 'list']),
    'softmax_stable long': (lambda: softmax_stable(torch.tensor([1, 2])), TypeError, ['x', 'torch.int64']),
    'leaks_future t float': (lambda: leaks_future(CausalAttention(4, 4, 8), torch.randn(5, 4), 1.5), TypeError,
                             ['t', '1.5']),
    'leaks_future atol negative': (lambda: leaks_future(CausalAttention(4, 4, 8), torch.randn(5, 4), 1, atol=-1),
                                   ValueError, ['atol', '-1']),
    'leaks_future x ints': (lambda: leaks_future(CausalAttention(4, 4, 8), torch.ones(5, 4, dtype=torch.long), 1),
                            TypeError, ['x', 'int64']),
    'KVCache append shapes': (lambda: KVCache().append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5)),
                              ValueError, ['keys and values', '(b, heads', 'torch.Size([1, 2, 3, 5])']),
    'KVCache append 3-D': (lambda: KVCache().append(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)), ValueError,
                           ['keys and values', 'torch.Size([2, 3, 4])']),
    'KVCache append other heads': (lambda: _append_twice(), ValueError, ['holds keys of shape (1, 2, 1, 4)',
                                                                        '(1, 3, 1, 4)']),
    'MHA cache list': (lambda: MultiHeadAttention(4, 4, 8)(torch.randn(1, 2, 4), cache=[]), TypeError,
                       ['cache', 'KVCache', 'list []']),
    'KVCacheProtocol kept by no list': (lambda: MultiHeadAttention(4, 4, 8)(torch.randn(1, 2, 4), cache=[1]), TypeError,
                                        ['selfattn_nbdev.KVCacheProtocol', 'list [1], without check_new_tokens, positions, update']),
    'CacheProtocol instantiated': (lambda: CacheProtocol(), TypeError, ['Protocols cannot be instantiated']),
    'TinyGPT cache list': (lambda: GPT(torch.zeros(1, 2, dtype=torch.long), [[]]), TypeError, ['cache', 'list']),
    'TinyGPT caches one cache': (lambda: GPT(torch.zeros(1, 2, dtype=torch.long), KVCache()), ValueError,
                                 ['caches must be a list of 1', 'KVCache(0 tokens)']),
    'TinyGPT d_model zero': (lambda: TinyGPT(10, context_length=8, d_model=0, num_heads=1), ValueError,
                             ['d_model', '0']),
    'TinyGPT context_length float': (lambda: TinyGPT(10, context_length=8.5, d_model=8, num_heads=1), ValueError,
                                     ['context_length', '8.5']),
    'to_torch_multihead not MHA': (lambda: to_torch_multihead(nn.Linear(4, 4)), TypeError,
                                   ['m', 'MultiHeadAttention', 'Linear']),
    'package_attention no embeddings': (lambda: package_attention({k: v for k, v in EXPLORER.inputs().items()
                                                                   if k != 'embeddings'}), KeyError,
                                        ['inputs lacks', "['embeddings']"]),
    'to_torch_multihead CausalAttention': (lambda: to_torch_multihead(CausalAttention(4, 4, 8)), TypeError,
                                           ['m must be a MultiHeadAttention', 'CausalAttention']),
    'TinyGPT d_model float': (lambda: TinyGPT(10, context_length=8, d_model=16.0, num_heads=1), ValueError,
                              ['d_model', '16.0']),
    'TinyGPT context_length negative': (lambda: TinyGPT(10, context_length=-1, d_model=8, num_heads=1), ValueError,
                                        ['context_length', '-1']),
    'MHA set causal': (lambda: setattr(MultiHeadAttention(4, 4, 8), 'causal', False), AttributeError,
                       ['causal is fixed', 'causal=False']),
    'MHA set window': (lambda: setattr(MultiHeadAttention(4, 4, 8), 'window', 3), AttributeError,
                       ['window is fixed', 'window=3']),
    'StaticKVCache after cast': (lambda: _static_after_cast(), ValueError,
                                 ['torch.float32', 'torch.float64', 'cache.reset()']),
    # --- from the second user audit: raw errors or silent acceptance before
    'block_mask no tokens': (lambda: M.block_mask(M.causal, 0), ValueError, ['num_tokens', 'got 0']),
    'dense_mask int predicate': (lambda: M.dense_mask(lambda b, h, q, k: (q >= k).int(), 4), TypeError,
                                 ['mask_mod must return bools', 'torch.int32']),
    'Unpadded.pack wrong rows': (lambda: _unpadded().pack(torch.zeros(3, 4)), ValueError,
                                 ["Unpadded.pack's t", '(2, 4, ...)', '(3, 4)']),
    'Unpadded.unpack wrong length': (lambda: _unpadded().unpack(torch.zeros(1, 4, 3)), ValueError,
                                     ["Unpadded.unpack's t", '(1, 5, ...)', '(1, 4, 3)']),
    'varlen_runs neither': (lambda: kernels.varlen_runs(None, None), ValueError,
                            ['key_padding_mask or document_ids', 'neither']),
    'flex_attend None mask': (lambda: kernels.flex_attend(*[torch.zeros(1, 1, 4, 2)] * 3, None, compiled=False),
                              TypeError, ['flex_attend', 'NoneType']),
    'rope_frequencies llama3 without factor': (lambda: RC.rope_frequencies(8, scaling={'rope_type': 'llama3'}),
                                               ValueError, ['factor', 'missing']),
    'rope_frequencies linear without factor': (lambda: RC.rope_frequencies(8, scaling={'type': 'linear'}),
                                               ValueError, ['linear', 'factor', 'None']),
    'layer_windows no layers': (lambda: RC.layer_windows(0, 4), ValueError, ['num_layers', 'got 0']),
    'split_kv_attention dtypes': (lambda: R.split_kv_attention(torch.zeros(1, 2, 1, 4, dtype=torch.float64),
                                                               torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4)),
                                  TypeError, ['one floating dtype', 'torch.float64 on cpu', 'torch.float32 on cpu']),
    'split_kv_attention allowed float': (lambda: R.split_kv_attention(*[torch.zeros(1, 2, 6, 4)] * 3, 2,
                                                                      torch.ones(1, 2, 6, 6)),
                                         ValueError, ['allowed', 'bool', '(1, 2, 6, 6)', 'torch.float32']),
    'split_kv_attention allowed shape': (lambda: R.split_kv_attention(*[torch.zeros(1, 2, 6, 4)] * 3, 2,
                                                                      torch.ones(7, dtype=torch.bool)),
                                         ValueError, ['allowed', '(1, 2, 6, 6)', '(7,)']),
    'dense_mask more rows than the padding': (lambda: M.dense_mask(M.key_padding(torch.zeros(2, 8, dtype=torch.bool)),
                                                                   8, batch=3),
                                              IndexError, ['mask_mod', '3 rows', 'batch, num_tokens or num_keys']),
    'huge_page_buffer zero bytes': (lambda: __import__('selfattn_nbdev.decoding').decoding.huge_page_buffer(0),
                                    ValueError, ['nbytes', 'got 0']),
    'weights_in_huge_pages min_bytes': (lambda: __import__('selfattn_nbdev.decoding').decoding.weights_in_huge_pages(
                                            GPT, min_bytes=-1), ValueError, ['min_bytes', '-1']),
    'block_mask more keys than the documents': (lambda: M.block_mask(M.documents(torch.zeros(1, 8, dtype=torch.long)),
                                                                     8, 12, block_size=4),
                                                IndexError, ['mask_mod', '12 keys', 'num_keys']),
}


def _unpadded():
    "Two rows of 4 tokens, 3 and 2 of them real."
    return kernels.unpad(torch.ones(2, 4, dtype=torch.long), torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1]], dtype=torch.bool))


@pytest.mark.parametrize('case', list(CASES))
def test_bad_input_gets_a_clear_error(case):
    fn, error, words = CASES[case]
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    missing = [w for w in words if w not in message]
    assert not missing, f'{case}: the message does not say {missing}: {message!r}'


def test_the_matrix_is_large_and_covers_the_public_names():
    import selfattn_nbdev, selfattn_nbdev.generation as gen, selfattn_nbdev.training as tr
    assert len(CASES) >= 150, len(CASES)
    names = set(selfattn_nbdev.__all__) | {'CharTokenizer', 'TinyGPT', 'TransformerBlock', 'generate', 'train_tiny_gpt',
                                           'StaticKVCache', 'generate_stream', 'sample_next',
                                           'make_bank_sentences', 'BankSenseClassifier', 'train_classifier', 'accuracy'}
    covered = {n for n in names if any(n in c or n.replace('_', ' ') in c for c in CASES)}
    aliases = {'MultiHeadAttention': 'MHA', 'MultiHeadAttentionWrapper': 'Wrapper', 'to_torch_multihead': 'to_torch',
               'BankSenseClassifier': 'classifier', 'make_bank_sentences': 'make_bank', 'AttentionExplorer': None,
               'KVCache': None}
    covered |= {n for n, a in aliases.items() if a and any(c.startswith(a) for c in CASES)}
    assert gen.__all__ and tr.__all__
    uncovered = sorted(names - covered - {'AttentionExplorer', 'KVCache'})
    assert not uncovered, f'public names without a bad-input case: {uncovered}'


# --- what must be answered, not refused

def test_counts_of_zero_are_answers():
    prompt = torch.zeros(1, 2, dtype=torch.long)
    assert torch.equal(generate(GPT, prompt, 0), prompt)
    assert train_tiny_gpt(GPT, TOK.encode('abc de' * 5), steps=0, block_size=4) == []
    assert train_classifier(CLF, IDS, LABELS, POS, steps=0) == []


def test_empty_and_hidden_inputs_have_documented_answers():
    assert TOK.encode('').dtype == torch.long and TOK.encode('').shape == (0,)   # ids, even of nothing
    assert softmax_stable(torch.ones(2, 0)).shape == (2, 0)                      # no scores: no weights
    all_hidden = torch.full((2, 3), -math.inf)
    assert (online_softmax(all_hidden) == 0).all() and (softmax_stable(all_hidden) == 0).all()


def test_empty_inputs_give_empty_results_on_the_single_head_modules():
    for module in [SelfAttention(4, 3), SelfAttentionV1(4, 3), SelfAttentionV2(4, 3), CausalAttention(4, 3, 8)]:
        assert module(torch.ones(0, 4)).shape == (0, 3)
        assert module(torch.ones(0, 5, 4)).shape == (0, 5, 3)


@pytest.mark.parametrize('options', [{}, {'num_kv_heads': 1, 'window': 3, 'rope': True}, {'causal': False}],
                         ids=['plain', 'gqa-window-rope', 'bidirectional'])
def test_empty_inputs_give_empty_results_on_multihead_attention(options):
    m = MultiHeadAttention(8, 8, 16, num_heads=2, **options)
    for shape in [(2, 0, 8), (0, 5, 8), (0, 8)]:
        x = torch.randn(shape)
        fused, (explicit, weights) = m(x), m(x, return_attn_weights=True)
        assert fused.shape == explicit.shape == shape and weights.numel() == 0
        if len(shape) == 3:
            padded = m(x, key_padding_mask=torch.zeros(shape[:2], dtype=torch.bool))
            assert padded.shape == shape


def test_leaks_future_runs_the_module_in_eval_mode_and_restores_its_mode():
    module = CausalAttention(4, 3, 8, dropout=0.5).train()
    assert not leaks_future(module, X, 2)   # dropout alone no longer looks like a leak
    assert module.training


def test_decode_takes_a_list_or_a_tensor():
    assert TOK.decode([0, 1]) == TOK.decode(torch.tensor([0, 1])) == ' a'


def test_accuracy_is_right_with_labels_of_the_right_shape():
    with torch.no_grad():
        predicted = CLF(IDS, POS).argmax(-1)
    assert accuracy(CLF, IDS, predicted, POS) == 1.0


def test_stop_ids_may_be_a_tensor_or_numpy_ints_and_anything_else_is_named():
    """A tokenizer hands ids as tensors, numpy ints or arrays: they stop rows as Python ints do; floats, bools, 2-D are
    refused ([] is no stop id at all: tests/test_generation.py)."""
    np = pytest.importorskip('numpy')
    from selfattn_nbdev import TinyGPT, generate
    torch.manual_seed(0)
    model = TinyGPT(37, 64, d_model=16, num_heads=2, num_layers=1).eval()
    prompt = torch.randint(0, 37, (2, 4))
    expected = generate(model, prompt, 10, stop_ids=[3, 5])
    for stops in (torch.tensor([3, 5]), [np.int64(3), np.int64(5)], (3, np.int16(5)), np.array([3, 5])):
        assert torch.equal(generate(model, prompt, 10, stop_ids=stops), expected)
    for one in (torch.tensor(3), np.int32(3), np.array(3)):
        assert torch.equal(generate(model, prompt, 10, stop_ids=one), generate(model, prompt, 10, stop_ids=3))
    for bad in (torch.tensor([3.0]), [True], 2.5, torch.ones(2, 2, dtype=torch.long), [torch.tensor(3)],
                np.array([3.0]), np.ones((2, 2), dtype=np.int64)):
        with pytest.raises(TypeError, match='stop_ids must be a token id or a list of them'):
            generate(model, prompt, 3, stop_ids=bad)


def test_step_times_must_be_a_list_and_a_cast_model_is_told_to_reset_its_cache():
    from selfattn_nbdev import KVCache, TinyGPT, generate
    model = TinyGPT(37, 64, d_model=16, num_heads=2, num_layers=1).eval()
    prompt = torch.randint(0, 37, (1, 4))
    with pytest.raises(TypeError, match=r"step_times must be a list or None; got \(\)"):
        generate(model, prompt, 3, step_times=())
    caches = [KVCache()]
    with torch.no_grad():
        model(prompt, caches)
        model.double()
        with pytest.raises(ValueError, match='reset after a cast'): model(prompt[:, :1], caches)


def test_generate_stream_checks_its_arguments_when_called_not_at_the_first_token():
    "A bad prompt is refused where the stream is made, so the traceback points at the caller's line."
    from selfattn_nbdev import TinyGPT, generate_stream
    model = TinyGPT(37, 64, d_model=16, num_heads=2, num_layers=1)
    with pytest.raises(ValueError, match=r'prompt_ids must be in \[0, 37\)'):
        generate_stream(model, torch.tensor([[99]]), 5)               # no next() needed
    with pytest.raises(ValueError, match='max_new_tokens'):
        generate_stream(model, torch.tensor([[1]]), -1)
    stream = generate_stream(model, torch.tensor([[1, 2]]), 3)
    assert model.training                                              # nothing runs until the first next()
    tokens = list(stream)
    assert len(tokens) == 3 and model.training and not tokens[0].requires_grad
    assert list(generate_stream(model, torch.tensor([[1, 2]]), 0)) == []


def test_generate_reads_the_prompt_once_wherever_it_is(monkeypatch):
    """On a CPU every id is read; on a GPU only the prompt (tests/test_cuda.py runs it there). Here: generate asks
    check_token_ids to read the prompt whatever its device, and the checks it asks for in forward do not."""
    import selfattn_nbdev.core as core, selfattn_nbdev.decoding as decoding, selfattn_nbdev.generation as gen_module
    asked, real = [], core.check_token_ids
    def spy(token_ids, vocab_size, name='token_ids', dims=(1, 2), device=None, always=False):
        asked.append((always, name))
        return real(token_ids, vocab_size, name, dims, device, always)
    for module in (decoding, gen_module): monkeypatch.setattr(module, 'check_token_ids', spy)
    model = TinyGPT(20, 16, d_model=16, num_heads=2).eval()
    generate(model, torch.tensor([[1, 2]]), 2)
    generate(model, [torch.tensor([1, 2]), torch.tensor([3])], 2)
    assert [always for always, name in asked if name.startswith('prompt_ids')] == [True, True, True]
    assert not any(always for always, name in asked if name == 'token_ids')


def test_a_model_asked_for_weights_or_given_transformers_names_says_what_to_do():
    """A model's forward returns logits: return_attn_weights=True there names attention_weights (before: 'unsupported
    operand type(s) for +: Tensor and tuple' from inside a block), and transformers' output_attentions, position_ids
    and labels each say what the package takes instead; return_attn_weights=False asks for nothing."""
    import selfattn_nbdev  # noqa: F401  (every page's parts)
    from selfattn_nbdev.generation import TinyGPT
    from selfattn_nbdev.models import Llama, attention_weights
    torch.manual_seed(0)
    for model in (TinyGPT(50, 16, 16, 2, 2), Llama(50, 16, 16, 2, 1, 1, 32)):
        ids = torch.randint(0, 50, (1, 8))
        with pytest.raises(TypeError, match=r'returns logits; for the weights of its blocks, `with attention_weights'):
            model(ids, return_attn_weights=True)
        assert torch.equal(model(ids, return_attn_weights=False), model(ids))
        for name, words in [('output_attentions', 'attention_weights'), ('position_ids', 'document_ids'),
                            ('labels', 'F.cross_entropy')]:
            with pytest.raises(TypeError, match=f'unexpected keyword arguments: {name}; for {name}, give .*{words}'):
                model(ids, **{name: ids})
        with attention_weights(model) as weights: model(ids)
        assert len(weights) == len(model.blocks) and weights[0].shape[-2:] == (8, 8)
