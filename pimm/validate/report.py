"""validate-scaling's report: report.json, report.md, loss_curves.png and the runs' provenance
records (copied to provenance/<run>.json), all in the --out folder."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from pimm.engine.plot import pyplot, save_png
from pimm.files import write_atomic
from pimm.json_io import dumps
from pimm.validate.runs import Run, train_losses

PLOT = "loss_curves.png"


def write_report(out: Path, report: dict, runs: dict[str, Run], loss_rtol: float) -> None:
    """Everything in `out`; loss_rtol: the tolerance of the loss check, drawn on the plot."""
    copied = out / "provenance"
    copied.mkdir(exist_ok=True)
    for run in runs.values():
        if (run.run_dir / "provenance.json").exists():
            shutil.copyfile(run.run_dir / "provenance.json", copied / f"{run.run_dir.name}.json")
    train = {r.world_size: r for name, r in runs.items() if name.startswith("train-")}
    report["plot"] = PLOT if plot_losses(train, out / PLOT, loss_rtol) else None
    write_atomic(out / "report.json", dumps(report, indent=2) + "\n")  # a non-finite number: null
    write_atomic(out / "report.md", markdown(report))


def markdown(report: dict) -> str:
    lines = [
        f"# pimm validate-scaling: {report['verdict']}",
        "",
        f"Config `{report['config']}`, rank counts {', '.join(map(str, report['ranks']))}, strategy "
        f"`{report['strategy']}`, {report['steps']} steps, global batch {report['global_batch_size']}, seed "
        f"{report['seed']}; pimm {report['pimm_version']}, {report['created']}, {report['seconds']:.0f} s.",
        f"Overrides of every run: `{' '.join(report['run_overrides'])}`.",
        "",
        "| check | status | what it checks | measured |",
        "|---|---|---|---|",
    ]
    for c in report["checks"]:
        detail = c["measured"] + (f" **{c['status']}: {c['reason']}**" if c["reason"] else "")
        lines.append(f"| {c['id']} | {c['status']} | {c['title']} | {_cell(detail)} |")
    if report["throughput"]:
        lines += ["", "## Throughput", "",
                  "Median events/s of the train steps after the first; efficiency = throughput_R / "
                  "((R / R0) x throughput_R0) against the smallest rank count R0 (on one machine the ranks share "
                  "its cores: read it as a smoke test, not a benchmark).", "",
                  "| ranks | events/s | scaling efficiency |", "|---:|---:|---:|"]
        for row in report["throughput"]:
            rate, eff = row["events_per_s"], row["efficiency"]
            lines.append(f"| {row['world_size']} | {_num(rate, '.1f')} | {_num(eff, '.2f')} |")
    if report.get("plot"):
        lines += ["", f"![train loss per step at every rank count]({report['plot']})"]
    lines += ["", "## Provenance", "",
              "Each run's provenance.json is copied to `provenance/<run>.json`.", "",
              "| run | attempt | world size | strategy | config hash | train data hash | cursor | start step "
              "| outcome |",
              "|---|---:|---:|---|---|---|---|---:|---|"]
    for p in report["provenance"]:
        cursor = p["cursor"] + (" (replay warning recorded)" if p.get("replay_warning") else "") if p["cursor"] else "-"
        lines.append(f"| {p['run']} | {p['attempt']} | {p['world_size']} | {p['strategy']}"
                     f"{' (validate_only)' if p.get('validate_only') else ''} | `{(p['config_hash'] or '')[:12]}` | "
                     f"`{(p['data_hash'] or '')[:12]}` | {cursor} | {p['start_step']} | {p['outcome']} |")
    lines += ["", "Runs (under `runs/`, their output under `logs/`):", ""]
    lines += [f"- {r['name']}: {r['world_size']} rank(s), exit {r['exit']}, {r['seconds']:.1f} s, `{r['run_dir']}`"
              for r in report["runs"]]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def plot_losses(train: dict[int, Run], out_path: Path, loss_rtol: float) -> bool:
    """Train loss per step of every rank count, and each one's relative difference from the first
    with the tolerance `loss_rtol` drawn across."""
    curves = {r: train_losses(run.run_dir) for r, run in sorted(train.items())}
    curves = {r: c for r, c in curves.items() if c}
    if not curves:
        return False
    fig, (ax_loss, ax_diff) = pyplot().subplots(1, 2, figsize=(10, 4))
    (first, ref), *_ = curves.items()
    for r, losses in curves.items():
        steps = sorted(losses)
        ax_loss.plot(steps, [losses[s] for s in steps], "o-" if r == first else "x--", label=f"{r} rank(s)")
        if r != first:
            common = [s for s in steps if s in ref and math.isfinite(losses[s]) and ref[s]]
            diffs = [max(abs(losses[s] - ref[s]) / abs(ref[s]), 1e-12) for s in common]
            ax_diff.semilogy(common, diffs, "x--", label=f"{r} vs {first} rank(s)")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("train loss (mean over events)")
    ax_loss.legend()
    ax_diff.set_xlabel("optimizer step")
    ax_diff.set_ylabel("relative difference of the loss (1e-12: equal)")
    ax_diff.axhline(loss_rtol, color="grey", linestyle=":", label="tolerance")
    ax_diff.legend()
    save_png(fig, out_path)
    return True
