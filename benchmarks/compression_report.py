"""The tables of benchmarks/results/compression/README.md, generated from the JSON files.

    python benchmarks/compression_report.py            # rewrites every generated table in the README
    python benchmarks/compression_report.py --check    # exit 1 if a table differs from its JSONs
    python benchmarks/compression_report.py --print tiny_600

A generated table sits between `<!-- table: NAME -->` and `<!-- /table -->` in the README;
everything else there is prose. Each row names its JSON (paths relative to
benchmarks/results/) and the configuration in it; losses, gaps, bytes and times are read
from the JSON's `results`, so a figure lives in its JSON and is printed from there.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import NamedTuple

import readme_tables

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
README = os.path.join(RESULTS, "compression", "README.md")
NOISE = 0.005  # reruns of one configuration moved its loss by up to ~0.5% of none's: "changed" above it


class Ref(NamedTuple):
    file: str            # relative to benchmarks/results
    config: str
    run: str | None = None  # "loopback_w2", "100mbit_w2", ...; None: the JSON's only (or first) run


@functools.lru_cache(maxsize=None)
def _load(file: str) -> dict | None:
    path = os.path.join(RESULTS, file)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def measured(ref: Ref, baseline: Ref | None = None) -> dict | None:
    """The row `ref` names with what the tables print (None: not in its JSON)."""
    data = _load(ref.file)
    if data is None:
        return None
    runs = data["results"]
    run = runs.get(ref.run) if ref.run else next(iter(runs.values()))
    if run is None or ref.config not in run:
        return None
    r = run[ref.config]
    if baseline:
        other = measured(baseline)
        base = other["raw"] if other else None
    else:
        base = run.get("none")
    out = {"raw": r, "loss": r["final_val_loss"], "bytes": r["bytes_per_step"], "ratio": r["ratio"],
           "run_ratio": r.get("run_ratio"), "link": r.get("link_bytes_per_worker"), "step_ms": 1000 * r["step_time_s"],
           "steps": r["val_loss"][-1][0], "file": ref.file}
    if base:
        target = base["final_val_loss"]
        out["gap"] = (r["final_val_loss"] - target) / target
        reached = [(s, w) for (s, l), (w, _) in zip(r["val_loss"], r.get("val_curve_wall", [])) if l <= target + 1e-9]
        if reached:
            out["ttq_step"], out["ttq_s"] = reached[0]
            out["ttq_vs_none"] = reached[0][1] / base["train_s"]  # old JSONs: no curve, no train_s
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


COLUMNS = {  # key: (header, cell)
    "bytes": ("handed / step", lambda m: f"{m['bytes']:,.0f}"),
    "ratio": ("ratio", lambda m: f"{m['ratio']:.1f}x"),
    "run_ratio": ("whole run", lambda m: "-" if m["run_ratio"] is None else f"{m['run_ratio']:.1f}x"),
    "link": ("transmitted / worker", lambda m: "-" if m["link"] is None else f"{m['link']:,.0f}"),
    "step": ("step", lambda m: f"{m['step_ms']:,.0f} ms"),
    "steps": ("steps", lambda m: f"{m['steps']}"),
    "loss": ("val loss", lambda m: f"{m['loss']:.4f}"),
    "gap": ("vs none", lambda m: _pct(m.get("gap"))),
    "ttq": ("reached none's final loss", lambda m: "never" if "ttq_s" not in m
            else f"{m['ttq_s']:,.0f} s (step {m['ttq_step']})"),
    "ttq_vs_none": ("vs none", lambda m: "-" if "ttq_vs_none" not in m else f"{m['ttq_vs_none']:.2f}"),
    "json": ("JSON", lambda m: f"`{m['file']}`"),
}


def table(columns: list[str], rows: list[tuple[str, Ref]], baseline: Ref | None = None,
          extra: tuple[str, Ref] | None = None) -> list[str]:
    """A markdown table: one row per (label, Ref); `extra` adds a gap column against another
    row (e.g. ("vs none(sgd)", Ref(...)))."""
    headers = ["configuration"] + [COLUMNS[c][0] for c in columns] + ([extra[0]] if extra else [])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for label, ref in rows:
        m = measured(ref, baseline)
        if m is None:
            lines.append(f"| {label} | not run |" + " |" * (len(headers) - 2))
            continue
        cells = [COLUMNS[c][1](m) for c in columns]
        if extra:
            cells.append(_pct(measured(ref, extra[1]).get("gap")))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def reruns(rows: list[tuple[str, Ref, Ref]], bases: tuple[Ref, Ref] | None = None,
           against: str = "none") -> list[str]:
    """Old against new, each against its own run's none, or against `bases` (old, new)."""
    lines = [f"| configuration | old JSON | old loss | old vs {against} | new JSON | new loss | new vs {against} "
             "| changed? |", "|---|---|---|---|---|---|---|---|"]
    for label, old, new in rows:
        o, n = measured(old, bases and bases[0]), measured(new, bases and bases[1])
        if n is None:
            lines.append(f"| {label} | `{old.file}` | {o['loss']:.4f} | {_pct(o.get('gap'))} | "
                         "not rerun | | | |")
            continue
        moved = n["gap"] - o["gap"] if "gap" in n and "gap" in o else (n["loss"] - o["loss"]) / o["loss"]
        verdict = f"**changed** ({100 * moved:+.2f} points)" if abs(moved) > NOISE else \
            f"no ({100 * moved:+.2f} points)"
        lines.append(f"| {label} | `{old.file}` | {o['loss']:.4f} | {_pct(o.get('gap'))} | `{new.file}` | "
                     f"{n['loss']:.4f} | {_pct(n.get('gap'))} | {verdict} |")
    return lines


def binary(names: list[tuple[str, str]]) -> list[str]:
    """The binary's runs (benchmarks/results/compression/binary_*.json: results.json + command)."""
    runs = {label: _load(f"compression/{file}") for label, file in names}
    none = next((r for r in runs.values() if r and r["results"] and r["results"].get("compression") in
                 (None, "none")), None)
    lines = ["| run | val loss | vs none | ratio over the run | bytes sent | date | JSON |",
             "|---|---|---|---|---|---|---|"]
    for (label, file), run in zip(names, runs.values()):
        if run is None or not run["results"]:
            lines.append(f"| {label} | not run | | | | | `compression/{file}` |")
            continue
        res = run["results"]
        gap = _pct((res["loss"] - none["results"]["loss"]) / none["results"]["loss"]) if none else "-"
        ratio = f"{res['compression_ratio']:.1f}x" if "compression_ratio" in res else "1.0x"
        sent = f"{res['wire_bytes_sent'] / 1e6:,.0f} MB" if "wire_bytes_sent" in res else "-"
        lines.append(f"| {label} | {res['loss']:.4f} | {gap} | {ratio} | {sent} | {run['date'][:10]} | "
                     f"`compression/{file}` |")
    return lines


def survey_300() -> list[str]:
    """compression.json: gpt_tiny, 300 steps, the default policy, step times on loopback and 100 Mbit/s."""
    names = ["none", "fp16", "bf16", "int8", "topk(0.01)", "topk(0.01)+emb", "powersgd(4)", "powersgd(4)+emb", "sign"]
    lines = ["| configuration | handed / step | ratio | step, loopback | step, 100 Mbit/s | val loss | vs none |",
             "|---|---|---|---|---|---|---|"]
    for name in names:
        fast = measured(Ref("compression.json", name, "loopback"))
        slow = measured(Ref("compression.json", name, "shaped"))
        lines.append(f"| {name} | {fast['bytes']:,.0f} | {fast['ratio']:.1f}x | {fast['step_ms']:.0f} ms | "
                     f"{slow['step_ms']:.0f} ms | {fast['loss']:.4f} | {_pct(fast.get('gap'))} |")
    return lines


def spectrum() -> list[str]:
    """gradient_spectrum.json: the median matrix's share of the squared norm in its top r singular values."""
    data = _load("gradient_spectrum.json")
    ranks = [str(r) for r in data["ranks"]]
    lines = ["| model (width, tokens per replica) | step | " + " | ".join(f"r = {r}" for r in ranks) + " |",
             "|---|---|" + "---|" * len(ranks)]
    for model, m in data["results"].items():
        for step in ("300", "600"):
            share = m["at_step"][step]["median_matrix_share_in_top_r"]
            lines.append(f"| {model} ({m['dim']}, {m['tokens_per_replica']}) | {step} | "
                         + " | ".join(f"{share[r]:.2f}" for r in ranks) + " |")
    return lines


def _tiny(file: str, *configs: str, run=None) -> list[tuple[str, Ref]]:
    return [(c, Ref(file, c, run)) for c in configs]


NEW_TINY, NEW_WIDE = "compression/tiny_600.json", "compression/wide_600.json"
DGC_ADAM_M0 = [f"dgc_adam(0.01)+all+freeze{f}+momentum0" for f in (60, 120, 200)] + \
    ["dgc_adam(0.01)+all+freeze120+momentum0.5"]
DGC_ADAM_M09 = [f"dgc_adam({r})+all+freeze{f}+momentum0.9" for r, f in
                [(0.01, 60), (0.01, 120), (0.01, 200), (0.0125, 120), (0.025, 120), (0.025, 200)]]
ONEBIT_TINY = ["onebit_adam+all+every2", "onebit_adam+all+every2+freeze90", "onebit_adam+all+every2+freeze120",
               "onebit_adam+fp16start"]
DGC_TINY = ["dgc(0.01)", "dgc(0.008)", "dgc(0.008)-masking"]
DGC_TINY_MORE = ["dgc(0.01)+start120", "dgc(0.008)+start120", "dgc(0.01)+warm200", "dgc(0.01)+warm300"]
WIDE_MORE = ["dgc_adam(0.01)+all+freeze120+momentum0", "onebit_adam+all+every2+freeze90",
             "onebit_adam+all+every2+freeze120", "onebit_adam+fp16start", "dgc(0.001)", "onebit_adam+emb+every2",
             "onebit_adam+emb+every4"]
OLD_TINY = {"none": "tiny_600.json", "onebit_adam": "tiny_600.json", "dgc(0.001)": "tiny_600.json",
            "onebit_adam+all+every2": "tiny_600_onebit_all.json",
            "onebit_adam+all+every2+freeze90": "tiny_600_onebit_freeze90.json",
            "onebit_adam+all+every2+freeze120": "tiny_600_onebit_freeze120.json",
            "onebit_adam+fp16start": "tiny_600_fp16start.json",
            "dgc_adam(0.01)+all+freeze60+momentum0": "tiny_600_dgc_adam5.json",
            "dgc_adam(0.01)+all+freeze120+momentum0": "tiny_600_dgc_adam4.json",
            "dgc_adam(0.01)+all+freeze200+momentum0": "tiny_600_dgc_adam5.json",
            "dgc_adam(0.01)+all+freeze120+momentum0.5": "tiny_600_dgc_adam4.json",
            **dict(zip(DGC_ADAM_M09, ["tiny_600_dgc_adam.json"] * 2 + ["tiny_600_dgc_adam2.json"] * 2
                       + ["tiny_600_dgc_adam3.json"] * 2)),
            "none(sgd)": "tiny_600_sgd.json", "dgc(0.01)": "tiny_600_sgd.json",
            "dgc(0.008)": "tiny_600_dgc_mask.json", "dgc(0.008)-masking": "tiny_600_dgc_mask.json",
            **dict(zip(DGC_TINY_MORE, ["tiny_600_dgc_start.json"] * 2 + ["tiny_600_dgc_warmup.json"] * 2))}
NEW_TINY_FILE = {**dict.fromkeys(["none", "onebit_adam", "dgc(0.001)"], NEW_TINY),
                 **dict.fromkeys(ONEBIT_TINY, "compression/tiny_600_onebit.json"),
                 **dict.fromkeys(DGC_ADAM_M0, "compression/tiny_600_dgc_adam.json"),
                 **dict.fromkeys(DGC_ADAM_M09, "compression/tiny_600_dgc_adam_m09.json"),
                 **dict.fromkeys(["none(sgd)", *DGC_TINY], "compression/tiny_600_dgc.json"),
                 **dict.fromkeys(DGC_TINY_MORE, "compression/tiny_600_dgc_more.json")}
OLD_WIDE = {c: Ref(file, c) for c, file in [
    ("none", "wide_fp16start.json"), ("onebit_adam", "wide_100m.json"),
    ("onebit_adam+all+every2", "wide_onebit_all.json"),
    ("dgc_adam(0.01)+all+freeze60+momentum0", "wide_dgc_adam.json"),
    ("dgc_adam(0.01)+all+freeze120+momentum0", "wide_dgc_adam.json"),
    ("onebit_adam+all+every2+freeze90", "wide_onebit_freeze90.json"),
    ("onebit_adam+all+every2+freeze120", "wide_onebit_all.json"),
    ("onebit_adam+fp16start", "wide_fp16start.json"), ("dgc(0.001)", "wide_100m.json"),
    ("onebit_adam+emb+every2", "wide_onebit_every.json"), ("onebit_adam+emb+every4", "wide_onebit_every.json")]}
NEW_WIDE_FILE = {c: (NEW_WIDE if c in ("none", "onebit_adam", "onebit_adam+all+every2",
                                       "dgc_adam(0.01)+all+freeze60+momentum0") else "compression/wide_600_more.json")
                 for c in OLD_WIDE}
EQUAL = ["bytes", "ratio", "run_ratio", "link", "loss", "gap"]
TTQ = ["steps", "step", "loss", "ttq", "ttq_vs_none"]


def _sgd_gap(file: str) -> tuple[str, Ref]:
    return ("vs none(sgd)", Ref(file, "none(sgd)"))


TABLES = {
    "reruns_tiny": lambda: reruns([(c, Ref(OLD_TINY[c], c), Ref(NEW_TINY_FILE[c], c)) for c in OLD_TINY]),
    "reruns_dgc_sgd": lambda: reruns(
        [(c, Ref(OLD_TINY[c], c), Ref(NEW_TINY_FILE[c], c)) for c in ["dgc(0.001)", *DGC_TINY, *DGC_TINY_MORE]],
        (Ref("tiny_600_sgd.json", "none(sgd)"), Ref("compression/tiny_600_dgc.json", "none(sgd)")), "none(sgd)"),
    "reruns_wide": lambda: reruns([(c, OLD_WIDE[c], Ref(NEW_WIDE_FILE[c], c)) for c in OLD_WIDE]),
    "binary": lambda: binary([("none (AdamW)", "binary_tiny_600_none.json"),
                              ("onebit_adam, every tensor, every 2nd step, freeze 120",
                               "binary_tiny_600_onebit_adam.json"),
                              ("dgc_adam(0.01), every tensor, freeze 60", "binary_tiny_600_dgc_adam.json")]),
    "tiny_600": lambda: table(EQUAL, [(c, Ref(NEW_TINY_FILE[c], c)) for c in
                                      ["none", "onebit_adam", *ONEBIT_TINY, *DGC_ADAM_M0, *DGC_ADAM_M09]]),
    "tiny_600_dgc": lambda: table(EQUAL, [(c, Ref(NEW_TINY_FILE[c], c)) for c in
                                          ["none(sgd)", "dgc(0.001)", *DGC_TINY, *DGC_TINY_MORE]],
                                  extra=_sgd_gap("compression/tiny_600_dgc.json")),
    "wide_600": lambda: table(EQUAL, [(c, Ref(NEW_WIDE_FILE[c], c)) for c in OLD_WIDE]),
    # history: measured before the compressors took the user's optimizer
    "survey_300": survey_300,
    "spectrum": spectrum,
    "time_to_quality": lambda: table(["bytes", "ratio", "run_ratio"] + TTQ, [
        ("100 Mbit/s: none", Ref("time_to_quality.json", "none", "100mbit_w2")),
        ("100 Mbit/s: powersgd(4)+fp16start120+16-8-4",
         Ref("time_to_quality.json", "powersgd(4)+fp16start120+16-8-4", "100mbit_w2")),
        ("1 Gbit/s: none", Ref("time_to_quality.json", "none", "1gbit_w2")),
        ("1 Gbit/s: auto (picked fp16)", Ref("time_to_quality.json", "auto", "1gbit_w2"))]),
    "bytes_w4": lambda: table(["bytes", "link", "step"], [
        (f"{c}, {w} workers", Ref("wide_w4_timed.json", c, f"loopback_w{w}"))
        for c in ["none", "onebit_adam", "powersgd(4)+fp16start120+16-8-4", "dgc(0.001)"] for w in (2, 4)]),
    "ttq_100m": lambda: table(TTQ, [
        ("none (wide_100m)", Ref("wide_100m.json", "none")),
        ("onebit_adam", Ref("wide_100m_longer.json", "onebit_adam")),
        ("powersgd(4)+start", Ref("wide_100m_longer.json", "powersgd(4)+start")),
        ("none (wide_100m_psgd)", Ref("wide_100m_psgd.json", "none")),
        ("powersgd(4)+start120+16-8-4", Ref("wide_100m_psgd.json", "powersgd(4)+start120+16-8-4")),
        ("none (wide_100m_onebit_every2)", Ref("wide_100m_onebit_every2.json", "none")),
        ("onebit_adam+all+every2", Ref("wide_100m_onebit_every2.json", "onebit_adam+all+every2")),
        ("dgc_adam(0.01)+all+freeze60 (none: wide_100m_onebit_every2's)",
         Ref("wide_100m_dgc_adam.json", "dgc_adam(0.01)+all+freeze60+momentum0"))]),
    "wide_100m": lambda: table(["bytes", "ratio", "link", "step", "loss", "gap"], _tiny(
        "wide_100m.json", "none", "dgc(0.001)", "powersgd(4)+start", "onebit_adam")),
    "psgd_wide": lambda: table(EQUAL, [*_tiny("wide_psgd_sweep.json", "powersgd(4)+start", "powersgd(4)+start120",
                                              "powersgd(4)+start+8to300", "powersgd(4)+start+16-8-4"),
                                       *_tiny("wide_psgd_sweep2.json", "powersgd(4)+start120+16-8-4",
                                              "powersgd(4)+start120+16-8-4@250"),
                                       *_tiny("wide_fp16start.json", "powersgd(4)+fp16start120+16-8-4"),
                                       *_tiny("wide_psgd_bf16.json", "powersgd(4)+bf16+start120+16-8-4")]),
    "psgd_tiny": lambda: table(EQUAL, [*_tiny("tiny_600.json", "powersgd(4)+start"),
                                       *_tiny("tiny_600_psgd.json", "powersgd(4)+start120+16-8-4"),
                                       *_tiny("tiny_600_fp16start.json", "powersgd(4)+fp16start120+16-8-4"),
                                       *_tiny("tiny_600_psgd_frontier.json", "powersgd(4)+bf16+start120+16-8-4",
                                              "powersgd(6)+bf16+start120+16-8-6", "powersgd(8)+bf16+start120+16-8"),
                                       *_tiny("tiny_600_psgd_rank.json", "powersgd(16)+bf16+start120",
                                              "powersgd(32)+bf16+start120"),
                                       *_tiny("tiny_600_psgd_noemb.json", "powersgd(4)+bf16+start120+16-8-4-emb",
                                              "powersgd(8)+bf16+start120+16-8-8-emb")]),
    "psgd_tiny_2000": lambda: table(EQUAL, _tiny("tiny_2000_psgd_bf16.json", "powersgd(4)+bf16+start200+16-8-4",
                                                 "powersgd(3)+bf16+start200+16-8-3")),
    "removed_variants": lambda: table(EQUAL, [
        *_tiny("tiny_600_dgc_adam_agreed.json", "dgc_adam(0.01)+all+freeze120+agreed"),
        *_tiny("tiny_600_psgd_adam.json", "powersgd(4)_adam+all+freeze120", "powersgd(2)_adam+all+freeze120",
               "powersgd(1)_adam+all+freeze120"),
        *_tiny("tiny_600_psgd_adam2.json", "powersgd(4)_adam+all+freeze120+momentum0.9",
               "powersgd(2)_adam+all+freeze120+momentum0.9"),
        *_tiny("tiny_600_psgd_adam_factored.json", "powersgd_adam(4)+factored+freeze120",
               "powersgd_adam(4)+full+freeze120", "powersgd_adam(3)+bf16+factored+freeze120",
               "powersgd_adam(2)+factored+freeze120"),
        *_tiny("tiny_600_psgd_frozenv.json", "powersgd(4)+start120+16-8-4+freezev120",
               "powersgd(4)+start120+freezev120", "powersgd(2)+start120+freezev120")]),
}
def main() -> int:
    return readme_tables.main(README, TABLES, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
