#!/usr/bin/env python3
"""tools/ncu_waits.py on a made-up ncu source page: waits grouped by barrier, with the samples of the
instruction that tests each wait's predicate, and the busiest instruction runs."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'tools'))
import ncu_waits  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed"')


def row(address, source, samples, executed):
    return f'"{address}","{source}","{samples}","0","{samples}","{executed:,}"'


def main():
    lines = ['"Kernel Name","void k()",', HEADER]
    lines += [
        row('0x00', 'S2R R2, SR_TID.X', 1, 100),
        # A stage wait (offset 0x26400) tested three rows later: 5 + 40 samples.
        row('0x10', 'SYNCS.PHASECHK.TRANS64.TRYWAIT P5, [UR15+0x26400], R14', 5, 1000),
        row('0x20', 'IMAD R3, R2, R8, R3', 7, 1000),
        row('0x30', 'IMAD R4, R2, R8, R3', 2, 1000),
        row('0x40', '@P5   BRA 0x500', 40, 1000),
        # The same barrier waited for elsewhere, with an unpredicated result: 3 samples, not tested.
        row('0x50', 'SYNCS.PHASECHK.TRANS64.TRYWAIT PT, [R13+URZ+0x26400], R4', 3, 500),
        # Another barrier, tested at once by a negated predicate: 1 + 9.
        row('0x60', 'SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+URZ+0x264c0], R2', 1, 500),
        row('0x70', '@!P0  BRA 0x60', 9, 500),
        # A polling loop: the busiest run.
        row('0x80', 'LDS R5, [R6+0x28034]', 4, 90000),
        row('0x90', 'MEMBAR.SC.CTA', 6, 90000),
        row('0xa0', '@!P0  BRA 0x80', 2, 90000),
    ]
    failures = []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, 'k.sass.csv')
        with open(path, 'w') as f:
            f.write('\n'.join(lines) + '\n')
        rows = ncu_waits.read_rows(path)
        sites = ncu_waits.waits(rows)
        expected = {'0x26400': (48.0, 1500.0), '0x264c0': (10.0, 500.0)}
        if sites != expected:
            failures.append(f'waits {sites}, expected {expected}')
        if list(sites) != ['0x26400', '0x264c0']:
            failures.append(f'waits in order {list(sites)}, expected most samples first')
        ranges = ncu_waits.hot_ranges(rows)
        if not ranges or ranges[0][:3] != (8, 10, 270000.0):
            failures.append(f'busiest run {ranges[:1]}, expected rows 8-10 with 270000 instructions')
        ncu_waits.report(path)  # prints without failing
    for failure in failures:
        print('FAIL:', failure)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
