"""The built site as a reader gets it: build it (tools/docs.py site), then walk every page in headless Chromium
(tools/walk_site.py). Run by `make test-site` (`pytest -m site`); deselected otherwise. Needs Debian's Chromium, or
$CHROMIUM pointing at a Chrome. $SITE_MAX_HEIGHT sets another limit on a page's height at 1280 px than 20,000 px;
SITE_SCREENSHOTS=1 saves a screenshot of every page and view under _artifacts/screenshots/ (tools/walk_site.py always does)."""
import os, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT/'tools'))

import walk_site  # noqa: E402

pytestmark = pytest.mark.site


def test_every_page_in_a_browser():
    chromium = os.environ.get('CHROMIUM', '/usr/bin/chromium')
    assert Path(chromium).exists(), f'no Chromium at {chromium}: apt-get install chromium, or set CHROMIUM'
    subprocess.run([sys.executable, 'tools/docs.py', 'site'], cwd=ROOT, check=True)
    max_height = int(os.environ.get('SITE_MAX_HEIGHT', walk_site.MAX_HEIGHT))  # px at 1280; the project's limit by default
    shots = os.environ.get('SITE_SCREENSHOTS', '') not in ('', '0')  # for a person; CI reads none of them
    assert walk_site.walk(ROOT/'_docs', chromium, max_height, screenshots=shots) == 0, \
        'the walk found problems: see `FAIL` lines above'
