"""Render an evaluation report: report.md, and PNG plots of loss curves, bpb and bpb by α bucket."""

from __future__ import annotations

import json
from pathlib import Path


def table(report: dict) -> str:
    lines = [f"{'model':<40}{'bits/byte':>11}{'ppl':>10}", "-" * 61]
    for row in report["rows"]:
        lines.append(f"{row['model']:<40}{row['bits_per_byte']:>11.4f}{row['perplexity']:>10.2f}")
    alpha = report.get("alpha")
    if alpha:
        low = next(b for b in alpha["buckets"] if b["bucket"].startswith("α ≤ 12.5%"))
        names = [r["model"] for r in report["rows"]]
        lines.append(f"at α ≤ 12.5% ({low['chunks']} chunks): "
                     + ", ".join(f"{n.split(' ')[0]} {n.split(' ', 1)[1] if ' ' in n else ''}".strip()
                                 + f" {low[n]:.4f}" for n in names))
    return "\n".join(lines)


def _curves(run_dirs: list[Path]) -> dict[str, tuple[list, list]]:
    curves = {}
    for run in run_dirs:
        path = run / "metrics.jsonl"
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines() if line]
            curves[run.name] = ([r["step"] for r in records], [r["loss"] for r in records])
    return curves


def write_report(report: dict, run_dirs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = []
    curves = _curves(run_dirs)
    if curves:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, (steps, losses) in curves.items():
            ax.plot(steps, losses, label=name)
        ax.set(xlabel="step", ylabel="training loss (nats/token)", title="Training loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss_curves.png", dpi=100)
        plt.close(fig)
        plots.append(("Training loss", "loss_curves.png"))

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh([r["model"] for r in rows], [r["bits_per_byte"] for r in rows])
    ax.set(xlabel="bits per byte (lower is better)", title=f"{report['split']} bits per byte")
    fig.tight_layout()
    fig.savefig(out / "bpb.png", dpi=100)
    plt.close(fig)
    plots.append(("Bits per byte", "bpb.png"))

    alpha = report.get("alpha")
    if alpha:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = [b["bucket"] for b in alpha["buckets"]]
        for r in rows:
            ax.plot(labels, [b[r["model"]] for b in alpha["buckets"]], marker="o", label=r["model"])
        ax.set(xlabel="chunks with overlap α at most", ylabel="bits per byte", title="Bits per byte by leakage α")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "bpb_by_alpha.png", dpi=100)
        plt.close(fig)
        plots.append(("Bits per byte by overlap α", "bpb_by_alpha.png"))

    md = [f"# Evaluation report ({report['split']} split of {report.get('corpus', 'the corpus')})", "",
          f"Sliding window {report['window']} tokens, stride {report['stride']}.", "",
          "| model | bits/byte | perplexity | tokens | bytes |", "|---|---|---|---|---|"]
    md += [f"| {r['model']} | {r['bits_per_byte']:.4f} | {r['perplexity']:.2f} | {r['tokens']:,} | {r['bytes']:,} |"
           for r in rows]
    if alpha:
        md += ["", "## Leakage (RETRO §2.6)", "",
               "α = longest common token substring between an evaluated chunk and the neighbours it is "
               "predicted with, ÷ chunk length. Buckets are cumulative: α ≤ 12.5% keeps chunks that share at "
               f"most 1/8 of their tokens contiguously with their neighbours. Mean α: {alpha['mean']:.3f}.", "",
               "| bucket | chunks | " + " | ".join(r["model"] for r in rows) + " |",
               "|---|---|" + "---|" * len(rows)]
        md += [f"| {b['bucket']} | {b['chunks']} | " + " | ".join(f"{b[r['model']]:.4f}" for r in rows) + " |"
               for b in alpha["buckets"]]
    md += [""] + [f"![{title}]({name})" for title, name in plots]
    from data.prepare import atomic_write
    atomic_write(out / "report.md", ("\n".join(md) + "\n").encode())
