"""Package-level checks that do not belong in the story: what a user gets from `pip install`."""
import importlib, re, subprocess, sys, zipfile
from configparser import ConfigParser
from pathlib import Path

import pytest
import torch

import selfattn_nbdev
from selfattn_nbdev import SelfAttention

ROOT = Path(__file__).resolve().parents[1]


def settings():
    cfg = ConfigParser(delimiters=['='])
    cfg.read(ROOT/'settings.ini')
    return cfg['DEFAULT']


def test_version_matches_settings():
    assert selfattn_nbdev.__version__ == settings()['version']


def test_public_names_exported():
    for name in selfattn_nbdev.__all__:
        assert hasattr(selfattn_nbdev, name), name
    assert 'SelfAttention' in selfattn_nbdev.__all__


def test_runtime_dependency_is_torch_only():
    assert settings()['requirements'].split() == ['torch>=2.1']


def test_the_hf_extra_is_safetensors_alone():
    "`pip install selfattn_nbdev[hf]` adds the safetensors library (to write checkpoints); reading needs torch."
    assert settings()['hf_requirements'].split() == ['safetensors>=0.4']
    assert "'hf': hf_requirements" in (ROOT / 'setup.py').read_text()


def test_the_pages_extra_is_what_the_pages_import_beside_the_package():
    """`pip install ".[pages]"` gives a reader what the pages' code imports that is neither torch, the standard library
    nor the package: matplotlib for the pictures, fastcore for the checks, transformers for the models compared. Every
    such import of a page is in it, or comes with it (numpy, huggingface_hub, safetensors, tokenizers), or with Jupyter
    (IPython)."""
    import ast, json
    extra = {re.split(r'[<>=!]', r)[0] for r in settings()['pages_requirements'].split()}
    assert extra == {'matplotlib', 'fastcore', 'transformers'} and "'pages': pages_requirements" in (ROOT / 'setup.py').read_text()
    story = [p for p in sorted((ROOT / 'nbs').glob('*.ipynb')) if re.match(r'(index|\d\d_)', p.name)]
    imported = set()
    for page in story:
        for cell in json.loads(page.read_text())['cells']:
            code = ''.join(cell['source'])
            if cell['cell_type'] != 'code' or code.lstrip().startswith(('%', '!')): continue
            try: tree = ast.parse('\n'.join(l for l in code.splitlines() if not l.startswith(('%', '!'))))
            except SyntaxError: continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Import): imported |= {a.name.split('.')[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0: imported.add(node.module.split('.')[0])
    outside = imported - {'torch', 'selfattn_nbdev', *sys.stdlib_module_names}
    assert outside - extra <= {'numpy', 'huggingface_hub', 'safetensors', 'tokenizers', 'IPython'}, outside - extra


def test_modules_import_nothing_but_torch_and_stdlib():
    """Every import statement of every module (in functions too) names torch, the standard library or the package.
    One exception: inside a function of hf.py, transformers, the library that `register` plugs the package into
    (tests/test_hf_route.py checks that importing hf.py does not import it)."""
    import ast
    allowed = {'torch', 'selfattn_nbdev', *sys.stdlib_module_names}
    found = []
    for path in sorted((ROOT / 'selfattn_nbdev').glob('*.py')):
        tree = ast.parse(path.read_text())
        in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import): names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level: names = [node.module]
            else: continue
            plugs_in = path.name == 'hf.py' and id(node) in in_functions
            found += [f'{path.name}:{node.lineno} {n}' for n in names
                      if n.split('.')[0] not in allowed and not (plugs_in and n.split('.')[0] == 'transformers')]
    assert found == [], f'imports beyond torch: {found}'
    assert sum(1 for _ in (ROOT / 'selfattn_nbdev').glob('*.py')) > 10   # the modules were read


def test_generate_shows_the_options_of_generate_stream():
    "generate passes **kwargs on; its signature (help, editors) lists generate_stream's options by name."
    import inspect
    from selfattn_nbdev.decoding import generate, generate_stream
    params = inspect.signature(generate).parameters
    assert 'kwargs' not in params and 'step_times' in params
    for name in ('temperature', 'top_k', 'top_p', 'stop_ids', 'pad_id', 'compile', 'static', 'use_cache'):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == inspect.signature(generate_stream).parameters[name].default, name


def test_module_index_covers_exports():
    from selfattn_nbdev._modidx import d
    syms = d['syms']
    assert 'selfattn_nbdev.core.SelfAttention' in syms['selfattn_nbdev.core']


def test_self_attention_shapes_and_dtype():
    torch.manual_seed(0)
    layer = SelfAttention(4, 3)
    assert layer(torch.rand(5, 4)).shape == (5, 3)
    assert layer(torch.rand(2, 5, 4)).shape == (2, 5, 3)
    layer64 = layer.double()
    assert layer64(torch.rand(5, 4, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.slow
def test_wheel_contains_modules_and_modidx(tmp_path):
    "Build a wheel from the working tree and look inside."
    res = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', str(tmp_path), str(ROOT)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    wheel, = tmp_path.glob('selfattn_nbdev-*.whl')
    names = zipfile.ZipFile(wheel).namelist()
    for mod in ['__init__.py', '_modidx.py', 'core.py']:
        assert f'selfattn_nbdev/{mod}' in names
    meta = next(n for n in names if n.endswith('METADATA'))
    requires = [l for l in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if l.startswith('Requires-Dist:') and 'extra ==' not in l]
    assert requires == ['Requires-Dist: torch>=2.1'], requires
    description = zipfile.ZipFile(wheel).read(meta).decode()
    assert '](index_files/' not in description and '](https://raw.githubusercontent.com/' in description  # pictures work on PyPI


def test_modules_import_each_other_relatively():
    "nbdev turns `from selfattn_nbdev.x import ...` into `from .x import ...`, but misses a parenthesised import whose last line is shorter than its first `from ...`: none may remain at module level."
    absolute = [f"{p.name}:{i}" for p in sorted((ROOT / 'selfattn_nbdev').glob('*.py'))
                for i, line in enumerate(p.read_text().splitlines(), 1) if line.startswith('from selfattn_nbdev')]
    assert absolute == []


def test_rope_has_one_home_and_its_old_paths_still_import():
    "RoPE, its rescalings and its cos/sin live in rope; gqa_window_rope, llama_attention and models still give them by name."
    from selfattn_nbdev import gqa_window_rope, llama_attention, models, rope
    names = ['rope_angles', 'rope_rotate', 'apply_rope', 'check_rope', 'rope_frequencies', 'yarn_frequencies',
             'yarn_mscale', 'check_rope_scaling', 'check_yarn', 'RESCALINGS', '_rope_cos_sin']
    for name in names:
        value = getattr(rope, name)
        assert getattr(value, '__module__', rope.__name__) == rope.__name__, name
    for name in ['rope_frequencies', 'yarn_frequencies', 'yarn_mscale', 'check_rope_scaling', 'check_yarn', 'RESCALINGS',
                 'LLAMA3_KEYS', 'YARN_DEFAULTS']:
        assert getattr(llama_attention, name) is getattr(rope, name), name
    for name in ['check_yarn', 'yarn_frequencies', 'yarn_mscale', 'rope_frequencies']:
        assert getattr(models, name) is getattr(rope, name), name
    for name in names + ['LLAMA3_KEYS', 'YARN_DEFAULTS', '_rows_at', '_shared_table']:  # where they lived before
        assert getattr(gqa_window_rope, name) is getattr(rope, name), name
    public = [n for n in names if not n.startswith('_')]
    assert set(public) <= set(rope.__all__) and set(public) <= set(gqa_window_rope.__all__)  # `import *` there still
    assert not set(public) & set(llama_attention.__all__)
