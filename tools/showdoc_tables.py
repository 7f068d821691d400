# No library fits: nbdev's own renderer repeats each exported definition as a signature under its shown source.
"""The site's `show_doc`: a parameter table under an exported definition, never its signature a second time.

Every exported cell is `#| exports`, so the page shows the definition's source as it is (`class SelfAttention(...)`).
nbdev then adds `show_doc(SelfAttention)`, whose default renderer prints a heading and the signature again, rebuilt
from the object (`def SelfAttention(`, `dtype:NoneType=None`). `tools/docs.py` swaps in `ParamTables`, which prints
what the source does not show at a glance: a table of the parameters (type, default, the docment) of the function,
or of the class and each of its public methods that take any, plus the anchors that the site's API links point to.
Each table sits in a `::: {.api-params}` div (both renderers read Pandoc's fenced divs), so that nbs/styles.css can
lay it out for a phone, where four columns do not fit, inside a folded `<details>`: the source above it shows each
docment beside its parameter already.
"""
import html, inspect

from fastcore.docments import docments


def _anchor(qualname: str) -> str: return qualname.lower()


def _type_name(anno) -> str:
    "A readable type: `int or None` (a `|` would split the table's cell); '' when none was given."
    if anno is inspect.Parameter.empty or anno is None or anno is type(None): return ''
    name = anno if isinstance(anno, str) else str(anno) if '|' in str(anno) else getattr(anno, '__name__', str(anno))
    name = name.replace('typing.', '').replace('torch.', '').replace('NoneType', 'None')
    return name.replace(' | ', ' or ').replace('|', ' or ')


def _default(p) -> str:
    d = p.get('default', inspect.Parameter.empty)
    return '' if d is inspect.Parameter.empty else f'`{d!r}`'


def _cell(text) -> str: return html.escape(str(text or '')).replace('|', '\\|').replace('\n', ' ')


def _table(fn, title: str) -> str:
    "A Markdown table of `fn`'s parameters and return value; '' when it documents none of them."
    try: docs = docments(fn, full=True)
    except (TypeError, ValueError): return ''
    rows = []
    for name, p in docs.items():
        if name in ('self', 'cls') or (name == 'return' and not p.get('docment')): continue
        kind = '**returns**' if name == 'return' else f'`{name}`'
        typ = _type_name(p.get('anno', inspect.Parameter.empty))
        rows.append(f"| {kind} | {f'`{typ}`' if typ else ''} | {_default(p)} | {_cell(p.get('docment'))} |")
    if not rows or not any(p.get('docment') for n, p in docs.items() if n not in ('self', 'cls')): return ''
    # In a div of its own (`.api-params`), which nbs/styles.css stacks into one block per parameter on a phone.
    table = f"| {title} | type | default | |\n|:--|:--|:--|:--|\n" + '\n'.join(rows)
    # Folded: the shown source already carries each docment beside its parameter, so the table is a reference
    # a reader opens, not a second copy in the way of the story (60 tables took 42,000 px of the site).
    return (f'<details class="api-details">\n<summary>Parameters of {_inline(title)}</summary>\n\n'
            f"::: {{.api-params}}\n\n{table}\n\n:::\n\n</details>")


def _inline(title: str) -> str:
    "A Markdown title (`name(…)`) as HTML: a summary line is HTML, and Markdown inside it is not read."
    return html.escape(title).replace('`', '<code>', 1).replace('`', '</code>', 1)


class ParamTables:
    "Renders `show_doc(sym)` as the anchors of `sym` (and its methods) plus their parameter tables."
    def __init__(self, sym, name: str | None = None, title_level: int = 3):
        self.sym, self.name = sym, name or getattr(sym, '__qualname__', getattr(sym, '__name__', str(sym)))

    def _repr_markdown_(self) -> str:
        sym, parts = self.sym, []
        anchors = [_anchor(self.name)]
        if inspect.isclass(sym):
            methods = {n: f for n, f in vars(sym).items() if inspect.isfunction(f)}
            anchors += [_anchor(f'{self.name}.{n}') for n in methods]
            init = methods.get('__init__')
            if init: parts.append(_table(init, f'`{self.name}(…)`'))
            for n, f in methods.items():
                if not n.startswith('_'): parts.append(_table(f, f'`.{n}(…)`'))
        else:
            parts.append(_table(sym, f'`{self.name}(…)`'))
        spans = ''.join(f'<span id="{a}" class="api-anchor"></span>' for a in anchors)
        tables = '\n\n'.join(p for p in parts if p)
        return f'{spans}\n\n{tables}\n' if tables else spans + '\n'

    def __repr__(self) -> str: return self._repr_markdown_()
