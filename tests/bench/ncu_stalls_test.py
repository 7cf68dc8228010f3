#!/usr/bin/env python3
"""tools/ncu_stalls.py on a made-up ncu raw page: each kernel's stall reasons as shares of its samples,
largest first, the `_not_issued` variants and empty reasons left out."""
import os
import subprocess
import sys
import tempfile

TOOL = os.path.join(os.path.dirname(__file__), '..', '..', 'tools', 'ncu_stalls.py')
sys.path.insert(0, os.path.dirname(TOOL))
import ncu_stalls  # noqa: E402

HEAD = ['Kernel Name', 'gpu__time_duration.sum', 'smsp__inst_executed.sum',
        'smsp__pcsamp_warps_issue_stalled_long_scoreboard', 'smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued',
        'smsp__pcsamp_warps_issue_stalled_wait', 'smsp__pcsamp_warps_issue_stalled_no_instructions',
        'smsp__pcsamp_warps_issue_stalled_tex_throttle']
UNITS = ['', 'us', 'inst', '', '', '', '', '']


def line(cells):
    return ','.join(f'"{cell}"' for cell in cells)


def main():
    failures = []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, 'k.raw.csv')
        with open(path, 'w') as handle:
            handle.write('\n'.join([line(HEAD), line(UNITS),
                                    line(['fused_layer_kernel', '936.1', '386,225,640', '600', '590', '300', '100', '0']),
                                    line(['grouped_gemm_kernel', '540.4', '254,516,972', '10', '9', '70', '20', '0'])]) + '\n')
        (fused, _), (staged, _) = ncu_stalls.kernels(path)
        shares = ncu_stalls.stall_shares(fused)
        if [name for name, _, _ in shares] != ['long_scoreboard', 'wait', 'no_instructions']:
            failures.append(f'reasons of the first kernel: {shares}')
        if abs(shares[0][2] - 0.6) > 1e-9 or abs(shares[2][2] - 0.1) > 1e-9:
            failures.append(f'shares not of the kernel\'s samples (the _not_issued variant counted?): {shares}')
        if ncu_stalls.stall_shares(staged)[0][0] != 'wait':
            failures.append('the second kernel read with the first one\'s values')
        printed = subprocess.run([sys.executable, TOOL, path, '--top', '2'], capture_output=True, text=True, check=True).stdout
        if 'long_scoreboard' not in printed or 'no_instructions' in printed.split('grouped_gemm_kernel')[0]:
            failures.append(f'--top 2 not applied per kernel:\n{printed}')
        if 'duration 936.1 us' not in printed:
            failures.append(f'no duration with its unit:\n{printed}')
        empty = os.path.join(folder, 'empty.raw.csv')
        open(empty, 'w').write(line(HEAD) + '\n')
        run = subprocess.run([sys.executable, TOOL, empty], capture_output=True, text=True)
        if run.returncode == 0 or 'holds no profiled kernel' not in run.stderr:
            failures.append('a raw page without kernels was not refused by name')
    for failure in failures:
        print('ncu_stalls_test:', failure)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
