# No library fits: pytest-playwright gives a browser per test, not a walk of a whole site; this is one test (tests/test_site.py) that drives Debian's Chromium with Playwright.
"""Walk the built site in a real browser (headless Chromium driven by Playwright) and check what a reader gets.

    python tools/walk_site.py [--site _docs] [--build] [--chromium /usr/bin/chromium]

For every page in the sidebar, at 1280 px and at a 390 px phone width:
- it loads, with no JavaScript error of its own (requests to other hosts that fail are listed, not failed);
- every internal link resolves to a page of the site, and every #anchor to an element on that page
  (links to the published site's own URL are resolved too, but a local build must have none: see below);
- every image has loaded (naturalWidth > 0);
- its maths is typeset (KaTeX or MathJax elements present, no raw \\( \\) left in the text), also when the
  landing page is opened from disk with the network blocked (the maths engine must come from the site itself);
- at 1280 px, no code block, output or display equation is wider than its box (its text would be cut off until
  scrolled), and no definition (`class X`, `def f`) is shown twice on a page;
  it has previous/next links at the bottom, and no link to the site's own pages leaves the local build;
- on the phone width, the body does not scroll sideways and nothing outside a scroll box is wider than it;
- a full-page screenshot is saved under _artifacts/screenshots/;
- every attention explorer shows the package's weights (see `check_explorers`).
Then: every API entry of the module index (selfattn_nbdev/_modidx.py) resolves to an element on its page,
and the site search finds "softmax" and "causal" with results linking to the pages that teach them.
The last line is `site: N passed, M failed`; the exit code is 1 on any failure.
"""
import argparse, http.server, importlib.util, json, os, re, socketserver, subprocess, sys, threading, time
from functools import partial
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = {'desktop': 1280, 'phone': 390}
SEARCHES = {'softmax': {'simple.html', 'trainable.html'}, 'causal': {'causal.html'}}  # query -> pages a result must include
CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking',
                 '--disable-component-update', '--disable-sync', '--disable-dev-shm-usage']


class Report:
    def __init__(self): self.passed, self.failures, self.notes, self.counts = 0, [], [], {}
    def check(self, ok: bool, what: str):
        if ok: self.passed += 1
        else: self.failures.append(what); print(f'  FAIL {what}', flush=True)
        return ok
    def count(self, key, n=1): self.counts[key] = self.counts.get(key, 0) + n


def serve(site: Path):
    "Serve `site` on 127.0.0.1 on a free port in a background thread; return (server, base url)."
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args): pass
    handler = partial(Quiet, directory=str(site))
    server = socketserver.ThreadingTCPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f'http://127.0.0.1:{server.server_address[1]}/'


def published_url() -> str:
    "The site's published address (settings.ini doc_host + doc_baseurl): links to it are internal links."
    from configparser import ConfigParser
    cfg = ConfigParser(delimiters=['=']); cfg.read(ROOT/'settings.ini')
    c = cfg['DEFAULT']
    host = c['doc_host'].replace('%(user)s', c['user'])
    base = c['doc_baseurl'].replace('%(repo)s', c['repo'])
    return host.rstrip('/') + '/' + base.strip('/') + '/'


def api_entries() -> dict[str, str]:
    "Symbol -> 'page.html#anchor' for every exported name of every module (its `__all__`), from nbdev's index."
    import importlib
    spec = importlib.util.spec_from_file_location('_modidx', ROOT/'selfattn_nbdev'/'_modidx.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    entries = {}
    for module, syms in mod.d['syms'].items():
        for name in importlib.import_module(module).__all__:
            link = syms.get(f'{module}.{name}', (None,))[0]
            if link: entries[f'{module}.{name}'] = link
    return entries


def check_explorers(page, name: str, rep: Report) -> None:
    """Every attention explorer on the page (`data-attention-explorer`) shows the package's numbers and reacts
    as the pages say: clicks every head and token in both mask settings, the slider's ends, the keyboard."""
    import torch
    from selfattn_nbdev.explorer import package_attention
    roots = page.locator('[data-attention-explorer]')
    for k in range(roots.count()):
        root, where = roots.nth(k), f'{name} explorer {k + 1}'
        rep.count('explorers')
        before = rep.passed + len(rep.failures)
        inputs = json.loads(root.get_attribute('data-inputs'))
        T, start_causal = len(inputs['tokens']), inputs['causal']
        shown = lambda: torch.tensor(json.loads(root.get_attribute('data-weights')), dtype=torch.float64)
        numbers = lambda sel: [float(x) for x in re.findall(r'-?\d+\.\d+', ' '.join(root.locator(sel).all_inner_texts()))]
        tabs, tokens = root.locator('[role=tab]'), root.locator('button.ae-token')
        box, slider = root.locator('input[type=checkbox]'), root.locator('input[type=range]')
        rep.check(tokens.all_inner_texts() == inputs['tokens'], f'{where}: one button per token, named by its text')
        rep.check(tabs.count() == (inputs['num_heads'] if inputs['num_heads'] > 1 else 0), f'{where}: one tab per head')

        def against_package(causal: bool):
            "Click every head and token; the bars, context vector and data-weights must be the package's."
            pkg_weights, pkg_context = package_attention(inputs, causal)
            for h in range(inputs['num_heads']):
                if tabs.count(): tabs.nth(h).click()
                for i in range(T):
                    tokens.nth(i).click()
                    mode = f'{where} (head {h + 1}, {inputs["tokens"][i]!r}, causal={causal})'
                    bars, z = torch.tensor(numbers('.ae-num')), torch.tensor(numbers('.ae-context'))
                    rep.check(bars.shape == (T,) and (bars - pkg_weights[h, i]).abs().max() <= 5e-4 + 1e-9,
                              f'{mode}: bars show the package\'s weights to 3 decimals ({bars.tolist()})')
                    rep.check(z.shape == pkg_context[h, i].shape and (z - pkg_context[h, i]).abs().max() <= 5e-4 + 1e-9,
                              f'{mode}: context vector is the package\'s to 3 decimals ({z.tolist()})')
                    diff = (shown() - pkg_weights[h]).abs().max().item()
                    rep.counts['explorer max diff'] = max(rep.counts.get('explorer max diff', 0.0), diff)
                    rep.check(diff <= 1e-6, f'{mode}: data-weights equal the package\'s within 1e-6 (max diff {diff:.1e})')
                if causal:
                    w = shown()
                    rep.check(w.triu(1).abs().max() == 0 and torch.allclose(w.sum(-1), torch.ones(T, dtype=w.dtype)),
                              f'{where} (head {h + 1}): with the mask on, every future weight is 0 and rows sum to 1')

        against_package(start_causal)
        box.click()
        rep.check(box.is_checked() != start_causal, f'{where}: the causal toggle switches')
        against_package(not start_causal)
        box.click()
        default = shown()
        slider.focus(); page.keyboard.press('Home')            # scale 0: no preference left
        visible = torch.ones(T, T, dtype=torch.float64)
        visible = visible.tril() if start_causal else visible
        rep.check(torch.allclose(shown(), visible / visible.sum(-1, keepdim=True), atol=1e-12),
                  f'{where}: at scale 0 every row is uniform over the tokens it may see')
        page.keyboard.press('End')                             # 4/sqrt(d_k): sharper
        grown = shown().max(-1).values - default.max(-1).values
        rep.check(bool((grown >= -1e-12).all() and (grown > 1e-6).any()),
                  f'{where}: at the slider\'s end every row\'s largest weight grew ({grown.tolist()})')
        root.locator('button.ae-reset').click()
        rep.check(torch.allclose(shown(), default, atol=0), f'{where}: the reset button restores the default scale')
        tokens.nth(0).focus(); page.keyboard.press('Enter')
        rep.check(tokens.nth(0).get_attribute('aria-pressed') == 'true', f'{where}: Enter on a focused token selects it')
        rep.count('explorer checks', rep.passed + len(rep.failures) - before)


PAGE_FACTS = """(VIEWPORT) => {
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const images = [...document.querySelectorAll('img')].map(i => ({src: i.currentSrc || i.src, w: i.naturalWidth, ok: i.complete}));
  const ids = [...document.querySelectorAll('[id]')].map(e => e.id);
  const math = document.querySelectorAll('.katex, mjx-container, .MathJax').length;
  const mathSource = document.querySelectorAll('span.math, .math.inline, .math.display').length;  // maths the page has
  const text = document.querySelector('main, #quarto-document-content, body').innerText;
  const rawMath = (text.match(/\\\\\\(|\\\\\\[|\\$\\$/g) || []).length;
  const sidebar = [...document.querySelectorAll('#quarto-sidebar a.sidebar-link, #quarto-sidebar a[href], nav.sidebar a[href]')].map(a => a.href);
  // Content wider than the viewport that no scroll box of its own holds: a parent with overflow clip/hidden would
  // cut it off silently (smalldocs' #quarto-content clips), so the body's scrollWidth alone cannot tell.
  const scrolls = el => { for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
      const o = getComputedStyle(a).overflowX; if (o === 'auto' || o === 'scroll') return true; } return false; };
  const cutOff = [...document.querySelectorAll('main *, #quarto-document-content *')]
    .filter(e => { const r = e.getBoundingClientRect(); return e instanceof HTMLElement && r.width > 0 && r.right > VIEWPORT + 1 && !scrolls(e)
                    && !e.closest('.katex-mathml, mjx-assistive-mml, .visually-hidden'); })  // screen-reader copies are clipped on purpose; SVG parts are clipped by their own viewBox
    .slice(0, 3).map(e => e.tagName.toLowerCase() + (e.className && typeof e.className === 'string' ? '.' + e.className.split(' ')[0] : ''));
  // Code blocks and outputs whose text is wider than their box (clipped until scrolled); folded ones are skipped.
  const boxes = [...document.querySelectorAll('main pre, #quarto-document-content pre')].filter(e => e.clientWidth > 0);
  const clipped = boxes.filter(e => e.scrollWidth > e.clientWidth + 1)
    .map(e => `${e.scrollWidth}>${e.clientWidth}px: ${e.innerText.split('\\n').sort((a, b) => b.length - a.length)[0].slice(0, 60)}`);
  const widest = boxes.reduce((w, e) => e.scrollWidth > w[0] ? [e.scrollWidth, e.clientWidth] : w, [0, 0]);
  const pageNav = document.querySelectorAll('nav.page-navigation a[href]').length;
  // Display equations wider than their box: on a desktop they must fit (or break into aligned lines).
  const wideMath = [...document.querySelectorAll('.katex-display, mjx-container[display]')]
    .filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > (e.parentElement.getBoundingClientRect().right + 1))
    .map(e => `${e.scrollWidth}>${e.clientWidth}px: ${(e.querySelector('annotation') || e).textContent.slice(0, 50)}`);
  // Top-level definitions in the shown code: each name once per page (an exported one is not repeated by show_doc).
  const defs = [];
  for (const c of document.querySelectorAll('main pre code, #quarto-document-content pre code'))
    for (const l of c.textContent.split('\\n')) { const m = l.match(/^(?:class|def)\\s+(\\w+)/); if (m) defs.push(m[1]); }
  const twice = [...new Set(defs.filter((d, i) => defs.indexOf(d) !== i))];
  // Table headers may wrap between words, never inside one ("Performanc / e").
  const breaksWords = e => { const s = getComputedStyle(e); return s.overflowWrap === 'anywhere' || s.wordBreak === 'break-all'
      || (s.overflowWrap === 'break-word' && e.scrollWidth > e.clientWidth + 1); };
  const brokenHeaders = [...document.querySelectorAll('main th, #quarto-document-content th')]
    .filter(th => breaksWords(th) || [...th.querySelectorAll('*')].some(breaksWords)).map(th => th.textContent.trim().slice(0, 30));
  return {links, images, ids, math, rawMath, sidebar, scrollWidth: document.documentElement.scrollWidth,
          innerWidth: window.innerWidth, title: document.title, cutOff, clipped, widest, pageNav, wideMath, twice, mathSource, brokenHeaders};
}"""


def walk(site: Path, chromium: str) -> int:
    from playwright.sync_api import sync_playwright
    rep, shots = Report(), ROOT/'_artifacts'/'screenshots'
    shots.mkdir(parents=True, exist_ok=True)
    server, base = serve(site)
    published = published_url()
    t0 = time.time()

    def local(url: str) -> str | None:
        "The local URL for a link into the site, or None for a link elsewhere."
        if url.startswith(published): url = base + url[len(published):]
        return url if url.startswith(base) else None

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        facts, external, widths = {}, set(), {}
        pages = ['index.html']
        for width_name, width in WIDTHS.items():
            ctx = browser.new_context(viewport={'width': width, 'height': 900}, device_scale_factor=1)
            # Other hosts (a theme's web fonts, Quarto's MathJax) are allowed: where the network reaches them they
            # load, and where it does not their failures are listed, never counted as the site's own errors.
            ctx.on('requestfailed', lambda r: external.add(r.url) if not r.url.startswith(base) else None)
            i = 0
            while i < len(pages):
                name = pages[i]; i += 1
                page = ctx.new_page()
                errors = []
                page.on('pageerror', lambda e: errors.append(str(e)))
                page.on('console', lambda m: errors.append(m.text) if m.type == 'error' and 'net::ERR' not in m.text
                        and 'Failed to load resource' not in m.text else None)
                resp = page.goto(base + name, wait_until='networkidle')
                page.wait_for_timeout(300)
                f = page.evaluate(PAGE_FACTS, width)
                rep.check(resp is not None and resp.ok, f'{name}: loads (HTTP {resp.status if resp else "no response"})')
                rep.check(not errors, f'{name} [{width_name}]: no JavaScript error (got {errors[:3]})')
                if width_name == 'desktop':
                    facts[name] = f
                    for link in f['sidebar']:
                        target = local(link)
                        if target:
                            pname = urldefrag(target)[0][len(base):] or 'index.html'
                            if pname.endswith('.html') and pname not in pages: pages.append(pname)
                    rep.check(f['math'] > 0 or f['mathSource'] == 0, f'{name}: maths is typeset ({f["math"]} typeset elements)')
                    rep.check(not f['clipped'], f'{name}: no code block or output wider than its box at {width} px '
                                                f'(found {len(f["clipped"])}: {f["clipped"][:2]})')
                    rep.check(f['pageNav'] >= 1, f'{name}: has previous/next links at the bottom')
                    rep.check(not f['wideMath'], f'{name}: every display equation fits its box at {width} px '
                                                 f'(found {len(f["wideMath"])}: {f["wideMath"][:2]})')
                    rep.check(not f['twice'], f'{name}: each definition is shown once (twice: {f["twice"]})')
                    rep.check(not f['brokenHeaders'], f'{name}: no table header breaks inside a word ({f["brokenHeaders"][:3]})')
                    own = [l for l in f['links'] if l.startswith(published)]
                    rep.check(not own, f'{name}: links to its own site stay local (found {own[:2]})')
                    rep.check(f['rawMath'] == 0, f'{name}: no raw TeX delimiters left in the text (found {f["rawMath"]})')
                    for img in f['images']:
                        rep.count('images')
                        rep.check(img['w'] > 0, f'{name}: image loads: {img["src"][:80]} (naturalWidth {img["w"]})')
                    widths[name] = [f['widest'], None]
                    check_explorers(page, name, rep)
                else:
                    widths.setdefault(name, [None, None])[1] = f['scrollWidth']
                    rep.check(f['scrollWidth'] <= width + 1,
                              f'{name} [phone]: no sideways scroll (scrollWidth {f["scrollWidth"]} > {width})')
                    rep.check(not f['cutOff'], f'{name} [phone]: nothing wider than {width} px outside a scroll box (found {f["cutOff"]})')
                page.screenshot(path=str(shots/f'{Path(name).stem}-{width_name}.png'), full_page=True)
                rep.count('screenshots')
                page.close()
            ctx.close()
        rep.counts['pages'] = len(pages)

        # links and anchors, against the ids collected from every page
        ids = {name: set(f['ids']) for name, f in facts.items()}
        for name, f in facts.items():
            for link in f['links']:
                target = local(link)
                if not target: continue
                url, anchor = urldefrag(target)
                anchor = unquote(anchor)
                pname = url[len(base):] or 'index.html'
                rep.count('links')
                if pname not in ids:
                    exists = (site/pname).exists()
                    rep.check(exists, f'{name}: link to {pname} resolves')
                    if not exists or not pname.endswith('.html'): continue
                    continue
                if anchor:
                    rep.count('anchors')
                    rep.check(anchor in ids[pname], f'{name}: anchor {pname}#{anchor} exists')

        for sym, link in api_entries().items():
            pname, anchor = link.split('#')
            rep.count('api entries')
            rep.check(pname in ids and anchor in ids[pname], f'API entry {sym} -> {link} is on the site')

        # opened from disk, as the README says: the maths engine must come from the site itself
        ctx = browser.new_context(viewport={'width': 1280, 'height': 900})
        ctx.route('**/*', lambda route: route.continue_() if route.request.url.startswith('file:') else route.abort())
        page = ctx.new_page()
        errors = []
        page.on('pageerror', lambda e: errors.append(str(e)))
        page.goto((site/'index.html').resolve().as_uri(), wait_until='load')
        page.wait_for_timeout(1000)
        f = page.evaluate(PAGE_FACTS, 1280)
        rep.check(f['math'] > 0 and f['rawMath'] == 0,
                  f'index.html opened from disk: maths typeset ({f["math"]} elements, {f["rawMath"]} raw)')
        drawn = page.evaluate("[...document.querySelectorAll('[data-attention-explorer]')].map(e => !!e.querySelector('.ae-app'))")
        rep.check(drawn and all(drawn) and not errors,
                  f'index.html opened from disk: its attention explorers work offline (drawn: {drawn}, errors: {errors[:2]})')
        ctx.close()

        # the site search, as a reader uses it
        ctx = browser.new_context(viewport={'width': 1280, 'height': 900})
        page = ctx.new_page()
        page.goto(base + 'index.html', wait_until='networkidle')
        for query, expected in SEARCHES.items():
            rep.count('searches')
            box = page.locator('input[type=search]:visible, .aa-Input:visible').first
            if not box.count():
                page.locator('#quarto-search button, .aa-DetachedSearchButton, #quarto-search').first.click()
                box = page.locator('.aa-Input:visible, input[type=search]:visible').first
            box.fill(query)
            page.wait_for_timeout(800)
            hrefs = page.evaluate("""() => [...document.querySelectorAll(
                '.smalldocs-search-results a[href], .aa-Panel a[href], .aa-List a[href], #quarto-search-results a[href]')]
                .map(a => a.href)""")
            hrefs = [re.sub(r'\?[^#]*', '', h) for h in hrefs]  # Quarto adds ?q=<query> to its result links
            found = {urldefrag(h)[0].rsplit('/', 1)[-1] for h in hrefs}
            rep.check(bool(hrefs), f'search "{query}" returns results')
            rep.check(expected <= found, f'search "{query}" links to {sorted(expected)} (got {sorted(found)[:8]})')
            for h in hrefs:
                url, anchor = urldefrag(local(h) or h)
                anchor = unquote(anchor)
                pname = url[len(base):] if url.startswith(base) else None
                rep.check(pname in ids and (not anchor or anchor in ids[pname]), f'search result {h} resolves')
            box.fill('')
        ctx.close()
        browser.close()
    server.shutdown()

    print('\npage                widest code text / its box at 1280 px   page width at 390 px')
    for name, ((text, box), phone) in widths.items(): print(f'{name:<20}{text:>10} px / {box} px{phone!s:>22} px')
    print(f"\npages walked: {rep.counts.get('pages', 0)} (x{len(WIDTHS)} widths); links checked: {rep.counts.get('links', 0)}; "
          f"anchors: {rep.counts.get('anchors', 0)}; images: {rep.counts.get('images', 0)}; "
          f"API entries: {rep.counts.get('api entries', 0)}; searches: {rep.counts.get('searches', 0)}; "
          f"screenshots: {rep.counts.get('screenshots', 0)} in {shots.relative_to(ROOT)}/; {time.time() - t0:.1f}s")
    if rep.counts.get('explorers'):
        print(f"attention explorers: {rep.counts['explorers']}; checks on them: {rep.counts['explorer checks']}; "
              f"largest difference between explorer and package weights: {rep.counts['explorer max diff']:.1e}")
    if external: print(f'failed requests to other hosts, excepted ({len(external)}): ' + ', '.join(sorted({urlparse(u).netloc for u in external})))
    for f in rep.failures: print(f'FAILED: {f}')
    print(f'site: {rep.passed} passed, {len(rep.failures)} failed')
    return 1 if rep.failures else 0


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--site', default=str(ROOT/'_docs'))
    ap.add_argument('--build', action='store_true', help='build the site first (tools/docs.py site)')
    ap.add_argument('--chromium', default=os.environ.get('CHROMIUM', '/usr/bin/chromium'))
    a = ap.parse_args()
    if a.build: subprocess.run([sys.executable, str(ROOT/'tools'/'docs.py'), 'site'], check=True)
    if not Path(a.chromium).exists(): sys.exit(f'no Chromium at {a.chromium}: apt-get install chromium, or pass --chromium PATH')
    sys.exit(walk(Path(a.site), a.chromium))
