#!/usr/bin/env python3
"""tools/perf_guard.py on made-up results: which reference a row meets, and when it fails."""
import json
import os
import subprocess
import sys
import tempfile

GUARD = os.path.join(os.path.dirname(__file__), '..', '..', 'tools', 'perf_guard.py')


def row(recipe, stage, tokens, value, routing='uniform', experts=32):
    metric = 'tflops_vs_dense_same_shape' if tokens >= 1024 else 'weight_gbps_vs_hbm_copy'
    return {'recipe': recipe, 'stage': stage, 'experts': experts, 'tokens_per_expert': tokens,
            'routing': routing, metric: value}


def write(folder, name, doc):
    path = os.path.join(folder, name)
    with open(path, 'w') as f:
        json.dump(doc, f)
    return path


def guard(results, *runs):
    done = subprocess.run([sys.executable, GUARD, '--results', results, *runs], capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def check(condition, what, output):
    if not condition:
        print(f'FAILED: {what}\n{output}')
        sys.exit(1)


def main():
    with tempfile.TemporaryDirectory() as results, tempfile.TemporaryDirectory() as runs:
        prefill = [row('bf16', 'l2', t, 1.0, routing=r) for t in (1024, 4096) for r in ('uniform', 'random')]
        write(results, 'gemm-1xh200-2026-11-30.json',
              {'benchmark': 'gemm', 'commit': 'old', 'date': '2026-11-30T00:00:00Z',
               'rows': prefill + [row('fp8', 'l1', 1, 0.5)]})
        # A newer file holding the same fp8 decode row is its reference; an A/B file never is.
        write(results, 'gemm-decode-1xh200-2026-12-02.json',
              {'benchmark': 'gemm', 'commit': 'new', 'date': '2026-12-02T00:00:00Z', 'rows': [row('fp8', 'l1', 1, 0.9)]})
        write(results, 'gemm_ab-x-1xh200-2026-12-03.json',
              {'benchmark': 'gemm_ab', 'commit': 'ab', 'date': '2026-12-03T00:00:00Z',
               'rows': [row('fp8', 'l1', 1, 0.1), row('bf16', 'l2', 1024, 0.1)]})

        same = write(runs, 'same.json', {'rows': prefill + [row('fp8', 'l1', 1, 0.9)]})
        code, out = guard(results, same)
        check(code == 0 and 'against 0.900 in gemm-decode-1xh200-2026-12-02.json (new)' in out,
              'an unchanged run passes, against the newest plain file', out)

        # One noisy row (0.08 down) passes; the whole group 0.08 down fails on its median.
        noisy = write(runs, 'noisy.json', {'rows': [dict(prefill[0], tflops_vs_dense_same_shape=0.92)] + prefill[1:]})
        code, out = guard(results, noisy)
        check(code == 0, 'one row 0.08 below its reference is noise', out)
        slower = write(runs, 'slower.json', {'rows': [dict(r, tflops_vs_dense_same_shape=0.92) for r in prefill]})
        code, out = guard(results, slower)
        check(code == 1 and 'REGRESSION bf16 l2 tflops_vs_dense_same_shape: median 0.920' in out,
              'a group 0.08 below its references fails', out)

        # One row far below its reference fails by itself.
        broken = write(runs, 'broken.json', {'rows': [dict(prefill[0], tflops_vs_dense_same_shape=0.7)] + prefill[1:]})
        code, out = guard(results, broken)
        check(code == 1 and 'REGRESSION bf16 l2 32 1024 uniform' in out, 'a row 0.3 below its reference fails', out)

        unknown = write(runs, 'unknown.json', {'rows': [row('bf16', 'l1', 16, 1.0, experts=7)]})
        code, out = guard(results, unknown)
        check(code == 2 and 'no row of the run has a committed reference' in out, 'no reference: exit 2', out)
    print('perf_guard_test: 5 passed')


if __name__ == '__main__':
    main()
