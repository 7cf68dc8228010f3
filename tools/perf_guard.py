#!/usr/bin/env python3
"""Checks a fresh GEMM benchmark run against the committed results, row by row.

    tools/perf_guard.py RUN.json [RUN.json ...] [--results bench/results] [--tolerance 0.05]

Each row of a run is matched with the committed row of the same recipe, stage, experts, tokens per
expert and routing, taken from the newest plain `gemm` results file that has it (A/B, reference and
profile files are not references). The compared figure is a ratio measured within one run, so it
does not move with the board's clock or power state: `tflops_vs_dense_same_shape` for prefill rows,
`weight_gbps_vs_hbm_copy` for decode rows. Single rows vary by a few hundredths from run to run, so
the check is on groups (recipe, stage and metric): a group whose median falls more than the
tolerance below its references' median is a regression, and so is a row more than twice the
tolerance below its own. Exit status: 0 none, 1 some (each named), 2 no row of the run had a
reference.

Why: a kernel change that slows a recipe nobody benchmarked that day goes unseen (bf16's L2 prefill
fell from 1.0 to 0.83 of same-shape BF16 between two of its benchmark runs); `gpu_check.sh
gemm-guard` runs a small benchmark through this at the start of a GPU session.
"""
import argparse
import glob
import json
import os
import statistics
import sys

METRICS = ('tflops_vs_dense_same_shape', 'weight_gbps_vs_hbm_copy')
KEY_FIELDS = ('recipe', 'stage', 'experts', 'tokens_per_expert', 'routing')


def row_key(row):
    if not all(field in row for field in KEY_FIELDS):
        return None
    return tuple(row[field] for field in KEY_FIELDS)


def load_references(results_dir):
    """key -> (metric values of the row, file name, commit), from the newest file holding the key."""
    newest = {}
    for path in sorted(glob.glob(os.path.join(results_dir, '*.json'))):
        with open(path) as f:
            doc = json.load(f)
        if doc.get('benchmark') != 'gemm':  # A/B, reference and profile files name other benchmarks
            continue
        stamp = (doc.get('date', ''), os.path.basename(path))
        for row in doc.get('rows', []):
            key = row_key(row)
            if key is None:
                continue
            if key not in newest or stamp > newest[key][0]:
                metrics = {m: row[m] for m in METRICS if isinstance(row.get(m), (int, float))}
                newest[key] = (stamp, metrics, os.path.basename(path), doc.get('commit', '?'))
    return {key: value[1:] for key, value in newest.items()}


def compare(run_rows, references):
    """Yields (key, metric, reference, value, reference file) for each row with a reference."""
    for row in run_rows:
        key = row_key(row)
        if key is None or key not in references:
            continue
        metrics, path, commit = references[key]
        for metric in METRICS:
            if metric in metrics and isinstance(row.get(metric), (int, float)):
                yield key, metric, metrics[metric], row[metric], f'{path} ({commit})'
                break


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('runs', nargs='+', help='megamoe_gemm_bench --out files of the run to check')
    parser.add_argument('--results', default=os.path.join(os.path.dirname(__file__), '..', 'bench', 'results'))
    parser.add_argument('--tolerance', type=float, default=0.05,
                        help="allowed drop of a group's median ratio (absolute); a single row's is twice it")
    args = parser.parse_args(argv)
    if not 0 <= args.tolerance < 1:
        parser.error(f'--tolerance must be in [0, 1), got {args.tolerance}')
    references = load_references(args.results)
    rows = []
    for path in args.runs:
        with open(path) as f:
            rows += json.load(f).get('rows', [])
    pairs = list(compare(rows, references))
    if not pairs:
        print('perf_guard: no row of the run has a committed reference', file=sys.stderr)
        return 2
    regressions = 0
    for key, metric, reference, value, source in pairs:
        regressed = value < reference - 2 * args.tolerance
        regressions += regressed
        mark = 'REGRESSION' if regressed else 'ok'
        print(f'{mark:10} {" ".join(map(str, key)):32} {metric} {value:.3f} against {reference:.3f} in {source}')
    groups = {}
    for key, metric, reference, value, _ in pairs:
        groups.setdefault((key[0], key[1], metric), ([], []))
        groups[(key[0], key[1], metric)][0].append(value)
        groups[(key[0], key[1], metric)][1].append(reference)
    for (recipe, stage, metric), (values, refs) in sorted(groups.items()):
        run_median, ref_median = statistics.median(values), statistics.median(refs)
        regressed = run_median < ref_median - args.tolerance
        regressions += regressed
        mark = 'REGRESSION' if regressed else 'ok'
        print(f'{mark:10} {recipe} {stage} {metric}: median {run_median:.3f} against {ref_median:.3f} '
              f'({len(values)} rows)')
    print(f'perf_guard: {len(pairs)} rows in {len(groups)} groups compared, {regressions} regressions '
          f'(tolerance {args.tolerance} per group, {2 * args.tolerance} per row)')
    return 1 if regressions else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
