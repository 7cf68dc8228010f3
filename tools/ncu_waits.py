#!/usr/bin/env python3
"""Where a profiled kernel's warps wait, from ncu's source page (gpu_check.sh's ncu step writes it as
NAME.sass.csv): the PC samples at each mbarrier wait site, grouped by the barrier's shared-memory
offset, and the loops that execute the most instructions (a polling loop shows up there).

  tools/ncu_waits.py NAME.sass.csv [MORE.sass.csv ...]

A wait's samples are those of its `SYNCS.PHASECHK.TRANS64.TRYWAIT` and of the first later
instruction predicated on the wait's result (within 48 rows): the warp stalls there, on the branch
that tests it. Offsets are the kernel's own (its shared-memory layout); compare them between kernels
of one configuration. Samples scale with the warps alive and the kernel's duration: compare shares,
or scale by the durations.
"""
import csv
import re
import sys

# A wait's predicate and barrier operand: TRYWAIT P5, [R4+URZ+0x26400], ...
WAIT = re.compile(r'TRYWAIT\s+(P\d|PT),\s*\[([^\]]*)\]')
SAMPLES = 'Warp Stall Sampling (All Samples)'
EXECUTED = 'Instructions Executed'
TEST_WINDOW = 48  # rows after a wait searched for the instruction that tests its predicate


def number(text):
    try:
        return float(text.replace(',', ''))
    except ValueError:
        return 0.0


def read_rows(path):
    """The source page's instruction rows, as dicts (the lines before the header name the kernel)."""
    with open(path, newline='') as f:
        lines = f.read().splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if header is None:
        raise SystemExit(f'ncu_waits: {path}: no "Address" header (not ncu --page source --csv)')
    rows = list(csv.DictReader(lines[header:]))
    for column in ('Source', SAMPLES, EXECUTED):
        if rows and column not in rows[0]:
            raise SystemExit(f'ncu_waits: {path}: no "{column}" column')
    return rows


def parse_wait(source):
    """(predicate, barrier offset) of a wait instruction, or None. The offset is the operand's constant
    term, which names the barrier within the kernel's shared memory."""
    match = WAIT.search(source)
    if not match:
        return None
    return match.group(1), match.group(2).split('+')[-1].strip()


def tested_at(rows, wait_row, predicate):
    """The row of the first instruction after `wait_row` predicated on `predicate`, or None."""
    if predicate == 'PT':
        return None
    guard = re.compile(r'^\s*@!?' + predicate + r'\b')
    for i in range(wait_row + 1, min(wait_row + 1 + TEST_WINDOW, len(rows))):
        if guard.match(rows[i]['Source']):
            return i
    return None


def waits(rows):
    """{offset: (samples, executions)} over the wait sites, most samples first."""
    sites = {}
    for i, row in enumerate(rows):
        wait = parse_wait(row['Source'])
        if wait is None:
            continue
        predicate, offset = wait
        samples = number(row[SAMPLES])
        test = tested_at(rows, i, predicate)
        if test is not None:
            samples += number(rows[test][SAMPLES])
        total = sites.setdefault(offset, [0.0, 0.0])
        total[0] += samples
        total[1] += number(row[EXECUTED])
    return dict(sorted(((k, tuple(v)) for k, v in sites.items()), key=lambda item: -item[1][0]))


def hot_ranges(rows, share=0.02):
    """Runs of instructions each executed more than `share` of the busiest instruction's count, merged
    across gaps of up to 3 rows: (first row, last row, instructions executed, first instruction)."""
    counts = [number(row[EXECUTED]) for row in rows]
    if not counts:
        return []
    floor = share * max(counts)
    ranges = []
    for i, count in enumerate(counts):
        if count <= floor:
            continue
        if ranges and i - ranges[-1][1] <= 3:
            ranges[-1][1] = i
            ranges[-1][2] += count
        else:
            ranges.append([i, i, count])
    return [(a, b, c, rows[a]['Source'].strip()) for a, b, c in sorted(ranges, key=lambda r: -r[2])]


def report(path):
    rows = read_rows(path)
    executed = sum(number(row[EXECUTED]) for row in rows)
    samples = sum(number(row[SAMPLES]) for row in rows)
    print(f'{path}: {executed / 1e6:.1f} M warp instructions, {samples:.0f} samples')
    print('  mbarrier waits (offset: samples, share of samples, executions)')
    for offset, (site_samples, site_executed) in waits(rows).items():
        share = site_samples / samples if samples else 0.0
        print(f'    {offset:>10}: {site_samples:8.0f}  {share:6.1%}  {site_executed:12.0f}')
    print('  busiest instruction runs (rows, M instructions, share, first instruction)')
    for first, last, count, source in hot_ranges(rows)[:6]:
        share = count / executed if executed else 0.0
        print(f'    {first:6d}-{last:<6d} {count / 1e6:8.1f}  {share:6.1%}  {source[:60]}')


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in argv[1:]:
        report(path)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
