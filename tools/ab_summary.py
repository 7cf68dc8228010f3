#!/usr/bin/env python3
"""Summarizes a same-run layer A/B (tools/gpu_check.sh ab): graph µs per row and tree, as min-max and
median, each tree's median against the first tree's, and the noise floor where two trees were built
from one source.

    tools/ab_summary.py AB_DIR [--order TREE...] [--same TREE=TREE ...]

AB_DIR holds TREE-rROUND.json files of `megamoe bench`. --order: the trees in the A/B's order, the
first the reference (default: by name). --same names two trees of one kernel source
(gpu_check.sh finds them by digest, e.g. main's binary run twice): their medians' largest relative
difference over the rows is printed as the noise floor, the least difference an A/B can show.
"""
import argparse
import collections
import glob
import json
import os
import statistics


def read(ab_dir):
    """{(preset, recipe, tokens, schedule): {tree: [graph_us, ...]}}, trees in the files' order."""
    times = collections.defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(ab_dir, '*.json'))):
        tree = os.path.basename(path)[:-5].rsplit('-r', 1)[0]
        for row in json.load(open(path)).get('rows', []):
            key = (row['preset'], row['recipe'], row['tokens_per_rank'], row['schedule'])
            times[key].setdefault(tree, []).append(row['graph_us'])
    return times


def order_trees(times, order):
    """The trees named in `order` that have rows, in that order, then any others by name."""
    present = sorted({tree for per_tree in times.values() for tree in per_tree})
    return [tree for tree in order if tree in present] + [tree for tree in present if tree not in order]


def lines(times, order=(), same=()):
    """The summary's lines: one per row, then one per pair of trees of one source."""
    out = []
    trees = order_trees(times, order)
    reference = trees[0] if trees else None
    for key in sorted(times, key=str):
        per_tree = times[key]
        base = statistics.median(per_tree[reference]) if reference in per_tree else None
        cells = []
        for tree in trees:
            if tree not in per_tree:
                continue
            us = per_tree[tree]
            median = statistics.median(us)
            ratio = f', {median / base:.3f}x' if base and tree != reference else ''
            cells.append(f'{tree} {min(us):.1f}-{max(us):.1f} (median {median:.1f}{ratio})')
        out.append(' '.join(str(part) for part in key) + ' | ' + ' | '.join(cells))
    for first, second in same:
        spreads = [abs(statistics.median(t[second]) / statistics.median(t[first]) - 1)
                   for t in times.values() if first in t and second in t]
        if spreads:
            out.append(f'noise floor ({second} against {first}, one source): medians differ by up to '
                       f'{100 * max(spreads):.1f}% over {len(spreads)} rows')
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('ab_dir')
    parser.add_argument('--order', nargs='+', default=[], metavar='TREE', help='the trees, the reference first')
    parser.add_argument('--same', action='append', default=[], metavar='TREE=TREE',
                        help='two trees of one kernel source (repeatable)')
    args = parser.parse_args()
    same = []
    for pair in args.same:
        first, sep, second = pair.partition('=')
        if not sep or not first or not second:
            parser.error(f'--same: expected TREE=TREE, got {pair!r}')
        same.append((first, second))
    times = read(args.ab_dir)
    if not times:
        raise SystemExit(f'ab_summary: no benchmark rows in {args.ab_dir}')
    for line in lines(times, args.order, same):
        print(line)


if __name__ == '__main__':
    main()
