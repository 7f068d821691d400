# No library fits: pytest-playwright gives a browser per test, not a walk of a whole site; this is one test (tests/test_site.py) that drives Debian's Chromium with Playwright.
"""Walk the built site in a real browser (headless Chromium driven by Playwright) and check what a reader gets.

    python tools/walk_site.py [--site _docs] [--build] [--chromium /usr/bin/chromium] [--max-height 20000]
                              [--pages index.html,simple.html]   # walk only these (a quicker check of a few pages)

Every page the landing page's sidebar lists is opened four times: at 1280 px and at a 390 px phone width, each in
the light and in the dark colour scheme (the browser says `prefers-color-scheme: dark`, as a reader's system does),
two of these passes at a time (PASS_GROUPS). Each time:
- it loads, with no JavaScript error of its own (requests to other hosts that fail are listed, not failed), and
  is drawn within 15 s: fonts in, maths typeset, attention explorers drawn (READY; the checks wait for it);
- it is in the colour scheme asked for (its body's background is dark, or light), and every visible text has a
  WCAG contrast of at least 4.5 against the background it is painted on (see CONTRAST);
- a full-page screenshot is saved under _artifacts/screenshots/ (`<page>-<pass>.png`), for a person to look at: by
  the command line always, by `make test-site` only with SITE_SCREENSHOTS=1 (they take some 2 minutes of CI's walk).
In the light scheme, also:
- every internal link resolves to a page of the site, and every #anchor to an element on that page
  (links to the published site's own URL are resolved too, but a local build must have none: see below);
  no page links to Colab (no notebook of this site runs there);
- every image has loaded (naturalWidth > 0);
- its maths is typeset (KaTeX or MathJax elements present, no raw \\( \\) left in the text), also when the
  landing page is opened from disk with the network blocked (the maths engine must come from the site itself);
- every page's sidebar lists the same pages as the landing page's;
- at 1280 px, no code block, output or display equation is wider than its box (its text would be cut off until
  scrolled), and no definition (`class X`, `def f`) is shown twice on a page;
  it has previous/next links at the bottom, and no link to the site's own pages leaves the local build;
  the page is at most --max-height px tall (every page's height is printed, in the table at the end);
- on the phone width, the body does not scroll sideways and nothing outside a scroll box is wider than it;
  no code block scrolls sideways (code wraps there, so each line's shape comment is on the screen);
  every API parameter table fits the screen, its description cells readable (see API_TABLES);
  every figure's smallest text is at least 8 CSS px tall (see `check_figure_text`; the table at the end names the
  smallest of each page);
- every attention explorer shows the package's weights (see `check_explorers`).
On the phone width in both schemes, a display equation wider than the screen shows a scroll cue (`check_math_cues`).
Then: every API entry of the module index (selfattn_nbdev/_modidx.py) resolves to an element on its page,
and the site search finds "softmax" and "causal" with results linking to the pages that teach them.
The last line is `site: N passed, M failed`; the exit code is 1 on any failure.
"""
import argparse, http.server, importlib.util, json, os, re, socket, socketserver, subprocess, sys, threading, time
from functools import partial
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse

ROOT = Path(__file__).resolve().parents[1]
# (name, viewport width, colour scheme): only the light ones check layout and links.
PASSES = [('desktop', 1280, 'light'), ('phone', 390, 'light'), ('desktop-dark', 1280, 'dark'), ('phone-dark', 390, 'dark')]
# The passes run in two threads, each with its own browser: one pass after another, the walk kept about half a core
# busy (it waits on pages being drawn), and two at a time it takes about 5/6 of the time. Each thread takes one of the
# light passes, which check more, and one dark pass.
PASS_GROUPS = [[PASSES[0], PASSES[3]], [PASSES[1], PASSES[2]]]
MIN_CONTRAST = 4.5      # WCAG 2 AA for body text; the walk asks it of every text, large or small
MAX_HEIGHT = 20_000     # px at 1280: the project's limit on a page's length (--max-height)
STORY_MAX_HEIGHT = 95_000  # px at 1280 under Quarto: the landing page and the six story pages together
MIN_FIGURE_TEXT = 8.0   # CSS px on the phone width: the smallest text a figure may show
FIGURE_TEXT_KEY = 'Smallest text pt'  # the PNG text chunk where a story figure records its smallest font size
STORY = {'index.html', 'simple.html', 'trainable.html', 'causal.html', 'multihead.html', 'training.html',
         'generation.html', 'kv_cache.html', 'batches.html'}  # their figures must record it
BEYOND = {'kv_cache.html', 'batches.html'}  # the first pages after the story: not in its height
SEARCHES = {'softmax': {'simple.html', 'trainable.html'}, 'causal': {'causal.html'}}  # query -> pages a result must include
# A page is ready when it has loaded, its fonts are in, its maths is typeset (KaTeX, in both builds) and every
# attention explorer is drawn: waited for as such, rather than for a quiet network and a pause (0.6 s more a view).
READY = """() => document.readyState === 'complete' && document.fonts.status === 'loaded'
  && (!document.querySelector('span.math, .math.inline, .math.display') || !!document.querySelector('.katex'))
  && [...document.querySelectorAll('[data-attention-explorer]')].every(e => e.querySelector('.ae-app'))"""
CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking',
                 '--disable-component-update', '--disable-sync', '--disable-dev-shm-usage']


class Report:
    "What the checks found: the passes that run side by side (PASS_GROUPS, a thread each) report here, under a lock."
    def __init__(self):
        self.passed, self.failures, self.notes, self.counts = 0, [], [], {}
        self.lock = threading.Lock()
    def check(self, ok: bool, what: str):
        with self.lock:
            if ok: self.passed += 1
            else: self.failures.append(what); print(f'  FAIL {what}', flush=True)
        return ok
    def count(self, key, n=1):
        with self.lock: self.counts[key] = self.counts.get(key, 0) + n


def serve(site: Path):
    "Serve `site` on 127.0.0.1 on a free port in a background thread; return (server, base url)."
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args): pass
    handler = partial(Quiet, directory=str(site))
    server = socketserver.ThreadingTCPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f'http://127.0.0.1:{server.server_address[1]}/'


def reachable(url: str, seen: dict, timeout: float = 2.0) -> bool:
    "Whether the host of `url` answers a TCP connection (once per host, remembered in `seen`)."
    where = urlparse(url)
    host, port = where.hostname, where.port or (443 if where.scheme == 'https' else 80)
    if (host, port) not in seen:
        try: socket.create_connection((host, port), timeout=timeout).close(); seen[host, port] = True
        except OSError: seen[host, port] = False
    return seen[host, port]


def other_hosts_fail_fast(ctx, base: str, seen: dict) -> None:
    """A request to another host that no connection reaches fails at once, as it would anyway, rather than after
    Chromium's own wait (for the theme's web fonts, 5 s on one page load in seven: 102 of a 183 s walk without a
    network); where the host answers, the request goes through."""
    ctx.route(re.compile('^(?!' + re.escape(base) + ')https?://'),
              lambda route: route.continue_() if reachable(route.request.url, seen) else route.abort())


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
                if causal and not inputs.get('fixed'):
                    w = shown()
                    rep.check(w.triu(1).abs().max() == 0 and torch.allclose(w.sum(-1), torch.ones(T, dtype=w.dtype)),
                              f'{where} (head {h + 1}): with the mask on, every future weight is 0 and rows sum to 1')

        if inputs.get('fixed'):  # a layer's own weights: no switch, no slider
            against_package(start_causal)
            hidden = ~torch.tensor(inputs['allowed'])
            rep.check(box.count() == 0 and slider.count() == 0 and bool((shown()[hidden] == 0).all()),
                      f'{where}: a layer\'s explorer has no switch or slider, and its hidden cells hold 0')
            tokens.nth(0).focus(); page.keyboard.press('Enter')
            rep.check(tokens.nth(0).get_attribute('aria-pressed') == 'true', f'{where}: Enter on a focused token selects it')
            rep.count('explorer checks', rep.passed + len(rep.failures) - before)
            continue
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
  // Code (not outputs) that scrolls sideways: on a phone it wraps, so that each line's comment is on the screen.
  const codeScrolls = boxes.filter(e => !e.closest('.cell-output, .cell-output-stdout, .cell-output-stderr, .cell-output-display')
                                    && e.scrollWidth > e.clientWidth + 1)
    .map(e => `${e.scrollWidth}>${e.clientWidth}px: ${e.innerText.split('\\n').sort((a, b) => b.length - a.length)[0].slice(0, 50)}`);
  // Code lines (Quarto's span a line) whose wrapped part would start at the left edge on a phone: an indented line
  // that tools/docs.py did not mark with its --indent, or a line that styles.css gives no hanging indent.
  const unhung = [...document.querySelectorAll('main pre.sourceCode > code.sourceCode > span[id^="cb"]')]
    .filter(s => !s.closest('.cell-output, .cell-output-stdout, .cell-output-stderr, .cell-output-display'))
    .filter(s => (/^ /.test(s.textContent) && !s.style.getPropertyValue('--indent'))
                 || (window.innerWidth < 576 && getComputedStyle(s).paddingLeft === '0px'))
    .slice(0, 3).map(s => s.textContent.slice(0, 40));
  const pageNav = document.querySelectorAll('nav.page-navigation a[href]').length;
  // Display equations wider than their box: on a desktop they must fit (or break into aligned lines).
  const wideMath = [...document.querySelectorAll('.katex-display, mjx-container[display]')]
    .filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > (e.parentElement.getBoundingClientRect().right + 1))
    .map(e => `${e.scrollWidth}>${e.clientWidth}px: ${(e.querySelector('annotation') || e).textContent.slice(0, 50)}`);
  // Top-level definitions in the shown code: each name once per page (an exported one is not repeated by show_doc).
  const defs = [];
  for (const c of document.querySelectorAll('main pre code, #quarto-document-content pre code'))
    for (const l of c.textContent.split('\\n')) {  // a method added with @patch counts as Class.name
      const m = l.match(/^(?:class|def)\\s+(\\w+)(?:\\(self:(\\w+))?/); if (m) defs.push(m[2] ? `${m[2]}.${m[1]}` : m[1]); }
  const twice = [...new Set(defs.filter((d, i) => defs.indexOf(d) !== i))];
  // Table headers may wrap between words, never inside one ("Performanc / e").
  const breaksWords = e => { const s = getComputedStyle(e); return s.overflowWrap === 'anywhere' || s.wordBreak === 'break-all'
      || (s.overflowWrap === 'break-word' && e.scrollWidth > e.clientWidth + 1); };
  const brokenHeaders = [...document.querySelectorAll('main th, #quarto-document-content th')]
    .filter(th => breaksWords(th) || [...th.querySelectorAll('*')].some(breaksWords)).map(th => th.textContent.trim().slice(0, 30));
  return {links, images, ids, math, rawMath, sidebar, scrollWidth: document.documentElement.scrollWidth,
          height: document.documentElement.scrollHeight,
          innerWidth: window.innerWidth, title: document.title, cutOff, clipped, codeScrolls, unhung, widest, pageNav, wideMath, twice, mathSource, brokenHeaders};
}"""


CONTRAST = r"""(LIMIT) => {
  // Every visible text of the page against the background it is painted on: the WCAG 2 contrast ratio.
  // The background is the element's own, or its first ancestor's with a colour; a translucent one is laid over
  // what is under it. A gradient (a scroll shadow, stripes) counts as each of its colours: the text must read on
  // all of them. Opacity below 1 on the element or an ancestor fades the text towards its background.
  const canvas = document.createElement('canvas'); canvas.width = canvas.height = 1;
  const g = canvas.getContext('2d', {willReadFrequently: true}), parsed = new Map();
  const rgba = css => {        // any CSS colour -> [r, g, b, alpha 0..1]: a canvas reads every syntax the page may use
    if (!parsed.has(css)) { g.clearRect(0, 0, 1, 1); g.fillStyle = '#000'; g.fillStyle = css; g.fillRect(0, 0, 1, 1);
      const d = g.getImageData(0, 0, 1, 1).data; parsed.set(css, [d[0], d[1], d[2], d[3] / 255]); }
    return parsed.get(css); };
  const over = (top, below) => [0, 1, 2].map(i => top[i] * top[3] + below[i] * (1 - top[3])).concat(1);
  const lum = c => { const l = c.slice(0, 3).map(v => { v /= 255; return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2]; };
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const hex = c => '#' + c.slice(0, 3).map(v => Math.round(v).toString(16).padStart(2, '0')).join('');
  const colours = css => (css.match(/(?:rgba?|hsla?|hwb|lab|lch|oklab|oklch|color)\([^()]*\)|#[0-9a-f]{3,8}\b|transparent/gi) || []).map(rgba);
  const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
    + (typeof e.className === 'string' && e.className.trim() ? '.' + e.className.trim().split(/\s+/).slice(0, 2).join('.') : '');
  const path = e => { const p = []; for (let a = e; a && a !== document.body && p.length < 4; a = a.parentElement) p.unshift(name(a)); return p.join(' > '); };
  const under = new Map();     // element -> the colours its text may sit on (opaque)
  const backgrounds = el => {
    if (!el) {                 // under the root: the canvas, dark where the page asks for a dark colour scheme
      const dark = /dark/.test(getComputedStyle(document.documentElement).colorScheme);
      return [dark ? [18, 18, 18, 1] : [255, 255, 255, 1]]; }
    if (under.has(el)) return under.get(el);
    const s = getComputedStyle(el), bg = rgba(s.backgroundColor);
    let here = (bg[3] >= 1 ? [[0, 0, 0, 1]] : backgrounds(el.parentElement)).map(b => over(bg, b));
    if (/gradient/.test(s.backgroundImage)) {
      const stops = colours(s.backgroundImage).filter(c => c[3] > 0);
      const plain = stops.length && stops.every(c => c.join() === stops[0].join());   // one colour: a plain layer
      here = plain ? here.map(b => over(stops[0], b)) : here.concat(...stops.map(c => here.map(b => over(c, b))));
    }
    here = [...new Map(here.map(c => [hex(c), c])).values()].slice(0, 16);
    under.set(el, here); return here; };
  const faded = new Map();     // element -> the product of its and its ancestors' opacity
  const fade = el => { if (!el) return 1; if (!faded.has(el)) faded.set(el, parseFloat(getComputedStyle(el).opacity) * fade(el.parentElement));
    return faded.get(el); };
  // Not read by anyone looking: screen-reader copies, and SVG text (its colour is its fill, not checked here).
  const skip = 'script, style, noscript, template, .katex-mathml, mjx-assistive-mml, .visually-hidden, .sr-only, svg';
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT), done = new Set(), low = [];
  let checked = 0, worst = null;
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (!el || done.has(el) || !n.textContent.trim() || el.closest(skip)) continue;
    done.add(el);
    if (!el.checkVisibility({opacityProperty: true, visibilityProperty: true, checkOpacity: true, checkVisibilityCSS: true})) continue;
    const range = document.createRange(); range.selectNodeContents(n);
    const box = range.getBoundingClientRect();
    if (box.width < 2 || box.height < 2) continue;                  // clipped to nothing
    const fg = rgba(getComputedStyle(el).color), alpha = fg[3] * fade(el);
    let min = Infinity, pair = null;
    for (const bg of backgrounds(el)) {
      const text = over([fg[0], fg[1], fg[2], alpha], bg), r = ratio(text, bg);
      if (r < min) { min = r; pair = [text, bg]; } }
    checked++;
    if (worst && min >= worst.ratio && min >= LIMIT) continue;
    const what = {element: path(el), text: n.textContent.trim().replace(/\s+/g, ' ').slice(0, 40),
                  color: hex(pair[0]), background: hex(pair[1]), ratio: Math.floor(min * 100) / 100};
    if (!worst || min < worst.ratio) worst = what;
    if (min < LIMIT) low.push(what); }
  // Text that CSS writes (`content: " = "`, a breadcrumb's `>`), outside code and maths; icon fonts' glyphs (in
  // Unicode's private use area) are pictures, not text.
  const elements = document.createTreeWalker(document.body, NodeFilter.SHOW_ELEMENT,
    {acceptNode: e => e.matches('pre, .katex, svg, script, style') ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT});
  for (let el = elements.nextNode(); el; el = elements.nextNode()) {
    for (const pseudo of ['::before', '::after']) {
      const s = getComputedStyle(el, pseudo), m = /^"(.*)"$/.exec(s.content);
      if (!m || !/[\p{L}\p{N}\p{P}\p{S}]/u.test(m[1]) || /[\uE000-\uF8FF]/.test(m[1]) || s.display === 'none'
          || !el.checkVisibility({opacityProperty: true, visibilityProperty: true})) continue;
      const fg = rgba(s.color), bgs = backgrounds(el), alpha = fg[3] * fade(el) * parseFloat(s.opacity);
      const own = rgba(s.backgroundColor), beneath = own[3] > 0 ? bgs.map(b => over(own, b)) : bgs;
      let min = Infinity, pair = null;
      for (const bg of beneath) { const text = over([fg[0], fg[1], fg[2], alpha], bg), r = ratio(text, bg); if (r < min) { min = r; pair = [text, bg]; } }
      checked++;
      const what = {element: path(el) + pseudo, text: m[1].slice(0, 40), color: hex(pair[0]), background: hex(pair[1]), ratio: Math.floor(min * 100) / 100};
      if (!worst || min < worst.ratio) worst = what;
      if (min < LIMIT) low.push(what); } }
  const body = backgrounds(document.body)[0];
  return {checked, worst, low: low.sort((a, b) => a.ratio - b.ratio), body: hex(body), bodyDark: lum(body) < 0.2};
}"""

API_TABLES = r"""() => {
  // The parameter tables under the API entries (tools/showdoc_tables.py: header `name | type | default | ...`):
  // on a phone each must fit the screen with no sideways scroll, and each description must start and end on the
  // screen, at least 150 px wide (some 20 characters a line), whether the rows are stacked or the cells wrap.
  const W = window.innerWidth, out = [];
  // the tables are folded (<details class="api-details">): open them to measure, close them again after
  const closed = [...document.querySelectorAll('details.api-details:not([open])')];
  closed.forEach(d => d.open = true);
  const api = [...document.querySelectorAll('main table, #quarto-document-content table')].filter(t => {
    const h = [...t.querySelectorAll('thead th')].map(th => th.textContent.trim());
    return h[1] === 'type' && h[2] === 'default'; });
  for (const t of api) {
    const title = t.querySelector('thead th').textContent.trim().slice(0, 30), r = t.getBoundingClientRect();
    if (t.scrollWidth > t.clientWidth + 1 || r.left < -1 || r.right > W + 1)
      out.push(`${title}: the table is ${t.scrollWidth} px wide in a ${t.clientWidth} px box (right edge at ${Math.round(r.right)} px)`);
    for (const row of t.querySelectorAll('tbody tr')) {
      const d = row.querySelector('td:nth-child(4)'); if (!d || !d.textContent.trim()) continue;
      const b = d.getBoundingClientRect();
      if (b.left < -1 || b.right > W + 1 || b.width < 150) {
        out.push(`${title}, ${row.querySelector('td').textContent.trim()}: description at ${Math.round(b.left)}..${Math.round(b.right)} px`);
        break; } } }
  closed.forEach(d => d.open = false);
  return {tables: api.length, problems: out};
}"""

MATH_BOXES = r"""() => [...document.querySelectorAll('.katex-display, mjx-container[display]')].map((e, i) => ({
  i, hidden: e.scrollWidth - e.clientWidth, tex: (e.querySelector('annotation') || e).textContent.trim().slice(0, 40)}))"""


def _edge_cues(png: bytes) -> tuple[float, float]:
    """How far the left and right 4-px edges of a screenshot differ from its middle (the largest difference of
    a colour channel's mean, 0 to 255): a scroll shadow darkens (or, in the dark, lightens) the edge it sits on."""
    from io import BytesIO
    from PIL import Image, ImageStat
    img = Image.open(BytesIO(png)).convert('RGB')
    w, h = img.size
    mean = lambda x0, x1: ImageStat.Stat(img.crop((x0, 0, x1, h))).mean
    mid = mean(w // 2 - 2, w // 2 + 2)
    return tuple(max(abs(a - b) for a, b in zip(mean(x0, x0 + 4), mid)) for x0 in (0, w - 4))


def check_math_cues(page, where: str, rep: Report) -> None:
    """On a phone, a display equation wider than the screen scrolls in its own box; it must show that it does.

    For each display equation whose box scrolls (scrollWidth > clientWidth), screenshot the box with the formula
    hidden (so only its background is seen) scrolled to its start and to its end: at the start its right edge must
    differ from its middle by at least 16 (of 255) in a colour channel and its left edge by less than 4, and at the
    end the other way round: a visible shadow on the side where some of the formula is hidden, and only there."""
    boxes = [b for b in page.evaluate(MATH_BOXES) if b['hidden'] > 1]
    if not boxes: return
    page.add_style_tag(content='.walk-blank > * { visibility: hidden !important; }')
    math = page.locator('.katex-display, mjx-container[display]')
    for b in boxes:
        rep.count('wide equations'); rep.counts['most hidden'] = max(rep.counts.get('most hidden', 0), b['hidden'])
        box = math.nth(b['i'])
        box.evaluate("e => { e.classList.add('walk-blank'); e.scrollLeft = 0; }")
        start = _edge_cues(box.screenshot())
        box.evaluate('e => { e.scrollLeft = e.scrollWidth; }')
        end = _edge_cues(box.screenshot())
        box.evaluate("e => { e.classList.remove('walk-blank'); e.scrollLeft = 0; }")
        ok = start[1] >= 16 and start[0] < 4 and end[0] >= 16 and end[1] < 4
        rep.check(ok, f'{where}: display equation {b["tex"]!r} hides {b["hidden"]} px and shows a scroll cue at the '
                      f'hidden edge (left/right edge contrast with the middle: {start[0]:.0f}/{start[1]:.0f} at the start, '
                      f'{end[0]:.0f}/{end[1]:.0f} at the end; want >= 16 where hidden, < 4 elsewhere)')


FIGURES = r"""() => [...document.querySelectorAll('main img, #quarto-document-content img')]
  .filter(i => i.closest('.cell-output-display, figure, .quarto-figure') && i.getBoundingClientRect().width > 0)
  .map(i => ({src: i.currentSrc || i.src, natural: i.naturalWidth, shown: i.getBoundingClientRect().width,
              alt: (i.alt || '').slice(0, 50)}))"""


def png_info(data: bytes) -> tuple[dict[str, str], float | None]:
    "A PNG's text chunks (keyword -> text) and its pixels per inch (its pHYs chunk; None without one)."
    import struct, zlib
    texts, ppi, i = {}, None, 8
    if data[:8] != b'\x89PNG\r\n\x1a\n': return texts, ppi
    while i + 8 <= len(data):
        n, kind = struct.unpack('>I4s', data[i:i + 8]); body = data[i + 8:i + 8 + n]; i += 12 + n
        if kind == b'tEXt' and b'\0' in body:
            key, _, text = body.partition(b'\0'); texts[key.decode('latin-1')] = text.decode('latin-1')
        elif kind == b'zTXt' and b'\0' in body:
            key, _, rest = body.partition(b'\0'); texts[key.decode('latin-1')] = zlib.decompress(rest[1:]).decode('latin-1')
        elif kind == b'pHYs' and n == 9:
            x, _, unit = struct.unpack('>IIB', body)
            if unit == 1: ppi = x * 0.0254  # pixels per metre
        elif kind == b'IEND': break
    return texts, ppi


def check_figure_text(page, name: str, where: str, site: Path, base: str, rep: Report, smallest: dict) -> None:
    """On the phone width, every figure's text must be at least MIN_FIGURE_TEXT CSS px tall.

    A story figure records the size of its smallest text, in points, in a PNG text chunk (FIGURE_TEXT_KEY, written
    by the figure formatter of each story notebook); the PNG's pHYs chunk gives its pixels per inch. That text is
    `points / 72 * ppi` pixels of the image, and the browser shows the image at `shown` of its `natural` width, so
    it is that times `shown / natural` CSS px tall (the walk's device scale factor is 1). A figure of a story page
    without the record fails; on other pages it is counted as not measured."""
    import base64
    from urllib.parse import unquote, urlparse
    for k, img in enumerate(page.evaluate(FIGURES)):
        src = img['src']
        if src.startswith('data:image/png;base64,'): data = base64.b64decode(src.split(',', 1)[1])
        elif src.startswith(base): data = (site/unquote(urlparse(src).path).lstrip('/')).read_bytes()
        else: continue
        texts, ppi = png_info(data)
        label = f'{where}: figure {k + 1} ({img["alt"]!r})'
        if texts.get(FIGURE_TEXT_KEY) is None or not ppi:
            rep.count('figures without a text record')
            if name in STORY: rep.check(False, f'{label} records no smallest text ({FIGURE_TEXT_KEY!r} and pHYs in its PNG)')
            continue
        points = float(texts[FIGURE_TEXT_KEY])
        px = points / 72 * ppi * img['shown'] / img['natural']
        rep.count('figures measured')
        if px < smallest.get('px', 1e9):
            smallest.update(px=px, where=label, points=points, ppi=ppi, shown=img['shown'], natural=img['natural'])
        row = smallest.setdefault('pages', {})
        row[name] = min(row.get(name, 1e9), px)
        rep.check(px >= MIN_FIGURE_TEXT, f'{label}: smallest text {px:.1f} CSS px ({points:g} pt at {ppi:.0f} px per '
                                         f'inch, image {img["natural"]} px shown {img["shown"]:.0f} px wide); '
                                         f'want >= {MIN_FIGURE_TEXT:g}')


def walk(site: Path, chromium: str, max_height: int = MAX_HEIGHT, only: list[str] | None = None,
         screenshots: bool = True) -> int:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout, sync_playwright
    rep, shots = Report(), ROOT/'_artifacts'/'screenshots'
    shots.mkdir(parents=True, exist_ok=True)
    server, base = serve(site)
    published = published_url()
    t0 = time.time()

    def local(url: str) -> str | None:
        "The local URL for a link into the site, or None for a link elsewhere."
        if url.startswith(published): url = base + url[len(published):]
        return url if url.startswith(base) else None

    facts, external, table, worst, figure_text = {}, set(), {}, {'light': {}, 'dark': {}}, {}
    hosts = {}  # (host, port): whether a connection reaches it

    def sidebar_pages(links: list) -> list:
        "The pages of the site a sidebar links to, in its order, the landing page first."
        found = ['index.html']
        for link in links:
            target = local(link)
            if target:
                pname = urldefrag(target)[0][len(base):] or 'index.html'
                if pname.endswith('.html') and pname not in found: found.append(pname)
        return found

    def walk_pass(browser, pass_name: str, width: int, scheme: str):
        "Open every page at `width` in `scheme`, and check what that view shows."
        light, phone = scheme == 'light', width < 1280
        ctx = browser.new_context(viewport={'width': width, 'height': 900}, device_scale_factor=1, color_scheme=scheme)
        # Other hosts (a theme's web fonts, Quarto's MathJax) are allowed: where the network reaches them they
        # load, and where it does not they fail at once (other_hosts_fail_fast) and are listed, never counted as the
        # site's own errors.
        ctx.on('requestfailed', lambda r: external.add(r.url) if not r.url.startswith(base) else None)
        other_hosts_fail_fast(ctx, base, hosts)
        for name in pages:
            where = f'{name} [{pass_name}]'
            page = ctx.new_page()
            errors = []
            page.on('pageerror', lambda e: errors.append(str(e)))
            page.on('console', lambda m: errors.append(m.text) if m.type == 'error' and 'net::ERR' not in m.text
                    and 'Failed to load resource' not in m.text else None)
            resp = page.goto(base + name, wait_until='load')
            try: drawn = bool(page.wait_for_function(READY, timeout=15_000))  # what a reader sees, drawn
            except PlaywrightTimeout: drawn = False
            rep.check(drawn, f'{where}: drawn within 15 s (loaded, fonts in, maths typeset, explorers drawn)')
            rep.check(resp is not None and resp.ok, f'{where}: loads (HTTP {resp.status if resp else "no response"})')
            rep.check(not errors, f'{where}: no JavaScript error (got {errors[:3]})')
            row = table.setdefault(name, {})

            # Colours, in both schemes. A fresh browser context has no stored choice of the theme toggle
            # (Quarto keeps it in localStorage), so the page follows prefers-color-scheme: make sure it did.
            c = page.evaluate(CONTRAST, MIN_CONTRAST)
            rep.check(c['bodyDark'] == (scheme == 'dark'), f'{where}: the page is in the {scheme} scheme (body background {c["body"]})')
            low = '; '.join(f"{w['element']} {w['text']!r}: {w['color']} on {w['background']} = {w['ratio']}" for w in c['low'][:4])
            rep.check(not c['low'], f'{where}: every text has a contrast of at least {MIN_CONTRAST} '
                                    f'({len(c["low"])} below it of {c["checked"]}; lowest: {low})')
            rep.count('texts checked', c['checked'])
            if c['worst']:
                with rep.lock:  # both light passes write these
                    row[scheme] = min(row.get(scheme, 99), c['worst']['ratio'])
                    if c['worst']['ratio'] < worst[scheme].get('ratio', 99): worst[scheme] = dict(c['worst'], page=where)
            if phone: check_math_cues(page, where, rep)

            if light:
                f = page.evaluate(PAGE_FACTS, width)
                colab = [l for l in f['links'] if urlparse(l).netloc.endswith('colab.research.google.com')]
                rep.check(not colab, f'{where}: no link to Colab (found {colab[:2]})')
            if light and not phone:
                facts[name] = f
                if not only:  # every page's sidebar lists the pages the landing page's does
                    listed = sidebar_pages(f['sidebar'])
                    rep.check(listed == pages, f'{name}: its sidebar lists the pages of the landing page\'s '
                                               f'(differs in {sorted(set(listed) ^ set(pages))[:4]})')
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
                row.update(widest=f['widest'], height=f['height'])
                rep.check(f['height'] <= max_height, f'{name}: at most {max_height:,} px tall at {width} px ({f["height"]:,} px)')
                check_explorers(page, name, rep)
            elif light:
                row['phone'] = f['scrollWidth']
                rep.check(f['scrollWidth'] <= width + 1,
                          f'{where}: no sideways scroll (scrollWidth {f["scrollWidth"]} > {width})')
                rep.check(not f['cutOff'], f'{where}: nothing wider than {width} px outside a scroll box (found {f["cutOff"]})')
                rep.check(not f['codeScrolls'], f'{where}: every code block wraps, its comments on the screen '
                                                f'({len(f["codeScrolls"])} scroll: {f["codeScrolls"][:2]})')
                rep.check(not f['unhung'], f'{where}: a wrapped line of code goes on past its own indent '
                                           f'(not so: {f["unhung"]})')
                check_figure_text(page, name, where, site, base, rep, figure_text)
                t = page.evaluate(API_TABLES)
                rep.count('API tables', t['tables'])
                rep.check(not t['problems'], f'{where}: every API parameter table fits the screen, its descriptions '
                                             f'readable ({len(t["problems"])} not: {t["problems"][:3]})')
            if screenshots:  # for a person to look at; no check reads them
                page.screenshot(path=str(shots/f'{Path(name).stem}-{pass_name}.png'), full_page=True)
                rep.count('screenshots')
            page.close()
        ctx.close()

    def walk_passes(group: list, errors: list):
        "One thread: its own Playwright and browser (Playwright's objects belong to the thread that made them)."
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
                for pass_name, width, scheme in group: walk_pass(browser, pass_name, width, scheme)
                browser.close()
        except BaseException as e: errors.append(e)

    with sync_playwright() as p:  # the pages: those the landing page's sidebar lists
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        if only: pages = list(only)
        else:
            ctx = browser.new_context(viewport={'width': 1280, 'height': 900})
            other_hosts_fail_fast(ctx, base, hosts)
            page = ctx.new_page()
            page.goto(base + 'index.html', wait_until='load')
            pages = sidebar_pages(page.evaluate(PAGE_FACTS, 1280)['sidebar'])
            ctx.close()
        browser.close()
    failed = []  # what a thread raised
    threads = [threading.Thread(target=walk_passes, args=(group, failed)) for group in PASS_GROUPS]
    for t in threads: t.start()
    for t in threads: t.join()
    if failed: raise failed[0]
    rep.counts['pages'] = len(pages)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)

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
            if only and pname not in ids: continue  # a page not walked
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
        other_hosts_fail_fast(ctx, base, hosts)
        page = ctx.new_page()
        page.goto(base + 'index.html', wait_until='networkidle')
        for query, expected in ({} if only else SEARCHES).items():
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

    # One line per page: the figures the checks above hold against their limits.
    print(f'\n{"page":<18}{"height at 1280":>15}{"widest code / box at 1280":>27}{"page width at 390":>19}'
          f'{"lowest contrast light / dark":>30}{"figure text at 390":>20}')
    fig_px = figure_text.get('pages', {})
    for name in pages:  # in the sidebar's order (two threads filled the table)
        r = table.get(name, {})
        (text, box), over = r.get('widest', (None, None)), ' > limit' if r.get('height', 0) > max_height else ''
        fig = f"{fig_px[name]:.1f} px" if name in fig_px else '-'
        print(f"{name:<18}{r.get('height', 0):>12,} px{text!s:>13} / {box!s:>4} px{r.get('phone')!s:>16} px"
              f"{r.get('light', '-')!s:>18} / {r.get('dark', '-')!s:<6}{fig:>14}{over}")
    if figure_text.get('where'):
        print(f"smallest figure text at 390 px: {figure_text['px']:.1f} CSS px, {figure_text['where']} "
              f"({figure_text['points']:g} pt at {figure_text['ppi']:.0f} px per inch, image {figure_text['natural']} px shown "
              f"{figure_text['shown']:.0f} px wide)")
    print(f"figures measured at 390 px: {rep.counts.get('figures measured', 0)}; without a text record (not "
          f"measured, outside the story): {rep.counts.get('figures without a text record', 0)}")
    story = [table[n].get('height', 0) for n in STORY if n in table]
    if len(story) == len(STORY):
        told = sum(table[n].get('height', 0) for n in STORY - BEYOND)
        print(f"the story at 1280 px: {told:,} px (index and the six story pages); "
              f"{sum(story):,} px with The KV cache and Generating in batches")
        # the limit is the published site's: Quarto's pages (smalldocs draws the same pages taller)
        if re.search(r'<meta name="generator" content="quarto-', (site/'index.html').read_text(errors='replace')):
            rep.check(told <= STORY_MAX_HEIGHT, f'the story (index and the six story pages) is at most '
                                                f'{STORY_MAX_HEIGHT:,} px at 1280 px under Quarto ({told:,} px)')
    for scheme, w in worst.items():
        if w: print(f"lowest contrast, {scheme}: {w['ratio']} on {w['page']}: {w['element']} {w['text']!r} ({w['color']} on {w['background']})")
    print(f"\npages walked: {rep.counts.get('pages', 0)} (x{len(PASSES)}: {', '.join(p[0] for p in PASSES)}); "
          f"links checked: {rep.counts.get('links', 0)}; "
          f"anchors: {rep.counts.get('anchors', 0)}; images: {rep.counts.get('images', 0)}; "
          f"API entries: {rep.counts.get('api entries', 0)}; searches: {rep.counts.get('searches', 0)}; "
          f"texts checked for contrast: {rep.counts.get('texts checked', 0)}; "
          f"API tables at 390 px: {rep.counts.get('API tables', 0)}; "
          f"display equations wider than a phone: {rep.counts.get('wide equations', 0)} (both schemes, "
          f"hiding up to {rep.counts.get('most hidden', 0)} px); "
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
    ap.add_argument('--max-height', type=int, default=MAX_HEIGHT, help='fail a page taller than this at 1280 px')
    ap.add_argument('--pages', default='', help='comma-separated pages to walk (default: every page of the sidebar)')
    a = ap.parse_args()
    if a.build: subprocess.run([sys.executable, str(ROOT/'tools'/'docs.py'), 'site'], check=True)
    if not Path(a.chromium).exists(): sys.exit(f'no Chromium at {a.chromium}: apt-get install chromium, or pass --chromium PATH')
    sys.exit(walk(Path(a.site), a.chromium, a.max_height, [p for p in a.pages.split(',') if p] or None))
