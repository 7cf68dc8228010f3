#!/usr/bin/env python3
"""Why a profiled kernel's warps were not issuing, from ncu's raw page (gpu_check.sh's ncu step writes
it as NAME.raw.csv): per kernel, its duration and instructions, then the PC-sample stall reasons
(`smsp__pcsamp_warps_issue_stalled_*`) with their share of all samples, largest first.

  tools/ncu_stalls.py NAME.raw.csv [MORE.raw.csv ...] [--top N]

Samples count every warp alive, polling ones too: compare shares between kernels of one
configuration, and look up where a reason's samples sit in the source page (tools/ncu_waits.py).
`no_instructions` and `imc_miss` are the instruction fetch's share (stop 92: 3-4% in the fused
decode kernels, 2% in the staged GEMM).
"""
import argparse
import csv

from ncu_waits import number  # ncu's numbers with thousands separators; 0 for none

PREFIX = 'smsp__pcsamp_warps_issue_stalled_'


def kernels(path):
    """The raw page's kernels as {metric: value}: a header row, a units row, then one row per kernel."""
    with open(path, newline='') as handle:
        rows = list(csv.reader(handle))
    if len(rows) < 3:
        raise SystemExit(f'ncu_stalls: {path} holds no profiled kernel')
    head, units = rows[0], rows[1]
    return [(dict(zip(head, row)), dict(zip(head, units))) for row in rows[2:] if len(row) == len(head)]


def stall_shares(metrics):
    """[(reason, samples, share)] largest first; the `_not_issued` variants are left out."""
    reasons = {}
    for key, value in metrics.items():
        if key.startswith(PREFIX) and not key.endswith('_not_issued'):
            samples = number(value)
            if samples:
                reasons[key[len(PREFIX):]] = samples
    total = sum(reasons.values())
    return [(name, samples, samples / total) for name, samples in sorted(reasons.items(), key=lambda kv: -kv[1])]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('files', nargs='+')
    parser.add_argument('--top', type=int, default=12, help='reasons shown per kernel')
    args = parser.parse_args()
    for path in args.files:
        for metrics, units in kernels(path):
            name = metrics.get('Kernel Name', '?')
            duration = metrics.get('gpu__time_duration.sum', '?')
            print(f'{path}: {name[:100]}')
            print(f'  duration {duration} {units.get("gpu__time_duration.sum", "")}, '
                  f'instructions {metrics.get("smsp__inst_executed.sum", "?")}')
            for reason, samples, share in stall_shares(metrics)[:args.top]:
                print(f'  {reason:24s} {samples:10.0f} {100 * share:5.1f}%')


if __name__ == '__main__':
    main()
