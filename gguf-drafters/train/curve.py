#!/usr/bin/env python3
"""Learning curves of drafter training runs: held-out tau against training step, read off
train.py's logs, written as CSV (one row per evaluation) and as a small SVG plot (no plotting
library needed).

    python3 gguf-drafters/train/curve.py --run A=work/v2/trainA.log --run B=work/v2/trainB.log \\
        --csv curves.csv --svg curves.svg

The campaign's curve: tau on the held-apart prompts against labelled training tokens, one point
per shipped or candidate drafter, from a hand-kept CSV (drafter,labelled_tokens,prompts,mode,block,tau),
as SVG (no plotting library) and as PNG (matplotlib, in the training requirements):

    python3 gguf-drafters/train/curve.py --campaign curves/campaign.csv --svg curves/campaign.svg \
        --png ../learning-curve.png
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


def svg(runs, path, width=640, height=360, pad=48, xlabel="training step", dashed=True):
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
           f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">{xlabel}</text>',
           f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">held-out tau</text>']
    for i in range(5):
        t = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{pad - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:.2f}</text>')
        s = x1 * i / 4
        out.append(f'<text x="{sx(s):.1f}" y="{height - pad + 16}" text-anchor="middle">{s:.0f}</text>')
    for k, (name, rows) in enumerate(runs):
        colour = COLOURS[k % len(COLOURS)]
        for col, dash in ((3, ""), (2, ' stroke-dasharray="4 3"')) if dashed else ((3, ""),):
            points = " ".join(f"{sx(r[0]):.1f},{sy(r[col]):.1f}" for r in rows)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{points}"/>')
            out += [f'<circle cx="{sx(r[0]):.1f}" cy="{sy(r[col]):.1f}" r="3" fill="{colour}"/>' for r in rows]
        legend = " (solid: selector walk, dashed: argmax)" if dashed else ""
        out.append(f'<text x="{pad + 10}" y="{pad + 16 * k}" fill="{colour}">{name}{legend}</text>')
    out.append("</svg>")
    open(path, "w").write("\n".join(out) + "\n")


def campaign_series(path):
    """{(block, "prompts mode"): [(labelled tokens, tau, drafter)]}, each sorted by tokens."""
    import csv
    series = {}
    for row in csv.DictReader(open(path)):
        key = (int(row["block"]), f'{row["prompts"]} {row["mode"]}')
        series.setdefault(key, []).append((int(row["labelled_tokens"]), float(row["tau"]), row["drafter"]))
    return {k: sorted(v) for k, v in series.items()}


def campaign_svg(series, out):
    """One line per series (block, prompt set and mode) through the drafters' points."""
    runs = [(f"{name}, block {block}", [(n, 0, 0.0, tau) for n, tau, _ in rows]) for (block, name), rows in sorted(series.items(), reverse=True)]
    svg(runs, out, xlabel="labelled training tokens", dashed=False)


def campaign_png(series, out):
    """Two panels (block 16, block 4): held-apart tau against labelled tokens, log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    blocks = sorted({b for b, _ in series}, reverse=True)
    fig, axes = plt.subplots(1, len(blocks), figsize=(5.5 * len(blocks), 4.2), squeeze=False)
    for ax, block in zip(axes[0], blocks):
        for k, ((b, name), rows) in enumerate(sorted(series.items())):
            if b != block:
                continue
            xs, ys = [r[0] for r in rows], [r[1] for r in rows]
            ax.plot(xs, ys, marker="o", color=COLOURS[k % len(COLOURS)], label=name)
            for x, y, d in rows:
                ax.annotate(d, (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("labelled training tokens")
        ax.set_ylabel("tau on held-apart prompts (T = 0)")
        ax.set_title(f"block {block}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M DFlash 2 drafter campaign (2-core CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", help="NAME=train.log (repeatable)")
    ap.add_argument("--csv")
    ap.add_argument("--svg")
    ap.add_argument("--png", help="with --campaign: also plot it as PNG (matplotlib)")
    ap.add_argument("--campaign", help="drafter,labelled_tokens,prompts,mode,block,tau CSV: plot it to --svg / --png")
    args = ap.parse_args()
    if args.campaign:
        if not (args.svg or args.png):
            sys.exit("--campaign needs --svg or --png")
        series = campaign_series(args.campaign)
        if args.svg:
            campaign_svg(series, args.svg)
        if args.png:
            campaign_png(series, args.png)
        return
    if not args.run or not args.csv:
        sys.exit("--run and --csv are needed (or --campaign)")
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
