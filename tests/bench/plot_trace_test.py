#!/usr/bin/env python3
"""tools/plot_trace.py's unit spans and GEMM rhythm on a made-up event log."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'tools'))
import plot_trace  # noqa: E402

CLAIMED, READY, DONE = plot_trace.CLAIMED, plot_trace.READY, plot_trace.DONE
ROUTED_L1, ROUTED_L2 = plot_trace.KINDS.index('routed L1'), plot_trace.KINDS.index('routed L2')


def unit(cta, index, kind, claimed_us, ready_us, done_us):
    return [(cta, index, kind, CLAIMED, claimed_us * 1000), (cta, index, kind, READY, ready_us * 1000),
            (cta, index, kind, DONE, done_us * 1000)]


def main():
    events = []
    # CTA 0: three routed L1 units 50 us apart, each ready 4 us before the one before ends, then one L2
    # unit (a different kind: no pair with the L1 units). CTA 1: two L1 units, the second ready 2 us
    # after the first ended (a negative lead), 60 us apart.
    events += unit(0, 0, ROUTED_L1, 0, 1, 50) + unit(0, 132, ROUTED_L1, 45, 46, 100)
    events += unit(0, 264, ROUTED_L1, 95, 96, 150) + unit(0, 900, ROUTED_L2, 140, 141, 170)
    events += unit(1, 1, ROUTED_L1, 0, 1, 50) + unit(1, 133, ROUTED_L1, 49, 52, 110)
    units = plot_trace.spans(events)
    failures = []
    if len(units) != 6:
        failures.append(f'{len(units)} units, expected 6')
    rhythm = plot_trace.gemm_rhythm(units)
    if set(rhythm) != {ROUTED_L1}:
        failures.append(f'kinds with pairs {sorted(rhythm)}, expected routed L1 only')
    else:
        pairs, period, lead = rhythm[ROUTED_L1]
        # Periods 50, 50 (CTA 0) and 60 (CTA 1): median 50; leads 4, 4 and -2: median 4.
        if (pairs, period, lead) != (3, 50.0, 4.0):
            failures.append(f'routed L1 rhythm {(pairs, period, lead)}, expected (3, 50.0, 4.0)')
    # Pull overlap: CTA 2 pulls until 120 us; its L1 units end at 50, 100 (beside the pull: period 50)
    # and 170, 230 (after it: periods 70, 60).
    PULL = plot_trace.KINDS.index('pull')
    pulled = unit(2, 2, PULL, 0, 0, 120)
    for index, (claimed, done) in enumerate([(0, 50), (45, 100), (95, 170), (165, 230)]):
        pulled += unit(2, 500 + index, ROUTED_L1, claimed, claimed + 1, done)
    overlap = plot_trace.pull_overlap(plot_trace.spans(pulled))
    expected = ((1, 50.0), (2, 70.0))  # median_high of 60 and 70
    if overlap.get(ROUTED_L1) != expected:
        failures.append(f'routed L1 beside/after pulls {overlap.get(ROUTED_L1)}, expected {expected}')
    # A bulk pull's two roles log a done each (the producer's bytes at 80 us, the dispatch warps'
    # scales at 60 us, in that order): the unit ends at the later one.
    two_roles = unit(3, 3, PULL, 0, 0, 80) + [(3, 3, PULL, DONE, 60 * 1000)]
    pull_span = plot_trace.spans(two_roles)
    if [u[4] for u in pull_span] != [80.0]:
        failures.append(f'pull done by two roles ends at {[u[4] for u in pull_span]}, expected [80.0]')
    # Steps (what 3 + step): a send unit claimed at 10 us with steps at 12 and 15 us; a routed L1 unit
    # ready at 20 us whose math step 2 (mainloop done) comes at 26 us, and whose producer steps 0 and 1
    # (logged before its claim event at 19 us) at 17 and 18 us; a step of a unit with no other event.
    SEND = plot_trace.KINDS.index('send')
    stepped = unit(4, 0, SEND, 10, 10, 16) + [(4, 0, SEND, DONE + 1, 12000), (4, 0, SEND, DONE + 2, 15000)]
    stepped += unit(4, 7, ROUTED_L1, 19, 20, 30) + [(4, 7, 7, DONE + 3, 26000), (4, 7, 7, DONE + 1, 17000),
                                                     (4, 7, 7, DONE + 2, 18000), (5, 99, 7, DONE + 1, 1000)]
    offsets = plot_trace.step_offsets(stepped)
    expected_steps = {(SEND, 0): 2.0, (SEND, 1): 5.0, (ROUTED_L1, 0): -3.0, (ROUTED_L1, 1): -2.0, (ROUTED_L1, 2): 6.0}
    if offsets != expected_steps:
        failures.append(f'step offsets {offsets}, expected {expected_steps}')
    if len(plot_trace.spans(stepped)) != 2:
        failures.append('steps made units of their own in spans()')
    # Idle GEMM roles over a call from 0 to 100 us (the send unit's claim to the last L2 end). CTA 6:
    # a send unit 0-10, then L1 ready 20-60 and the next L1 ready at 55 (overlapping: no gap) to 70,
    # an L2 80-100: 20 us before, 10 between, none after. CTA 7: one L1 unit 30-90: 30 before, 10
    # after. CTA 8: only a combine unit: idle all along (100 before).
    idle_log = unit(6, 0, SEND, 0, 0, 10) + unit(6, 10, ROUTED_L1, 15, 20, 60) + unit(6, 11, ROUTED_L1, 50, 55, 70)
    idle_log += unit(6, 12, ROUTED_L2, 75, 80, 100) + unit(7, 13, ROUTED_L1, 5, 30, 90)
    idle_log += unit(8, 14, plot_trace.KINDS.index('combine'), 90, 95, 99)
    idle = plot_trace.gemm_idle(plot_trace.spans(idle_log))
    expected_idle = (3, 100.0, 70.0 + 60.0, 20.0 + 30.0 + 100.0, 10.0, 10.0)
    if idle != expected_idle:
        failures.append(f'gemm_idle {idle}, expected {expected_idle}')
    # Pull paths: a unit with dispatch steps was pulled through registers, one without in bulk.
    paths = plot_trace.pull_paths(unit(9, 20, PULL, 0, 0, 30) + [(9, 20, PULL, DONE + 1, 5000)] +
                                  unit(10, 21, PULL, 0, 0, 20) + unit(11, 22, PULL, 0, 0, 25))
    if paths != (1, 2):
        failures.append(f'pull_paths {paths}, expected (1, 2)')
    for failure in failures:
        print('FAIL', failure)
    print('plot_trace_test:', 'failed' if failures else 'passed')
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
