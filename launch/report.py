"""Render an evaluation report: report.md, and PNG plots of loss curves, bpb, bpb by α, and the database curve."""

from __future__ import annotations

import json
from pathlib import Path

from retropipe.data.stage import atomic_write_text
from retropipe.training.run.run_dir import read_run_config


def _off_row(report: dict, name: str) -> dict | None:
    """The RETRO[OFF] row of the model a RETRO row belongs to."""
    if "RETRO[" not in name:
        return None
    label = name.split(" RETRO[")[0]
    return next((r for r in report["rows"] if r["model"] == f"{label} RETRO[OFF]"), None)


def _vs_off(report: dict, row: dict) -> str:
    off = _off_row(report, row["model"])
    if off is None or off is row:
        return ""
    return f"{(row['bits_per_byte'] / off['bits_per_byte'] - 1):+.2%}"


def against_rivals(report: dict) -> list[str]:
    """One line per RETRO[ON] row and rival kind: its bits per byte against the best rival that needs
    no training (in-context, kNN-LM), and against the GPT-2 trained with its neighbours in context."""
    rows = report["rows"]
    kinds = (("the best rival that needs no training",
              [r for r in rows if "RETRO[" not in r["model"]
               and (" in-context k=" in r["model"] or r["model"].endswith(" kNN-LM"))]),
             ("the GPT-2 trained with its neighbours in context", [r for r in rows if " in-context trained" in r["model"]]))
    lines = []
    for what, rivals in kinds:
        if rivals:
            best = min(rivals, key=lambda r: r["bits_per_byte"])
            lines += [f"{r['model']}: {r['bits_per_byte'] / best['bits_per_byte']:.3f}× {what} ({best['model']}, "
                      f"{best['bits_per_byte']:.4f})" for r in rows if "RETRO[ON]" in r["model"]]
    return lines


def how_trained(checkpoint: Path, kind: str) -> str | None:
    """One line on how a checkpoint's model (of `kind`) was trained, from its run's config.yaml;
    None where there is no such file, or it is not a training run's config of this model.

    A warm-started model (train.init_from) has trained longer than its own steps say, so a reader
    comparing it with a baseline of the same steps must be told: its RETRO[OFF] row is the fair
    comparison for what retrieval adds.
    """
    cfg = read_run_config(checkpoint.parent if checkpoint.name == "model" else checkpoint) or {}
    train, model = cfg.get("train"), cfg.get("model")
    if not isinstance(train, dict) or not isinstance(model, dict) or model.get("kind") != kind:
        return None  # e.g. a bare model directory beside some other config.yaml
    name = {"gpt2": "GPT-2", "retro": "RETRO"}.get(kind, kind)
    line = f"{name}, {train.get('steps', '?')} steps of training, seed {train.get('seed', '?')}"
    if train.get("init_from"):
        line += f", starting from the weights of {train['init_from']} (train.init_from)"
        if kind == "retro":
            frozen = "its trunk frozen (a RETRO-fit)" if model.get("freeze_trunk") else "its trunk trained further"
            line += (f", {frozen}: it has trained longer than its steps say, so compare its RETRO rows with "
                     "each other (ON against OFF), not with a model trained from scratch")
    return line


def _short(name: str) -> str:
    """A row's name without its model label when there is one RETRO: "RETRO[ON] k=2", "(baseline)"."""
    return name.split(" ", 1)[1] if " " in name else name


def slice_harm(report: dict) -> list[dict]:
    """Per RETRO model and α slice: ON and SHUFFLED against OFF ({"model", "slice", "chunks", "on_vs_off",
    "shuffled_vs_off"}), for the report's do-no-harm table."""
    alpha, out = report.get("alpha") or {}, []
    for off in (r["model"] for r in report["rows"] if r["model"].endswith("RETRO[OFF]")):
        label = off[:-len(" RETRO[OFF]")]
        on = next((r["model"] for r in report["rows"] if r["model"].startswith(f"{label} RETRO[ON]")), None)
        shuffled = f"{label} RETRO[SHUFFLED]"
        for piece in alpha.get("slices") or []:
            if piece.get(off) is None:
                continue
            out.append({"model": label, "slice": piece["slice"], "chunks": piece["chunks"],
                        "on_vs_off": piece[on] / piece[off] - 1 if on and piece.get(on) is not None else None,
                        "shuffled_vs_off": piece[shuffled] / piece[off] - 1 if piece.get(shuffled) is not None
                        else None})
    return out


def table(report: dict) -> str:
    """The terminal summary: every row, its change against RETRO[OFF], the high- and low-overlap buckets."""
    lines = [f"{'model':<44}{'bits/byte':>11}{'vs OFF':>9}{'ppl':>10}", "-" * 74]
    for row in report["rows"]:
        lines.append(f"{row['model']:<44}{row['bits_per_byte']:>11.4f}{_vs_off(report, row):>9}{row['perplexity']:>10.2f}")
    lines += against_rivals(report)
    alpha = report.get("alpha")
    if alpha:
        lines.append("by α slice (bits/byte; each chunk in one slice):")
        for piece in alpha.get("slices") or []:
            values = ", ".join(f"{_short(r['model'])} {piece[r['model']]:.4f}" for r in report["rows"]
                               if piece.get(r["model"]) is not None)
            lines.append(f"  {piece['slice']:<22}{piece['chunks']:>6} chunks: {values or '-'}")
    curve = report.get("database_curve")
    if curve:
        lines.append("database-size curve (RETRO[ON] bits/byte): " + "; ".join(
            f"{p['tokens']:,} tokens: " + ", ".join(f"{m} {p[m]:.4f}" for m in curve["models"]) for p in curve["points"]))
    return "\n".join(lines)


def write_report(report: dict, run_dirs: list[Path], out: Path) -> None:
    """report.md, with its plots beside it, into out (run_dirs: the runs whose loss curves it shows)."""
    plots = _plots(report, run_dirs, out)
    md = _results_section(report) + _leakage_section(report) + _database_curve_section(report)
    md += [""] + [f"![{title}]({name})" for title, name in plots]
    atomic_write_text(out / "report.md", "\n".join(md) + "\n")


def _results_section(report: dict) -> list[str]:
    """The report's title, what was scored, the rows' table and how each model was trained."""
    rows = report["rows"]
    source = (f"held-out corpus {report['corpus']}" if report.get("heldout_corpus")
              else f"{report['split']} split of {report.get('corpus', 'the corpus')}")
    md = [f"# Evaluation report ({source})", "",
          f"Sliding window {report['window']} tokens, stride {report['stride']}; {report['chunks']:,} chunks; "
          f"scored in {report.get('precision', 'fp32')}; neighbours from {report.get('database', 'the database')}.", "",
          "RETRO[ON] reads each chunk's own neighbours, RETRO[OFF] none, RETRO[SHUFFLED] those retrieved for a "
          "chunk of another document, as retrieved (same count, text that does not belong; neither lined up nor "
          "filtered): ON below SHUFFLED is the use of what the neighbours say; SHUFFLED near OFF means the model "
          "is not misled by neighbours that do not hold its text.", "",
          "| model | bits/byte | vs RETRO[OFF] | perplexity | tokens | bytes |", "|---|---|---|---|---|---|"]
    md += [f"| {r['model']} | {r['bits_per_byte']:.4f} | {_vs_off(report, r) or '–'} | {r['perplexity']:.2f} | "
           f"{r['tokens']:,} | {r['bytes']:,} |" for r in rows]
    rival_lines = against_rivals(report)
    if rival_lines:
        md += ["", "The rivals read the same neighbours with the baseline and no training: in-context puts the "
               "neighbours of the chunk before before its text (In-Context RALM), kNN-LM interpolates it with a "
               "nearest-neighbour distribution over the database's tokens (λ, k, T chosen on the training split: "
               + ", ".join(f"λ {v['lambda']}, k {v['k']}, T {v['temperature']:.3g}"
                           for v in (report.get("knn_lm") or {}).values()) + ")."]
        md += ["", *[f"- {line}" for line in rival_lines]]
    trained = report.get("trained") or {}
    if any(trained.values()):
        md += ["", "How each model was trained:", ""] + [f"- {name}: {line}" for name, line in trained.items() if line]
    return md


def _leakage_section(report: dict) -> list[str]:
    """Leakage (RETRO §2.6): the rows by α bucket and by α slice, and each slice's harm; none without α."""
    alpha, rows = report.get("alpha"), report["rows"]
    if not alpha:
        return []
    md = ["", "## Leakage (RETRO §2.6)", "",
          "α = longest common token substring between an evaluated chunk and the neighbours it is "
          "predicted with, ÷ chunk length. The first buckets are cumulative: α ≤ 12.5% keeps chunks that "
          "share at most 1/8 of their tokens contiguously with their neighbours; α ≥ 50% holds the chunks "
          f"whose neighbours contain half of them or more. Mean α: {alpha['mean']:.3f}.", "",
          "| bucket | chunks | " + " | ".join(r["model"] for r in rows) + " |",
          "|---|---|" + "---|" * len(rows)]
    md += [f"| {b['bucket']} | {b['chunks']} | " + " | ".join(
        f"{b[r['model']]:.4f}" if b.get(r["model"]) is not None else "–" for r in rows) + " |"
        for b in alpha["buckets"]]
    md += ["", "### By α slice", "",
           "Each chunk in exactly one slice, so a slice shows harm that a cumulative bucket averages away: "
           "RETRO must not be worse with its neighbours (ON) than without them (OFF) in any slice, nor with "
           "another document's neighbours (SHUFFLED: those retrieved for a chunk of another document, as "
           "retrieved, neither lined up nor filtered; the same on every evaluation path).", "",
           "| slice | chunks | " + " | ".join(r["model"] for r in rows) + " |", "|---|---|" + "---|" * len(rows)]
    md += [f"| {g['slice']} | {g['chunks']} | " + " | ".join(
        f"{g[r['model']]:.4f}" if g.get(r["model"]) is not None else "–" for r in rows) + " |"
        for g in alpha.get("slices") or []]
    harm = slice_harm(report)
    if harm:
        md += ["", "| model | slice | chunks | ON vs OFF | SHUFFLED vs OFF |", "|---|---|---|---|---|"]
        md += [f"| {h['model']} | {h['slice']} | {h['chunks']} | "
               + " | ".join(f"{h[k]:+.2%}" if h[k] is not None else "–" for k in ("on_vs_off", "shuffled_vs_off"))
               + " |" for h in harm]
    return md


def _database_curve_section(report: dict) -> list[str]:
    """The database-size curve's table; none without the curve."""
    curve = report.get("database_curve")
    if not curve:
        return []
    md = ["", "## Database-size curve (RETRO paper, Fig. 1 right)", "",
          "The same model, RETRO[ON], retrieving from growing databases: the training split, then a "
          "seeded random share of the further corpora's documents.", "",
          "| database | tokens | " + " | ".join(curve["models"]) + " |", "|---|---|" + "---|" * len(curve["models"])]
    md += [f"| {p['database']} | {p['tokens']:,} | " + " | ".join(f"{p[m]:.4f}" for m in curve["models"]) + " |"
           for p in curve["points"]]
    return md


def _plots(report: dict, run_dirs: list[Path], out: Path) -> list[tuple[str, str]]:
    """The report's PNG plots, written into out → (title, file name) of each, in the report's order."""
    plt = _pyplot()
    plots = []
    for draw, source in ((_loss_figure, run_dirs), (_bpb_figure, report), (_alpha_figure, report),
                         (_database_curve_figure, report)):
        drawn = draw(plt, source)
        if drawn is not None:
            fig, name, title = drawn
            fig.tight_layout()
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            plots.append((title, name))
    return plots


def _pyplot():
    """matplotlib.pyplot, drawing to files only (the Agg backend)."""
    # Local: chosen when a report is drawn, so that importing this module sets no caller's backend.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _loss_figure(plt, run_dirs: list[Path]):
    """The training loss of every run with a metrics.jsonl → (figure, file name, title); None without one."""
    curves = _curves(run_dirs)
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, (steps, losses) in curves.items():
        ax.plot(steps, losses, label=name)
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title="Training loss")
    ax.legend()
    return fig, "loss_curves.png", "Training loss"


def _curves(run_dirs: list[Path]) -> dict[str, tuple[list, list]]:
    curves = {}
    for run in run_dirs:
        path = run / "metrics.jsonl"
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines() if line]
            curves[run.name] = ([r["step"] for r in records], [r["loss"] for r in records])
    return curves


def _bpb_figure(plt, report: dict):
    """Every row's bits per byte, as bars → (figure, file name, title)."""
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh([r["model"] for r in rows], [r["bits_per_byte"] for r in rows])
    ax.set(xlabel="bits per byte (lower is better)", title=f"{report['split']} bits per byte")
    return fig, "bpb.png", "Bits per byte"


def _alpha_figure(plt, report: dict):
    """Bits per byte by overlap α, the cumulative buckets beside the disjoint slices; None without α."""
    alpha, rows = report.get("alpha"), report["rows"]
    if not alpha:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, key, title in ((axes[0], "buckets", "cumulative buckets (the paper's)"),
                           (axes[1], "slices", "disjoint slices (where harm shows)")):
        groups = [g for g in alpha.get(key) or [] if all(g.get(r["model"]) is not None for r in rows)]
        for r in rows:
            ax.plot([g[key[:-1]] for g in groups], [g[r["model"]] for g in groups], marker="o", label=r["model"])
        ax.set(xlabel="chunks with overlap α", title=title)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    axes[0].set(ylabel="bits per byte")
    axes[1].legend(fontsize=7)
    return fig, "bpb_by_alpha.png", "Bits per byte by overlap α"


def _database_curve_figure(plt, report: dict):
    """RETRO[ON]'s bits per byte against the database's tokens; None without the curve."""
    curve = report.get("database_curve")
    if not curve:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    tokens = [p["tokens"] for p in curve["points"]]
    for model in curve["models"]:
        ax.plot(tokens, [p[model] for p in curve["points"]], marker="o", label=f"{model} RETRO[ON]")
    ax.set(xscale="log", xlabel="database tokens", ylabel="bits per byte",
           title="Bits per byte against database size")
    ax.legend(fontsize=7)
    return fig, "database_curve.png", "Database-size curve"
