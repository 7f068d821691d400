"""Peak memory of loading a checkpoint of more than 500 MB from disk.

    python bench/load_memory.py [--small] [--out bench/load_memory.json]

Writes a random Llama-shaped checkpoint in float32 (32,000 tokens, width 1,024, 8 blocks: 159 M parameters, 636 MB),
as `save_pretrained` lays it out: config.json, two safetensors shards and their index. Then, each in a fresh Python
process, loads it three ways and records the process's peak resident memory above what its imports took (torch's
`_dynamo` included, which initialising weights on the meta device imports), once the
model is loaded and again after one forward pass of 16 tokens (which touches every weight):

- `from_hf(folder)`: the model built on meta, the memory-mapped tensors assigned;
- a state dict read whole (`read_checkpoint`, then every tensor cloned) and copied into a model built the usual way
  (`llama_from_hf`), which is what loading took before `from_hf`: two copies at the peak;
- transformers' `AutoModelForCausalLM.from_pretrained(folder)`, for reference.

The peak is Linux's VmHWM, reset after the imports (/proc/self/clear_refs); at the end the script also records how
much of the memory is anonymous (copies the process owns) and how much is file-backed (the mapped checkpoint's pages,
which the page cache holds once for every process that maps them).

The figures are the peaks over the size of the files: 1.0 is one copy of the weights.
"""
import argparse, datetime, json, os, shlex, subprocess, sys, tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.benchmark import cpu_model  # noqa: E402

CONFIG = dict(model_type='llama', architectures=['LlamaForCausalLM'], vocab_size=32000, hidden_size=1024,
              intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
              max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act='silu', tie_word_embeddings=False,
              rope_parameters=dict(rope_type='default', rope_theta=10000.0), torch_dtype='float32')

CHILD = r'''
import re, sys, time, json
import torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
import torch._dynamo   # initialising weights on meta imports it (2 s, 60 MB, once): not the weights' memory
from selfattn_nbdev.pretrained import from_hf, llama_from_hf, read_checkpoint
if {how!r} == 'transformers':
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging; logging.set_verbosity_error(); logging.disable_progress_bar()
def status(field):  # bytes, from /proc/self/status (Linux)
    return int(re.search(field + r':\s+(\d+) kB', open('/proc/self/status').read()).group(1)) * 1024
open('/proc/self/clear_refs', 'w').write('5')   # the peak (VmHWM) starts again from here
base = status('VmRSS')
peak = lambda: status('VmHWM')
start = time.perf_counter()
if {how!r} == 'from_hf': model = from_hf({folder!r})
elif {how!r} == 'copied':
    tensors, config = read_checkpoint({folder!r})
    state = {{k: v.clone() for k, v in tensors.items()}}; del tensors               # read whole, as load_file does
    model = llama_from_hf(state, config); del state
else: model = AutoModelForCausalLM.from_pretrained({folder!r}).eval()
seconds = time.perf_counter() - start
loaded = peak()
with torch.no_grad(): model(torch.arange(16)[None])
print(json.dumps(dict(seconds=seconds, loaded=loaded - base, after_forward=peak() - base, imports=base,
                      anonymous=status('RssAnon'), file_backed=status('RssFile'))))
'''


def write_checkpoint(folder: Path, config: dict) -> int:
    "A random checkpoint in transformers' layout, two shards and an index; its size in bytes."
    from safetensors.torch import save_file
    torch.manual_seed(0)
    d, heads, kv_heads = config['hidden_size'], config['num_attention_heads'], config['num_key_value_heads']
    kv = kv_heads * d // heads
    h, v, L = config['intermediate_size'], config['vocab_size'], config['num_hidden_layers']
    shapes = {'model.embed_tokens.weight': (v, d), 'model.norm.weight': (d,), 'lm_head.weight': (v, d)}
    for i in range(L):
        p = f'model.layers.{i}.'
        shapes |= {p + 'input_layernorm.weight': (d,), p + 'post_attention_layernorm.weight': (d,),
                   p + 'self_attn.q_proj.weight': (d, d), p + 'self_attn.k_proj.weight': (kv, d),
                   p + 'self_attn.v_proj.weight': (kv, d), p + 'self_attn.o_proj.weight': (d, d),
                   p + 'mlp.gate_proj.weight': (h, d), p + 'mlp.up_proj.weight': (h, d),
                   p + 'mlp.down_proj.weight': (d, h)}
    names = list(shapes)
    halves = [names[:len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for n, part in enumerate(halves, 1):
        file = f'model-{n:05d}-of-00002.safetensors'
        tensors = {k: (torch.ones(shapes[k]) if k.endswith('norm.weight') else 0.02 * torch.randn(shapes[k]))
                   for k in part}
        save_file(tensors, folder/file, metadata={'format': 'pt'})
        weight_map |= {k: file for k in part}
        del tensors
    (folder/'model.safetensors.index.json').write_text(json.dumps({'metadata': {}, 'weight_map': weight_map}))
    (folder/'config.json').write_text(json.dumps(config))
    return sum(f.stat().st_size for f in folder.glob('*.safetensors'))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--small', action='store_true', help='a 4 MB checkpoint: checks the script, measures nothing')
    ap.add_argument('--out', default=None)
    a = ap.parse_args()
    config = dict(CONFIG)
    if a.small: config |= dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)
    out = Path(a.out) if a.out else (None if a.small else ROOT/'bench'/'load_memory.json')
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        size = write_checkpoint(folder, config)
        print(f'checkpoint: {size / 2**20:,.0f} MiB in 2 shards', flush=True)
        runs = {}
        for how in ('from_hf', 'copied', 'transformers'):
            code = CHILD.format(root=str(ROOT), how=how, folder=str(folder))
            env = dict(os.environ, OMP_NUM_THREADS='1')
            res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
            if res.returncode: sys.exit(f'{how} failed:\n{res.stderr[-3000:]}')
            r = json.loads(res.stdout.strip().splitlines()[-1])
            r |= dict(loaded_over_size=r['loaded'] / size, after_forward_over_size=r['after_forward'] / size)
            runs[how] = r
            print(f"{how:<13} load {r['seconds']:6.2f} s  peak above imports: loaded {r['loaded'] / 2**20:7,.0f} "
                  f"MiB ({r['loaded_over_size']:.2f}x the files), after a forward pass "
                  f"{r['after_forward'] / 2**20:7,.0f} MiB ({r['after_forward_over_size']:.2f}x); at the end anonymous "
                  f"{r['anonymous'] / 2**20:,.0f} MiB, file-backed {r['file_backed'] / 2**20:,.0f} MiB", flush=True)
    cpu = cpu_model()
    result = dict(machine=dict(cpu_model=cpu, cpu_count=os.cpu_count()), torch=torch.__version__, threads=1,
                  date=datetime.date.today().isoformat(), command=shlex.join(['python', 'bench/load_memory.py'] + sys.argv[1:]),
                  load_average_at_start=os.getloadavg()[0], config=config, checkpoint_bytes=size,
                  parameters=size // 4, runs=runs)
    if out:
        out.write_text(json.dumps(result, indent=1) + '\n')
        print(f'wrote {out}')


if __name__ == '__main__':
    main()
