"""What is generated from the notebooks is what they generate now: the package, clean notebooks, README.md, a site
with no broken link. `nbdev_export`, `nbdev_clean` and the site's link check write files, so they run in a scratch
copy of the tree: the notebooks run beside them."""
import shutil, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture
def scratch(tmp_path) -> Path:
    "A copy of the files git would commit (tracked, plus untracked ones not ignored)."
    files = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split('\0')
    for f in filter(None, files):
        if (ROOT/f).is_file():
            (tmp_path/f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT/f, tmp_path/f)
    return tmp_path


def _generated(root: Path) -> dict[str, bytes]:
    "The files nbdev_export and nbdev_clean write, by path (caches and hidden folders left out)."
    files = [*(root/'selfattn_nbdev').rglob('*'), *(root/'nbs').rglob('*.ipynb'), root/'pyproject.toml']
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files
            if p.is_file() and not any(part.startswith(('.', '__pycache__')) for part in p.relative_to(root).parts)}


def test_package_and_notebooks_in_sync(scratch):
    for tool in ['nbdev_export', 'nbdev_clean']:
        res = subprocess.run([BIN/tool], cwd=scratch, capture_output=True, text=True)
        assert res.returncode == 0, f'{tool} failed in a clean copy:\n{res.stderr}'
    before, after = _generated(ROOT), _generated(scratch)
    stale = sorted(f for f in before.keys() | after.keys() if before.get(f) != after.get(f))
    assert not stale, f'out of sync with the notebooks (run `make export` and commit): {stale}'


def test_readme_is_the_render_of_index(monkeypatch, capsys):
    from tools import docs  # imports nbdev's docs machinery: only when this test runs
    monkeypatch.chdir(ROOT)
    assert docs.readme(check_only=True) == 0, capsys.readouterr().out


@pytest.mark.slow
def test_site_has_no_broken_link(scratch):
    res = subprocess.run([sys.executable, 'tools/docs.py', 'check'], cwd=scratch, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
