#!/usr/bin/env python3
"""Merges a same-run A/B's benchmark files into one results file (../shared/bench-results.md's format).

gpu_check.sh's `ab` and `gemm-ab` steps write one file per tree and round, TREE-rROUND.json. This
writes one file whose rows carry `tree`, `tree_commit` and `round` beside the benchmark's own fields,
with each run's ceilings and date (`run_ceilings`, `run_date`); the header takes the first run's.
Name the result `<benchmark>_ab-<what>-<gpus>x<gpu>-<date>.json`: plot_results.py reads only the
plain benchmarks' files, so an A/B never stands in for the current tables.

  tools/ab_results.py OUT.json --benchmark gemm_ab --command "..." \\
      --tree main=7cd9d4b --tree halves=ad20df5 AB_DIR/*.json
The first --tree is the reference (`commit` reads "main's commit against the others'").
"""
import argparse
import json
import os
import re
import sys


def tree_and_round(path):
    match = re.fullmatch(r'(.+)-r(\d+)\.json', os.path.basename(path))
    if not match:
        raise SystemExit(f'ab_results: {path}: not named TREE-rROUND.json')
    return match.group(1), int(match.group(2))


def merge(paths, commits, benchmark, command):
    rows, header = [], None
    for path in sorted(paths, key=lambda p: tree_and_round(p)[::-1]):
        tree, rnd = tree_and_round(path)
        if tree not in commits:
            raise SystemExit(f'ab_results: {path}: tree {tree!r} has no --tree {tree}=COMMIT')
        run = json.load(open(path))
        if header is None:
            header = run
        for row in run.get('rows', []):
            rows.append({**row, 'tree': tree, 'tree_commit': commits[tree], 'round': rnd,
                         'run_ceilings': run.get('ceilings', {}), 'run_date': run.get('date', '')})
    if header is None:
        raise SystemExit('ab_results: no input files')
    names = list(commits)
    others = ', '.join(commits[n] for n in names[1:])
    return {
        'benchmark': benchmark,
        'commit': f'{commits[names[0]]} against {others} (tree, tree_commit per row)',
        'device': header.get('device', ''),
        'command': command,
        'date': header.get('date', ''),
        'ceilings': header.get('ceilings', {}),
        'rows': rows,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('out')
    parser.add_argument('files', nargs='+')
    parser.add_argument('--benchmark', required=True, help='e.g. gemm_ab or layer_ab')
    parser.add_argument('--command', required=True, help='what produced the runs, for the header')
    parser.add_argument('--tree', action='append', required=True, metavar='NAME=COMMIT')
    args = parser.parse_args()
    commits = {}
    for item in args.tree:
        name, _, commit = item.partition('=')
        if not name or not commit:
            raise SystemExit(f'ab_results: --tree {item!r}: expected NAME=COMMIT')
        commits[name] = commit
    if len(commits) < 2:
        raise SystemExit('ab_results: an A/B needs at least two --tree')
    result = merge(args.files, commits, args.benchmark, args.command)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    print(f'{args.out}: {len(result["rows"])} rows from {len(args.files)} runs')


if __name__ == '__main__':
    sys.exit(main())
