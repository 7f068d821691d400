"""Run notebooks top to bottom and save their fresh outputs (what the site will show), then clean them.

    python tools/run_notebook.py nbs/03_causal.ipynb [...]

Uses nbdev's own execution engine (execnb), from the notebook's folder, stopping at the first failing cell.
"""
import os, subprocess, sys
from pathlib import Path

from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell


def run(path: Path) -> None:
    path = path.resolve()
    nb = read_nb(path)
    cwd = os.getcwd(); os.chdir(path.parent)
    try: CaptureShell(path).run_all(nb, exc_stop=True)
    finally: os.chdir(cwd)
    write_nb(nb, path)
    subprocess.run([Path(sys.executable).parent/'nbdev_clean', '--fname', str(path)], check=True)
    print(f'ran and saved {path.name}')


if __name__ == '__main__':
    if len(sys.argv) < 2: sys.exit(__doc__)
    for p in sys.argv[1:]: run(Path(p))
