"""megamoe.torch across processes, one GPU each (torchrun), against the CPU reference: every recipe, a
CUDA-graph-captured call, and a shape mismatch that must raise ValueError on every rank.

    torchrun --standalone --nproc-per-node N python/tests/gpu/torchrun_worker.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megamoe  # noqa: E402
import megamoe.torch as mt  # noqa: E402
from megamoe import reference as ref  # noqa: E402
from gpu_common import CALLS, bound, transformed, write_inputs, y_bits  # noqa: E402


def check(rank, name, ok, detail=""):
    print(f"rank {rank}: {name}: {'ok' if ok else 'FAIL'} {detail}", flush=True)
    if not ok:
        raise AssertionError(f"{name} {detail}")


def main() -> int:
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    for recipe in ("fp8", "fp8_fp4", "bf16"):
        p = megamoe.make_problem(num_experts=4 * size, top_k=3, hidden=512, intermediate=256, max_tokens_per_rank=64,
                                 num_ranks=size, rank=rank, num_shared_experts=1, recipe=recipe)
        buffer = mt.Buffer(group, p)
        _, weights = ref.random_layer(p, [0] * size, seed=21)
        l1, l2, sl1, sl2 = transformed(p, weights, rank)
        call = CALLS[recipe]
        for seed, tokens in ((1, [17 + 9 * r for r in range(size)]), (2, [0] + [3] * (size - 1))):
            batches, _ = ref.random_layer(p, tokens, seed=seed, masked=0.1)
            n = write_inputs(buffer, batches[rank])
            y = torch.empty((n, p.hidden), dtype=torch.bfloat16, device="cuda")
            stats = torch.zeros(p.experts_per_rank, dtype=torch.int32, device="cuda")
            call(y, l1, l2, buffer, stats, activation_clamp=2.0, shared_l1_weights=sl1, shared_l2_weights=sl2)
            buffer.check_device_error()
            want, counts = ref.cpp_mega_moe(p, batches, weights, activation_clamp=2.0)
            error = ref.normalized_error(y_bits(y), want[rank]) if n else 0.0
            check(rank, f"{recipe} tokens {tokens}", error < bound(recipe, max(n, 1)), f"error {error:.2e}")
            check(rank, f"{recipe} receive statistics", np.array_equal(stats.cpu().numpy(), counts[rank]))

        # One call captured in a CUDA graph, replayed on new inputs written into the buffer.
        tokens = [24] * size
        first, _ = ref.random_layer(p, tokens, seed=3)
        second, _ = ref.random_layer(p, tokens, seed=4)
        y = torch.empty((24, p.hidden), dtype=torch.bfloat16, device="cuda")
        graph_call = lambda: call(y, l1, l2, buffer, shared_l1_weights=sl1, shared_l2_weights=sl2)  # noqa: E731
        write_inputs(buffer, first[rank])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph_call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_call()
        for batches in (second, first):
            write_inputs(buffer, batches[rank])
            dist.barrier()  # every rank's inputs are written before any replay reads a peer's
            graph.replay()
            buffer.check_device_error()
            want, _ = ref.cpp_mega_moe(p, batches, weights)
            error = ref.normalized_error(y_bits(y), want[rank])
            check(rank, f"{recipe} graph replay", error < bound(recipe, 24), f"error {error:.2e}")
            dist.barrier()  # no rank rewrites its inputs while a peer may still read them
        del graph
        buffer.destroy()

    # Ranks that disagree on a shape all raise ValueError naming it.
    try:
        mt.Buffer(group, num_experts=4 * size, num_max_tokens_per_rank=16, num_topk=2,
                  hidden=256 if rank == 0 else 384, intermediate_hidden=256, recipe="bf16")
        raised = "nothing" if size > 1 else "ValueError"
    except ValueError as error:
        raised = "ValueError"
        print(f"rank {rank}: mismatch message: {error}", flush=True)
    check(rank, "shape mismatch raises on every rank", raised == "ValueError")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: all passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
