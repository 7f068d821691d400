"""llama.cpp's side of bench/cpu_decode.py, run by a Python that has `llama-cpp-python` and `gguf` (an optional
development extra: `pip install llama-cpp-python==0.3.36 gguf`, built from source in about 8 minutes on 2 cores with
`CMAKE_ARGS="-DGGML_NATIVE=ON"`). Two commands, each printing one JSON line:

    python bench/llamacpp_child.py write SHAPE PATH     # an F32 GGUF of SHAPE ('gpt2', 'llama') with random weights
    python bench/llamacpp_child.py time PATH THREADS PROMPT NEW   # greedy decoding at batch 1: tokens per second

The weights are random (the time of a token does not depend on them); the shapes are bench/cpu_decode.py's SHAPES.
"""
import json, sys, time

import numpy as np

SHAPES = {'gpt2': dict(vocab=50257, d=768, layers=12, heads=12, kv_heads=12, hidden=3072, context=1024),
          'llama': dict(vocab=32000, d=1024, layers=12, heads=16, kv_heads=4, hidden=2816, context=2048)}


def write(shape: str, path: str) -> dict:
    import gguf
    s, rng = SHAPES[shape], np.random.default_rng(0)
    normal = lambda *n: (0.02 * rng.standard_normal(n)).astype(np.float32)
    ones, zeros = (lambda n: np.ones(n, np.float32)), (lambda n: np.zeros(n, np.float32))
    D, F, V, hd = s['d'], s['hidden'], s['vocab'], s['d'] // s['heads']
    w = gguf.GGUFWriter(path, shape)
    w.add_context_length(s['context']); w.add_embedding_length(D); w.add_block_count(s['layers'])
    w.add_feed_forward_length(F); w.add_head_count(s['heads']); w.add_file_type(0)
    w.add_tokenizer_model('llama')  # a vocabulary of placeholder pieces: ids are all the timing needs
    w.add_token_list([b'<unk>', b'<s>', b'</s>'] + [f'p{i}'.encode() for i in range(3, V)])
    w.add_token_scores([0.0] * V); w.add_token_types([2, 3, 3] + [1] * (V - 3))
    w.add_bos_token_id(1); w.add_eos_token_id(2)
    if shape == 'gpt2':
        w.add_layer_norm_eps(1e-5)
        w.add_tensor('token_embd.weight', normal(V, D)); w.add_tensor('position_embd.weight', normal(s['context'], D))
        w.add_tensor('output_norm.weight', ones(D)); w.add_tensor('output_norm.bias', zeros(D))
        for i in range(s['layers']):
            for name, t in [('attn_norm.weight', ones(D)), ('attn_norm.bias', zeros(D)),
                            ('attn_qkv.weight', normal(3 * D, D)), ('attn_qkv.bias', zeros(3 * D)),
                            ('attn_output.weight', normal(D, D)), ('attn_output.bias', zeros(D)),
                            ('ffn_norm.weight', ones(D)), ('ffn_norm.bias', zeros(D)),
                            ('ffn_up.weight', normal(F, D)), ('ffn_up.bias', zeros(F)),
                            ('ffn_down.weight', normal(D, F)), ('ffn_down.bias', zeros(D))]:
                w.add_tensor(f'blk.{i}.{name}', t)
    else:
        KV = s['kv_heads']
        w.add_head_count_kv(KV); w.add_rope_dimension_count(hd); w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(10000.0)
        w.add_tensor('token_embd.weight', normal(V, D)); w.add_tensor('output_norm.weight', ones(D))
        w.add_tensor('output.weight', normal(V, D))
        for i in range(s['layers']):
            for name, t in [('attn_norm.weight', ones(D)), ('attn_q.weight', normal(D, D)),
                            ('attn_k.weight', normal(KV * hd, D)), ('attn_v.weight', normal(KV * hd, D)),
                            ('attn_output.weight', normal(D, D)), ('ffn_norm.weight', ones(D)),
                            ('ffn_gate.weight', normal(F, D)), ('ffn_up.weight', normal(F, D)),
                            ('ffn_down.weight', normal(D, F))]:
                w.add_tensor(f'blk.{i}.{name}', t)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dict(path=path)


def timed(path: str, threads: int, prompt: int, new: int) -> dict:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=prompt + new,
                n_batch=max(prompt, 8), verbose=False)
    vocab = llm.n_vocab()
    ids = [int(i) for i in np.random.default_rng(1).integers(3, vocab, prompt)]
    logits = lambda: np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))  # the last token's
    llm.reset(); llm.eval(ids); token = int(np.argmax(logits()))      # prefill, not timed
    start = time.perf_counter()
    for _ in range(new):
        llm.eval([token]); token = int(np.argmax(logits()))
    return dict(tok_s=new / (time.perf_counter() - start))


if __name__ == '__main__':
    command, *args = sys.argv[1:]
    out = write(*args) if command == 'write' else timed(args[0], *map(int, args[1:]))
    print(json.dumps(out))
