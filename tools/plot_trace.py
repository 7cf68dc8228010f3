#!/usr/bin/env python3
"""Draws a fused call's event log (megamoe bench --trace DIR) and says where its time went.

    tools/plot_trace.py DIR/trace-8192-r0.json [...]   writes trace-8192-r0.png beside each file
                                                       (needs matplotlib) and prints a summary

Each CTA is a row. A GEMM unit is a bar from the moment its producer found its operands ready to the
moment its math warps finished it, coloured by kind; before it, a grey bar while the producer waited
for the operands. Send and pull units are bars from their claim to their end (the dispatch warps',
or the producer's for bulk pulls); combine units end at their math warps' end. The summary gives, per kind, the units and their summed time,
and the span of each kind (first start to last end). For each GEMM kind it also gives, over a CTA's
consecutive units of that kind, the median period (one unit's end to the next one's) and how long
before the earlier unit's end the producer had found the next one's operands ready (a negative lead:
the math warps waited for the producer), and the same periods split by whether the CTA's own pull
units were still running (the dispatch warps' pulls share the SM with its GEMM units). Last, how long
the CTAs' GEMM roles sat idle before their first unit, between units and after their last. It also says
how the pull units moved their rows: through the dispatch warps' registers or in bulk by the producer.
"""
import argparse
import json
import os
import statistics
import sys

# Indexed by the kind code (UnitKind); code 7 (none) is never logged.
KINDS = ["send", "pull", "shared L1", "routed L1", "routed L2", "shared L2", "combine", "none", "route"]
COLORS = ["#8c564b", "#e377c2", "#17becf", "#1f77b4", "#ff7f0e", "#bcbd22", "#2ca02c", "#7f7f7f", "#9467bd"]
CLAIMED, READY, DONE = 0, 1, 2
# Units the dispatch warps (or the producer) run beside the math warps' sequence of units.
DISPATCH_KINDS = (KINDS.index("send"), KINDS.index("pull"), KINDS.index("route"))
GEMM_KINDS = tuple(KINDS.index(k) for k in ("shared L1", "routed L1", "routed L2", "shared L2"))


def spans(events):
    """(cta, kind, wait_start, start, end) per unit, in µs."""
    by_unit = {}
    for cta, unit, kind, what, ns in events:
        if what > DONE:
            continue  # a step inside the unit (step_offsets)
        entry = by_unit.setdefault(unit, {"cta": cta, "kind": kind})
        # A bulk pull is done by two roles (the producer's bytes, the dispatch warps' scales): the later.
        entry[what] = max(entry.get(what, 0.0), ns / 1000.0) if what == DONE else ns / 1000.0
    out = []
    for unit in by_unit.values():
        if DONE not in unit:
            continue
        claimed = unit.get(CLAIMED, unit.get(READY, unit[DONE]))
        ready = unit.get(READY, claimed)
        out.append((unit["cta"], unit["kind"], claimed, ready, unit[DONE]))
    return out


def step_offsets(events):
    """{(kind, step): median µs from the unit's start} over the units that logged steps (what 3 + step,
    the kernel's trace_step): from a GEMM unit's ready event (the producer's table steps, logged before
    it, come out negative), from any other unit's claim."""
    starts, steps = {}, {}
    for _, unit, kind, what, ns in events:
        if what <= DONE:
            entry = starts.setdefault(unit, {"kind": kind})
            entry[what] = ns / 1000.0
        else:
            steps.setdefault(unit, []).append((what - DONE - 1, ns / 1000.0))
    offsets = {}
    for unit, logged in steps.items():
        start = starts.get(unit)
        if start is None:
            continue
        for step, us in logged:
            base = start.get(READY) if start["kind"] in GEMM_KINDS and READY in start else start.get(CLAIMED)
            if base is not None:
                offsets.setdefault((start["kind"], step), []).append(us - base)
    return {key: statistics.median_low(values) for key, values in offsets.items()}


def summarize_steps(events):
    offsets = step_offsets(events)
    for kind in sorted({k for k, _ in offsets}):
        steps = sorted(step for k, step in offsets if k == kind)
        parts = ", ".join(f"{step}: {offsets[(kind, step)]:+.1f}" for step in steps)
        print(f"  {KINDS[kind]:10s} steps (median us from its claim, or ready for GEMM units): {parts}")


def pull_paths(events):
    """(register, bulk): pull units by the dispatch warps' registers, which log steps (0 segments built,
    1 rows pulled), and by the producer's bulk copies, which log none (units.h's plan picks one)."""
    pull = KINDS.index("pull")
    units = {unit for _, unit, kind, _, _ in events if kind == pull}
    stepped = {unit for _, unit, kind, what, _ in events if kind == pull and what > DONE}
    return len(stepped), len(units - stepped)


def summarize(path, units):
    print(f"{path}: {len(units)} units")
    end = max((u[4] for u in units), default=0.0)
    print(f"  last unit done at {end:.1f} us after the first event")
    for kind, name in enumerate(KINDS):
        mine = [u for u in units if u[1] == kind]
        if not mine:
            continue
        busy = sum(u[4] - u[3] for u in mine)
        waited = sum(u[3] - u[2] for u in mine)
        first, last = min(u[3] for u in mine), max(u[4] for u in mine)
        print(f"  {name:10s} {len(mine):6d} units  run {busy:10.1f} us  waited {waited:10.1f} us  "
              f"span {first:8.1f} .. {last:8.1f} us")


def gemm_rhythm(units):
    """{kind: (pairs, median period, median lead)} over each CTA's consecutive units of one GEMM kind."""
    by_cta = {}
    for unit in units:
        if unit[1] not in DISPATCH_KINDS:
            by_cta.setdefault(unit[0], []).append(unit)
    periods, leads = {}, {}
    for mine in by_cta.values():
        mine.sort(key=lambda u: u[4])
        for before, after in zip(mine, mine[1:]):
            if before[1] == after[1] and KINDS[after[1]].endswith(("L1", "L2")):
                periods.setdefault(after[1], []).append(after[4] - before[4])
                leads.setdefault(after[1], []).append(before[4] - after[3])
    return {kind: (len(periods[kind]), statistics.median_high(periods[kind]), statistics.median_high(leads[kind]))
            for kind in periods}


def pull_overlap(units):
    """{kind: ((pairs, median period) while the CTA's own pull units run, (pairs, median) after)}:
    each GEMM kind's periods (as gemm_rhythm's) split by whether the later unit ended before the
    CTA's last pull unit did. Dispatch-warp pulls run beside the CTA's GEMM units and share its SM."""
    pulls_end, by_cta = {}, {}
    for unit in units:
        if unit[1] == KINDS.index("pull"):
            pulls_end[unit[0]] = max(pulls_end.get(unit[0], 0.0), unit[4])
        elif unit[1] not in DISPATCH_KINDS:
            by_cta.setdefault(unit[0], []).append(unit)
    split = {}
    for cta, mine in by_cta.items():
        mine.sort(key=lambda u: u[4])
        for before, after in zip(mine, mine[1:]):
            if before[1] == after[1] and KINDS[after[1]].endswith(("L1", "L2")):
                beside = after[4] <= pulls_end.get(cta, 0.0)
                split.setdefault(after[1], ([], []))[0 if beside else 1].append(after[4] - before[4])
    summary = lambda periods: (len(periods), statistics.median_high(periods) if periods else 0.0)
    return {kind: (summary(beside), summary(after)) for kind, (beside, after) in split.items()}


def gemm_idle(units):
    """Where the CTAs' GEMM roles sat idle, in CTA-µs over the call (first event to last end): before
    a CTA's first GEMM unit was ready, between its units (the union of their ready-to-done spans:
    the producer's next unit is often ready before the one before ends), and after its last one.
    At decode each idle SM is weight bytes not streamed, so each part over the CTAs is about the µs
    it adds to the call. Returns (ctas, span, busy, before, between, after)."""
    start = min((u[2] for u in units), default=0.0)
    end = max((u[4] for u in units), default=0.0)
    ctas = sorted({u[0] for u in units})
    busy = before = between = after = 0.0
    for cta in ctas:
        gemm_spans = sorted((u[3], u[4]) for u in units if u[0] == cta and u[1] in GEMM_KINDS)
        if not gemm_spans:
            before += end - start
            continue
        before += gemm_spans[0][0] - start
        last_end = gemm_spans[0][0]
        for ready, done in gemm_spans:  # the union of the spans, and the gaps between them
            if ready > last_end:
                between += ready - last_end
                last_end = ready
            if done > last_end:
                busy += done - last_end
                last_end = done
        after += end - last_end
    return len(ctas), end - start, busy, before, between, after


def summarize_idle(units):
    ctas, span, busy, before, between, after = gemm_idle(units)
    if ctas == 0 or span <= 0:
        return
    print(f"  GEMM roles busy {busy / (ctas * span):.2f} of {ctas} CTAs x {span:.1f} us; idle, per CTA: "
          f"{before / ctas:.1f} us before the first unit, {between / ctas:.1f} between units, "
          f"{after / ctas:.1f} after the last")


def summarize_rhythm(units):
    for kind, (pairs, period, lead) in sorted(gemm_rhythm(units).items()):
        print(f"  {KINDS[kind]:10s} period {period:8.1f} us per unit per CTA (median of {pairs}), "
              f"next unit ready {lead:6.1f} us before the one before ends")
    for kind, ((beside, during), (alone, after)) in sorted(pull_overlap(units).items()):
        if beside:
            print(f"  {KINDS[kind]:10s} period {during:8.1f} us beside the CTA's own pulls ({beside} pairs), "
                  f"{after:8.1f} us after them ({alone})")


def plot(path, units):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_trace: matplotlib is not installed; summary only", file=sys.stderr)
        return
    ctas = max((u[0] for u in units), default=0) + 1
    fig, ax = plt.subplots(figsize=(14, max(4.0, ctas * 0.06)))
    for cta, kind, claimed, ready, done in units:
        if ready > claimed:
            ax.barh(cta, ready - claimed, left=claimed, height=0.8, color="#dddddd", linewidth=0)
        ax.barh(cta, max(done - ready, 0.05), left=ready, height=0.8, color=COLORS[kind], linewidth=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS] + [plt.Rectangle((0, 0), 1, 1, color="#dddddd")]
    ax.legend(handles, KINDS + ["waiting for operands"], loc="upper right", fontsize=7)
    ax.set_xlabel("µs from the first event")
    ax.set_ylabel("CTA")
    ax.set_ylim(-1, ctas)
    ax.invert_yaxis()
    ax.set_title(os.path.basename(path))
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"  wrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", help="trace JSON files written by megamoe bench --trace")
    args = parser.parse_args()
    for path in args.traces:
        with open(path) as f:
            log = json.load(f)
        units = spans(log["events"])
        summarize(path, units)
        register, bulk = pull_paths(log["events"])
        if register or bulk:
            print(f"  pulls: {register} units by the dispatch warps' registers, {bulk} in bulk by the producer")
        summarize_rhythm(units)
        summarize_idle(units)
        summarize_steps(log["events"])
        plot(path, units)


if __name__ == "__main__":
    main()
