"""What the measurement pages (nbs/95_measurements.ipynb, nbs/96_measurements_gpu.ipynb) use to turn bench/*.json into
text: each file read once, the line that opens each section (machine, torch, threads, date, command), and tables."""
import json, re
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def load(names: list) -> dict:
    "bench/<name>.json for each name, read."
    return {name: json.loads((BENCH/f'{name}.json').read_text()) for name in names}


def machine_of(b: dict) -> str:
    "The machine as the file records it: the GPU's name, or the CPU's model and cores."
    if b.get('device', 'cpu') != 'cpu': return b['device']  # else the CPU's model
    m = b['machine']
    if isinstance(m, dict): return f"{m['cpu_model']} CPU, {m['cpu_count']} cores"
    return f"{m} CPU, cores not recorded"


def measured(b: dict) -> str:
    "One line: machine, torch, threads, date and command."
    n = b.get('threads')
    parts = [f"**{machine_of(b)}**", f"torch {b['torch']}",
             f"{n} torch thread{'s' * (n != 1)}" if n else "threads not recorded",
             f"measured {b['date']}", f"`{b['command']}`"]
    return " · ".join(parts)


def table(head: list, rows: list) -> str:
    "A Markdown table; columns of numbers (or dashes) right-aligned, the others left."
    rows = [[str(x) for x in r] for r in rows]
    numeric = [i > 0 and all(re.match(r'[\d–$]', r[i]) for r in rows)
               for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("--:" if n else ":--" for n in numeric) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def mib(nbytes) -> str: return f"{nbytes / 2**20:,.1f}"


def side(*captioned) -> str:
    "Narrow tables side by side on a wide page, one under another on a phone."
    boxes = [f"<div>\n\n{caption}\n\n{t}\n\n</div>" for caption, t in captioned]
    return '<div class="side-by-side">\n\n' + "\n\n".join(boxes) + "\n\n</div>"
