"""R ranks emulated in one process on one GPU (one thread each), through megamoe.torch, against the CPU
reference. Run by test_torch_emulated.py with CUDA_MODULE_LOADING=EAGER and CUDA_DEVICE_MAX_CONNECTIONS=32
set before CUDA starts; prints one line per case and exits non-zero on a failure.

    python emulated_worker.py RANKS RECIPE [RECIPE ...]
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import megamoe  # noqa: E402
import megamoe.torch as mt  # noqa: E402
from megamoe import reference as ref  # noqa: E402
from gpu_common import CALLS, bound, transformed, write_inputs, y_bits  # noqa: E402


def run_case(num_ranks: int, recipe: str, tokens, clamp, wave_tokens: int = 0) -> None:
    p = megamoe.make_problem(num_experts=4 * num_ranks, top_k=3, hidden=512, intermediate=256, max_tokens_per_rank=48,
                             num_ranks=num_ranks, num_shared_experts=1, recipe=recipe, wave_tokens=wave_tokens)
    batches, weights = ref.random_layer(p, tokens, seed=num_ranks * 10 + len(recipe), masked=0.1)
    group = mt.emulated_group(num_ranks)
    prepared, launched = threading.Barrier(num_ranks), threading.Barrier(num_ranks)
    results, errors = [None] * num_ranks, []

    def rank_main(rank: int) -> None:
        try:
            torch.cuda.set_device(0)
            buffer = mt.Buffer(problem=p, communicator=group.communicator(rank, 0))  # collective
            parts = transformed(p, weights, rank)
            n = write_inputs(buffer, batches[rank])
            y = torch.empty((n, p.hidden), dtype=torch.bfloat16, device="cuda")
            stats = torch.zeros(p.experts_per_rank, dtype=torch.int64, device="cuda")
            torch.cuda.synchronize()  # before any rank spins: a device-wide wait is safe only now
            prepared.wait()
            l1, l2, sl1, sl2 = parts
            CALLS[recipe](y, l1, l2, buffer, stats, activation_clamp=clamp, shared_l1_weights=sl1,
                          shared_l2_weights=sl2)
            buffer.check_device_error()  # waits for this rank's stream only
            launched.wait()
            results[rank] = (y_bits(y), stats.cpu().numpy())
            launched.wait()
            buffer.destroy()  # collective
        except BaseException as error:  # noqa: BLE001
            errors.append(f"rank {rank}: {error!r}")
            group.abort()
            for barrier in (prepared, launched):
                barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    want, counts = ref.cpp_mega_moe(p, batches, weights, activation_clamp=clamp)
    for rank in range(num_ranks):
        y, stats = results[rank]
        error = ref.normalized_error(y, want[rank]) if tokens[rank] else 0.0
        ok = error < bound(recipe, max(1, tokens[rank])) and np.array_equal(stats, counts[rank])
        print(f"emulated {num_ranks} ranks {recipe} tokens {tokens[rank]} clamp {clamp} "
              f"waves of {wave_tokens or 'all'} rank {rank}: error {error:.2e}, "
              f"stats {'ok' if np.array_equal(stats, counts[rank]) else 'WRONG'} -> {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            raise AssertionError(f"rank {rank}: error {error} or receive statistics differ")


def main() -> int:
    num_ranks = int(sys.argv[1])
    recipes = sys.argv[2:] or ["fp8", "fp8_fp4", "bf16"]
    token_sets = [[(13 * r + 5) % 48 for r in range(num_ranks)], [0] + [1] * (num_ranks - 1)]
    for recipe in recipes:
        for tokens in token_sets:
            run_case(num_ranks, recipe, tokens, None)
        run_case(num_ranks, recipe, [40] * num_ranks, 0.5)
        # Waves of 16 tokens: ranks with 0 to 3 waves of their own tokens, every rank running all 3.
        run_case(num_ranks, recipe, [(17 * r + 33) % 49 for r in range(num_ranks)], None, wave_tokens=16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
