#!/usr/bin/env python3
"""Regenerates the results tables of README.md and docs/results.md, and the plots under docs/img/,
from the benchmark results committed in bench/results/ (docs/results.md describes their format).

    tools/plot_results.py            write the tables and the plots (the plots need matplotlib)
    tools/plot_results.py --tables   write the tables only (Python's standard library alone)
    tools/plot_results.py --check    exit 1 when a table in README.md or docs/results.md differs from
                                     what the JSON gives (standard library alone; a ctest test)

Each table lives between two markers in the Markdown files, which this script owns:
    <!-- BEGIN results:NAME (tools/plot_results.py) -->
    <!-- END results:NAME -->
Where several files hold the same measurement on the same board (the same layer group, or the same
GEMM row), the one with the latest "date" is current; each board's results stay apart.
"""

import argparse
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- Loading -------------------------------------------------------------------------------------

def load_results(directory):
    """Every results file, as dicts with their file name added, oldest first."""
    results = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        data["file"] = os.path.basename(path)
        results.append(data)
    results.sort(key=lambda d: (d.get("date", ""), d["file"]))
    return results


def number(value):
    """The value as a float, NaN for null or a missing field."""
    return float("nan") if value is None else float(value)


def preset_of(data, row):
    if "preset" in row:
        return row["preset"]
    match = re.search(r"--preset[ =](\S+)", data.get("command", ""))
    return match.group(1) if match else "?"


def short_device(data):
    """"NVIDIA H200 x 2" -> "2x H200"."""
    match = re.match(r"(?:NVIDIA )?(.*) x (\d+)$", data.get("device", ""))
    return f"{match.group(2)}x {match.group(1)}" if match else data.get("device", "?")


def board(data):
    """"NVIDIA H200 x 2" -> "H200"; "NVIDIA H100 80GB HBM3 x 1" -> "H100"."""
    name = re.sub(r"^NVIDIA ", "", re.sub(r" x \d+$", "", data.get("device", "?")))
    return name.split()[0] if name else "?"


def source(data):
    return f"`bench/results/{data['file']}` (commit {data.get('commit', '?')}, {short_device(data)}, {data.get('date', '?')[:10]})"


# ---- Layer -----------------------------------------------------------------------------------------

def layer_groups(results):
    """{(preset, ranks, mode, recipe, routing, board, schedule): (data, rows sorted by tokens)}; the latest
    file wins."""
    groups = {}
    for data in results:
        if data.get("benchmark") != "layer":
            continue
        found = {}
        for row in data["rows"]:
            key = (preset_of(data, row), int(row["ranks"]), row.get("mode", "processes"), row["recipe"],
                   row.get("routing", "uniform"), board(data), row.get("schedule", "staged"))
            found.setdefault(key, []).append(row)
        for key, rows in found.items():
            groups[key] = (data, sorted(rows, key=lambda r: r["tokens_per_rank"]))
    return groups


def group_label(key, data=None):
    preset, ranks, mode, recipe, routing, gpu, schedule = key
    ranks_text = f"{ranks} emulated ranks on 1 {gpu}" if mode == "emulated" else f"{ranks}x {gpu}"
    return f"{preset} {recipe}, {ranks_text}, {schedule}"


def bound(row):
    floors = {"compute": number(row.get("floor_compute_us")), "HBM": number(row.get("floor_hbm_us")),
              "NVLink": number(row.get("floor_nvlink_us"))}
    floors = {k: v for k, v in floors.items() if not math.isnan(v)}
    return max(floors, key=floors.get) if floors else "n/a"


def fmt(value, spec, suffix=""):
    value = number(value)
    return "n/a" if math.isnan(value) else format(value, spec) + suffix


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def layer_table(rows, with_schedule=False):
    header = ["tokens/rank"] + (["schedule"] if with_schedule else []) + [
        "µs (graph)", "baseline µs", "speed-up (graph)", "roofline fraction (graph)", "bound"]
    body = []
    for row in rows:
        body.append([row["tokens_per_rank"]] + ([row.get("schedule", "staged")] if with_schedule else []) + [
            f"{fmt(row['us'], '.1f')} ({fmt(row.get('graph_us'), '.1f')})",
            fmt(row.get("baseline_us"), ".1f"),
            f"{fmt(row.get('speedup'), '.2f', '×')} ({fmt(row.get('graph_speedup'), '.2f', '×')})",
            f"{fmt(row.get('roofline_fraction'), '.2f')} ({fmt(row.get('graph_roofline_fraction'), '.2f')})",
            bound(row)])
    return table(header, body)


def headline_layer_key(groups):
    """The README's layer group: deepseek-v3 on the most GPUs (one process per GPU, H200 before H100),
    uniform routing."""
    candidates = [k for k in groups if k[2] == "processes" and k[4] == "uniform"]
    if not candidates:
        candidates = list(groups)
    if not candidates:
        return None
    return max(candidates, key=lambda k: (k[0] == "deepseek-v3", k[1], k[5] == "H200", k[6] == "staged"))


def layer_summary(results):
    groups = layer_groups(results)
    key = headline_layer_key(groups)
    if key is None:
        return "(no layer results)"
    # Every schedule measured for the headline problem, side by side.
    same = sorted((k for k in groups if k[:6] == key[:6]), key=lambda k: k[6])
    rows = sorted((r for k in same for r in groups[k][1]), key=lambda r: (r["tokens_per_rank"], r.get("schedule", "")))
    sources = sorted({source(groups[k][0]) for k in same})
    return "\n".join([
        f"**{group_label(key).rsplit(',', 1)[0]}**, {'; '.join(sources)}. µs: the slowest rank's median call; "
        "(graph): the same call replayed from a CUDA graph; baseline: NCCL all-to-all + cuBLASLt per-expert GEMMs; "
        "roofline fraction: the largest of the compute, HBM and NVLink floors (same-run ceilings) over the time.",
        "",
        layer_table(rows, with_schedule=len(same) > 1)])


def layer_details(results):
    groups = layer_groups(results)
    parts = []
    for key in sorted(groups, key=lambda k: (k[0], k[2], k[1], k[3], k[5], k[6])):
        data, rows = groups[key]
        ceilings = data.get("ceilings", {})
        ceiling_text = ", ".join(f"{name} {fmt(ceilings.get(name), '.0f')}" for name in
                                 ("hbm_copy_gbps", "fp8_dense_tflops", "bf16_dense_tflops", "peer_copy_gbps"))
        parts += [f"### {group_label(key)}", "",
                  f"{source(data)}: `{data.get('command', '')}`. Ceilings: {ceiling_text}.", "",
                  layer_table(rows), ""]
    return "\n".join(parts).rstrip() or "(no layer results)"


# ---- GEMM ------------------------------------------------------------------------------------------

def gemm_boards(results):
    """The boards with GEMM results, H200 first."""
    return sorted({board(d) for d in results if d.get("benchmark") == "gemm"}, reverse=True)


def gemm_rows(results, gpu, energy=False):
    """The current GEMM rows on one board, keyed by (recipe, stage, experts, tokens_per_expert, routing):
    latest file wins. Energy runs (rows with joules) are a separate set."""
    rows = {}
    for data in results:
        if data.get("benchmark") != "gemm" or board(data) != gpu:
            continue
        for row in data["rows"]:
            if ("joules" in row) != energy:
                continue
            key = (row["recipe"], row["stage"], row["experts"], row["tokens_per_expert"], row["routing"])
            rows[key] = dict(row, _data=data)
    return rows


def span(values, spec=".2f"):
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    low, high = min(values), max(values)
    return format(low, spec) if format(low, spec) == format(high, spec) else f"{low:{spec}}–{high:{spec}}"


RECIPES = ("fp8", "fp8_fp4", "bf16")
DECODE_TOKENS = (1, 4, 16)
PREFILL_TOKENS = (1024, 4096)
LARGE_EXPERTS = (32, 128)


def gemm_summary(results):
    parts = [gemm_summary_on(results, gpu) for gpu in gemm_boards(results)]
    return "\n\n".join(parts) or "(no GEMM results)"


def gemm_summary_on(results, gpu):
    rows = gemm_rows(results, gpu)
    body = []
    for recipe in (r for r in RECIPES if any(k[0] == r for k in rows)):
        def pick(stage=None, tokens=(), routing=None, experts=LARGE_EXPERTS):
            return [r for (rc, st, ex, tk, rt), r in rows.items() if rc == recipe and (stage is None or st == stage)
                    and tk in tokens and ex in experts and (routing is None or rt == routing)]
        decode = " / ".join(span([number(r.get("weight_gbps_vs_hbm_copy")) for r in pick(tokens=DECODE_TOKENS, routing=rt)])
                            for rt in ("uniform", "random", "skewed"))
        cells = [f"`{recipe}`", decode]
        for stage in ("l1", "l2"):
            prefill = pick(stage=stage, tokens=PREFILL_TOKENS)
            text = f"{span([number(r.get('tflops')) for r in prefill], '.0f')} TFLOP/s; " \
                   f"{span([number(r.get('tflops_vs_dense_same_shape')) for r in prefill])} of same-shape dense"
            if recipe != "bf16":
                text += f", {span([number(r.get('tflops_vs_dense_blocks_same_shape')) for r in prefill])} of block-scaled"
            cells.append(text)
        body.append(cells)
    sources = sorted({source(r["_data"]) for r in rows.values()})
    return "\n".join([
        f"**{gpu}**: DeepSeek-V3 expert shapes, 32 and 128 experts; {'; '.join(sources)}. Decode: 1–16 tokens per expert, "
        "weight bytes read per second as a fraction of the same-run HBM copy rate. Prefill: 1024–4096 tokens per "
        "expert against cuBLASLt products of the same shape (plain FP8 or BF16, and FP8 with the recipe's block "
        "scales); ranges cover uniform, random and skewed routing.",
        "",
        table(["recipe", "decode, of the HBM copy rate (uniform / random / skewed)", "prefill L1 (N 4096, K 7168)",
               "prefill L2 (N 7168, K 2048)"], body)])


def gemm_details(results):
    parts = [gemm_details_on(results, gpu) for gpu in gemm_boards(results)]
    return "\n\n".join(parts) or "(no GEMM results)"


def gemm_details_on(results, gpu):
    rows = gemm_rows(results, gpu)
    parts = [f"### {gpu}", "", "#### Decode: weight GB/s as a fraction of the HBM copy rate (and of a launch that only streams "
             "the same weight tiles, where measured)", ""]
    body = []
    for recipe in RECIPES:
        for stage in ("l1", "l2"):
            for experts in sorted({k[2] for k in rows}):
                for routing in ("uniform", "random", "skewed"):
                    cells = []
                    for tokens in DECODE_TOKENS:
                        r = rows.get((recipe, stage, experts, tokens, routing))
                        if r is None:
                            cells.append("")
                            continue
                        text = f"{fmt(r.get('weight_gbps_vs_hbm_copy'), '.2f')} ({fmt(r.get('us'), '.1f')} µs)"
                        if "weight_gbps_vs_tile_stream" in r:
                            text += f"; {fmt(r.get('weight_gbps_vs_tile_stream'), '.2f')}"
                        cells.append(text)
                    if any(cells):
                        body.append([f"`{recipe}`", stage.upper(), experts, routing] + cells)
    parts += [table(["recipe", "stage", "experts", "routing"] + [f"{t} token{'s' if t > 1 else ''}/expert"
                                                               for t in DECODE_TOKENS], body), ""]
    prefill_tokens = sorted({k[3] for k in rows if k[3] >= 64})
    parts += ["#### Prefill: TFLOP/s (fraction of same-shape dense; of same-shape block-scaled FP8), uniform routing", ""]
    body = []
    for recipe in RECIPES:
        for stage in ("l1", "l2"):
            for experts in sorted({k[2] for k in rows}):
                cells = []
                for tokens in prefill_tokens:
                    r = rows.get((recipe, stage, experts, tokens, "uniform"))
                    if r is None:
                        cells.append("")
                        continue
                    text = f"{fmt(r.get('tflops'), '.0f')} ({fmt(r.get('tflops_vs_dense_same_shape'), '.2f')}"
                    if recipe != "bf16":
                        text += f"; {fmt(r.get('tflops_vs_dense_blocks_same_shape'), '.2f')}"
                    cells.append(text + ")")
                if any(cells):
                    body.append([f"`{recipe}`", stage.upper(), experts] + cells)
    parts.append(table(["recipe", "stage", "experts"] + [f"{t} tokens/expert" for t in prefill_tokens], body))
    parts += ["", "Sources: " + "; ".join(sorted({source(r["_data"]) for r in rows.values()})) + "."]
    energy = gemm_rows(results, gpu, energy=True)
    if energy:
        parts += ["", "#### Energy at the power cap: joules per launch against same-shape cuBLASLt products", ""]
        body = [[f"`{r['recipe']}`", r["stage"].upper(), r["experts"], r["tokens_per_expert"],
                 fmt(r.get("watts"), ".0f"), fmt(r.get("joules_vs_dense_same_shape"), ".2f"),
                 fmt(r.get("joules_vs_dense_blocks_same_shape"), ".2f") if r["recipe"] != "bf16" else "n/a",
                 fmt(r.get("tflops_vs_dense_same_shape"), ".2f")]
                for _, r in sorted(energy.items(), key=lambda kv: kv[0])]
        parts.append(table(["recipe", "stage", "experts", "tokens/expert", "W", "J vs same-shape dense",
                            "J vs block-scaled", "time vs same-shape dense (TFLOP/s ratio)"], body))
        parts += ["", "Source: " + "; ".join(sorted({source(r["_data"]) for r in energy.values()})) + "."]
    return "\n".join(parts)


# ---- Communication -----------------------------------------------------------------------------------

def comm_current(results):
    """The latest comm file over two GPUs (NVLink), else the latest one."""
    comm = [d for d in results if d.get("benchmark") == "comm"]
    nvlink = [d for d in comm if not any(r.get("emulated") for r in d["rows"])]
    return (nvlink or comm or [None])[-1]


PULLS = (("pull_tma", 7168), ("pull_tma", 14336), ("pull_ld", 7168), ("pull_ld", 14336))


def comm_summary(results):
    data = comm_current(results)
    if data is None:
        return "(no communication results)"
    rows = data["rows"]
    sizes = sorted({r["bytes"] for r in rows if r["kind"] == "peer_copy"})
    body = []
    for size in sizes:
        copy = next(r for r in rows if r["kind"] == "peer_copy" and r["bytes"] == size)
        cells = [f"{size >> 20} MiB", fmt(copy["gbps"], ".0f")]
        for kind, row_bytes in PULLS:
            match = [r for r in rows if r["kind"] == kind and r.get("row_bytes") == row_bytes
                     and abs(r["bytes"] - size) < size / 100]
            cells.append(f"{fmt(match[0]['gbps'], '.0f')} ({fmt(match[0].get('ratio_to_same_size_peer_copy'), '.2f')})"
                         if match else "n/a")
        body.append(cells)
    barrier = [r for r in rows if r["kind"] == "barrier"]
    text = [f"Rank 0 pulls token rows from rank 1's symmetric buffer over NVLink; {source(data)}. GB/s (fraction of "
            "a peer copy of the same size); 7168-byte rows are FP8 rows with 224 bytes of scales from a second region.",
            "",
            table(["size", "peer copy", "TMA, 7168 + 224", "TMA, 14336", "vector loads, 7168 + 224",
                   "vector loads, 14336"], body)]
    if barrier:
        text += ["", f"The in-kernel cross-rank barrier: {fmt(barrier[0]['us'], '.2f')} µs."]
    return "\n".join(text)


# ---- Markdown ----------------------------------------------------------------------------------------

TABLES = {
    "README.md": {"layer": layer_summary, "gemm": gemm_summary},
    "docs/results.md": {"layer": layer_details, "gemm": gemm_details, "comm": comm_summary},
}


def replace_blocks(text, blocks, path):
    for name, content in blocks.items():
        pattern = re.compile(r"(<!-- BEGIN results:%s \(tools/plot_results.py\) -->\n).*?(<!-- END results:%s -->)"
                             % (re.escape(name), re.escape(name)), re.S)
        if not pattern.search(text):
            raise SystemExit(f"{path}: no markers for results:{name}")
        text = pattern.sub(lambda m: m.group(1) + content + "\n" + m.group(2), text)
    return text


# ---- Plots -------------------------------------------------------------------------------------------

def plot(results, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
    matplotlib.rcParams["svg.hashsalt"] = "megamoe"  # stable SVG ids, so unchanged plots stay unchanged
    os.makedirs(out_dir, exist_ok=True)

    def save(fig, name):
        for axis in fig.axes:  # plain numbers on the log2 axes: 1, 8, 128 rather than 2^0, 2^3, 2^7
            axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name + ".svg"), metadata={"Date": None})
        fig.savefig(os.path.join(out_dir, name + ".png"), dpi=110, metadata={"Software": None})
        plt.close(fig)

    # The layer plots show one board, the one measured last (both boards' lines would crowd them).
    groups = layer_groups(results)
    layer_files = [d for d in results if d.get("benchmark") == "layer"]
    gpu = board(layer_files[-1]) if layer_files else "?"
    groups = {k: v for k, v in groups.items() if k[5] == gpu}
    order = sorted(groups, key=lambda k: (k[0], k[2], k[1], k[3], k[6]))
    styles = {"staged": "-", "fused": "--"}
    # One colour per problem (preset, ranks, mode, recipe, routing, board), the line style per schedule.
    problems = sorted({k[:6] for k in order})
    palette = plt.get_cmap("tab10")
    colour = {problem: palette(i % 10) for i, problem in enumerate(problems)}

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for key in order:
        rows = groups[key][1]
        tokens = [r["tokens_per_rank"] for r in rows]
        ax.plot(tokens, [number(r.get("graph_roofline_fraction", r.get("roofline_fraction"))) for r in rows],
                styles.get(key[6], ":"), marker="o", color=colour[key[:6]], label=group_label(key))
    ax.set(xlabel="tokens per rank", ylabel="roofline fraction (graph replay)", ylim=(0, 1.05),
           title=f"The layer against its floors (compute, HBM, NVLink at same-run ceilings), {gpu}")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "layer_roofline")

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for key in order:
        rows = [r for r in groups[key][1] if not math.isnan(number(r.get("graph_speedup")))]
        if rows:
            ax.plot([r["tokens_per_rank"] for r in rows], [number(r["graph_speedup"]) for r in rows],
                    styles.get(key[6], ":"), marker="o", color=colour[key[:6]], label=group_label(key))
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(xlabel="tokens per rank", ylabel="speed-up over the unfused baseline (graph replay)",
           title=f"Speed-up over NCCL all-to-all + cuBLASLt per-expert GEMMs, {gpu}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "layer_speedup")

    # Which schedule to pick: the fused call's time over the staged one's, from the same file (same run).
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for problem in problems:
        staged, fused = groups.get(problem + ("staged",)), groups.get(problem + ("fused",))
        if not staged or not fused or staged[0] is not fused[0]:
            continue
        staged_us = {r["tokens_per_rank"]: number(r.get("graph_us")) for r in staged[1]}
        points = [(r["tokens_per_rank"], number(r.get("graph_us")) / staged_us[r["tokens_per_rank"]])
                  for r in fused[1] if staged_us.get(r["tokens_per_rank"], 0) > 0]
        if points:
            ax.plot(*zip(*points), "-", marker="o", color=colour[problem],
                    label=group_label(problem + ("fused",)).rsplit(",", 1)[0])
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(xlabel="tokens per rank", ylabel="fused time / staged time (graph replay, same run)",
           title=f"The fused schedule against the staged one (below 1: fused is faster), {gpu}")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "layer_schedules")

    gemm_files = [d for d in results if d.get("benchmark") == "gemm"]
    gpu = board(gemm_files[-1]) if gemm_files else "?"
    rows = gemm_rows(results, gpu)
    if rows:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
        for recipe in RECIPES:
            for stage, style in (("l1", "-"), ("l2", "--")):
                decode = sorted((k[3], number(r.get("weight_gbps_vs_hbm_copy"))) for k, r in rows.items()
                                if k[0] == recipe and k[1] == stage and k[2] == 128 and k[4] == "uniform" and k[3] <= 16)
                if decode:
                    left.plot(*zip(*decode), style, marker="o", label=f"{recipe} {stage.upper()}")
                prefill = sorted((k[3], number(r.get("tflops_vs_dense_same_shape"))) for k, r in rows.items()
                                 if k[0] == recipe and k[1] == stage and k[2] == 128 and k[4] == "uniform" and k[3] >= 64)
                if prefill:
                    right.plot(*zip(*prefill), style, marker="o", label=f"{recipe} {stage.upper()}")
        left.set(xlabel="tokens per expert", ylabel="weight bytes/s over the HBM copy rate", ylim=(0, 1.15),
                 title=f"Decode, 128 experts: against HBM, {gpu}")
        right.set(xlabel="tokens per expert", ylabel="TFLOP/s over same-shape dense cuBLASLt", ylim=(0, 1.15),
                  title=f"Prefill, 128 experts: against dense, {gpu}")
        for axis in (left, right):
            axis.set_xscale("log", base=2)
            axis.axhline(1.0, color="gray", linewidth=0.8)
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=7)
        save(fig, "gemm_ceilings")


# ---- Main --------------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tables", action="store_true", help="write the tables only (no matplotlib)")
    mode.add_argument("--check", action="store_true", help="exit 1 when a table is stale; write nothing")
    parser.add_argument("--root", default=ROOT, help="the repository (default: this script's)")
    args = parser.parse_args()

    results = load_results(os.path.join(args.root, "bench", "results"))
    stale = []
    for relative, makers in TABLES.items():
        path = os.path.join(args.root, relative)
        with open(path) as f:
            text = f.read()
        updated = replace_blocks(text, {name: make(results) for name, make in makers.items()}, relative)
        if updated == text:
            continue
        if args.check:
            stale.append(relative)
        else:
            with open(path, "w") as f:
                f.write(updated)
            print(f"plot_results: updated {relative}")
    if args.check:
        if stale:
            print("plot_results: stale tables in " + ", ".join(stale) + ": run tools/plot_results.py --tables")
            return 1
        print("plot_results: the tables match bench/results/")
        return 0
    if not args.tables:
        plot(results, os.path.join(args.root, "docs", "img"))
        print("plot_results: wrote docs/img/{layer_roofline,layer_speedup,layer_schedules,gemm_ceilings}.{svg,png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
