#!/usr/bin/env python3
"""Learning curves of drafter training runs: held-out tau against training step, read off
train.py's logs, written as CSV (one row per evaluation) and as a small SVG plot (no plotting
library needed).

    python3 gguf-drafters/train/curve.py --run A=work/v2/trainA.log --run B=work/v2/trainB.log \\
        --csv curves.csv --svg curves.svg
"""
import argparse
import re
import sys

EVAL = re.compile(r"eval step (\d+): held-out tau \(block (\d+)\) argmax ([\d.]+), selector walk ([\d.]+)")
STEP = re.compile(r"step (\d+)/\d+ loss ([\d.]+) .* (\d+) s$")
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def read(path):
    """[(step, seconds, argmax tau, selector tau)] of one log."""
    seconds, rows = {}, []
    for line in open(path, encoding="utf-8", errors="replace"):
        m = STEP.search(line)
        if m:
            seconds[int(m.group(1))] = int(m.group(3))
        m = EVAL.search(line)
        if m:
            step = int(m.group(1))
            near = max((s for s in seconds if s <= step), default=None)
            rows.append((step, seconds.get(near, 0), float(m.group(3)), float(m.group(4))))
    return rows


def svg(runs, path, width=640, height=360, pad=48):
    steps = [r[0] for _, rows in runs for r in rows]
    taus = [t for _, rows in runs for r in rows for t in r[2:]]
    if not steps:
        sys.exit("no evaluations in the logs")
    x1, y0, y1 = max(steps), min(1.0, min(taus)), max(taus) * 1.05
    sx = lambda s: pad + (width - 2 * pad) * s / x1
    sy = lambda t: height - pad - (height - 2 * pad) * (t - y0) / (y1 - y0)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
           f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">training step</text>',
           f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">held-out tau</text>']
    for i in range(5):
        t = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{pad - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:.2f}</text>')
        s = x1 * i / 4
        out.append(f'<text x="{sx(s):.1f}" y="{height - pad + 16}" text-anchor="middle">{s:.0f}</text>')
    for k, (name, rows) in enumerate(runs):
        colour = COLOURS[k % len(COLOURS)]
        for col, dash in ((3, ""), (2, ' stroke-dasharray="4 3"')):
            points = " ".join(f"{sx(r[0]):.1f},{sy(r[col]):.1f}" for r in rows)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{points}"/>')
        out.append(f'<text x="{pad + 10}" y="{pad + 16 * k}" fill="{colour}">{name} (solid: selector walk, dashed: argmax)</text>')
    out.append("</svg>")
    open(path, "w").write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, help="NAME=train.log (repeatable)")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--svg")
    args = ap.parse_args()
    runs = [(name, read(path)) for name, path in (r.split("=", 1) for r in args.run)]
    with open(args.csv, "w") as f:
        f.write("run,step,train_seconds,tau_argmax,tau_selector\n")
        for name, rows in runs:
            for step, secs, a, s in rows:
                f.write(f"{name},{step},{secs},{a},{s}\n")
    if args.svg:
        svg(runs, args.svg)


if __name__ == "__main__":
    main()
