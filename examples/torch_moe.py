"""A DeepSeek-V3-shaped MoE layer (256 experts, top-8, hidden 7168, intermediate 2048, one shared expert,
FP8 weights with 128x128 block scales) through megamoe and through a plain PyTorch expert-parallel layer
(all-to-all of the routed tokens + grouped matmul + all-to-all back), on the same inputs; prints both
times and the difference between their outputs.

    torchrun --nproc-per-node N examples/torch_moe.py [--tokens 128] [--experts 256] [--iters 20] [--compile]

With --compile it also times a step compiled with torch.compile (mode "reduce-overhead": CUDA graphs)
that writes the inputs into the buffer and calls the layer, and checks its output against the eager call's.

Each rank holds experts / N experts. The plain layer computes in BF16 from the same FP8 weights and
activations, dequantized; megamoe re-quantizes the SwiGLU output to E4M3 as its fp8 recipe does, so the
two differ by about 1e-2 (relative), the size of that rounding. Random weights and routing, seeded.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import megamoe
import megamoe.torch as mt


def parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--experts", type=int, default=256, help="routed experts over all ranks")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="also time a torch.compile'd step (CUDA graphs)")
    return parser.parse_args()


def block_fp8(shape, generator, device, chunk=16):
    """Random FP8 weights [E, rows, cols] with 128x128 FP32 block scales (amax / 448 per block), made
    a few experts at a time to bound the temporaries."""
    e, rows, cols = shape
    codes = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty((e, rows // 128, cols // 128), dtype=torch.float32, device=device)
    for first in range(0, e, chunk):
        n = min(chunk, e - first)
        w = torch.empty((n, rows, cols), dtype=torch.bfloat16, device=device).uniform_(-1, 1, generator=generator)
        blocks = w.view(n, rows // 128, 128, cols // 128, 128)
        scale = blocks.abs().amax(dim=(2, 4)).float().clamp_min(1e-12) / (448.0 * cols ** 0.5)
        scales[first:first + n] = scale
        codes[first:first + n] = (blocks.float() / (cols ** 0.5 * scale[:, :, None, :, None])).to(
            torch.float8_e4m3fn).view(n, rows, cols)
    return codes, scales


def dequantize(codes, scale, chunk=16):
    e, rows, cols = codes.shape
    out = torch.empty(codes.shape, dtype=torch.bfloat16, device=codes.device)
    for first in range(0, e, chunk):
        n = min(chunk, e - first)
        blocks = codes[first:first + n].float().view(n, rows // 128, 128, cols // 128, 128)
        out[first:first + n] = (blocks * scale[first:first + n, :, None, :, None]).view(n, rows, cols)
    return out


def quantize_tokens(x):
    """BF16 tokens -> E4M3 with one FP32 scale per 1x128 (the fp8 recipe's activations)."""
    blocks = x.float().view(x.shape[0], -1, 128)
    scale = blocks.abs().amax(dim=-1).clamp_min(1e-12) / 448.0
    return (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(x.shape), scale.contiguous()


def grouped_mm(rows, weights, counts):
    """rows [M, K] grouped by expert (counts[e] rows each), weights [E, N, K] -> [M, N] in BF16."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    if hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
        except Exception:  # noqa: BLE001 - older torch, or a layout it does not take: the loop below
            pass
    out, start = torch.empty((rows.shape[0], weights.shape[1]), dtype=rows.dtype, device=rows.device), 0
    for e, n in enumerate(counts.tolist()):
        out[start:start + n] = rows[start:start + n] @ weights[e].T
        start += n
    return out


def swiglu(h, route_weights):
    gate, up = h.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up * route_weights[:, None]).to(torch.bfloat16)


def plain_layer(x, topk_idx, topk_weights, w1, w2, shared_w1, shared_w2, experts_per_rank, group):
    """Expert parallelism in plain PyTorch: all-to-all of the routed token copies to their experts'
    ranks (sizes exchanged first, a host sync), one grouped matmul per linear, all-to-all back, and a
    weighted sum per token."""
    world = dist.get_world_size(group)
    tokens, top_k = topk_idx.shape
    valid = topk_idx >= 0
    flat_expert = topk_idx[valid]
    flat_token = torch.arange(tokens, device=x.device).repeat_interleave(top_k).view(tokens, top_k)[valid]
    flat_weight = topk_weights[valid]
    order = torch.argsort(flat_expert, stable=True)  # by expert, so by destination rank
    flat_expert, flat_token, flat_weight = flat_expert[order], flat_token[order], flat_weight[order]
    send_counts = torch.bincount(flat_expert // experts_per_rank, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    received = torch.empty((sum(recv), x.shape[1]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(received, x[flat_token], recv, send, group=group)
    received_expert = torch.empty(sum(recv), dtype=flat_expert.dtype, device=x.device)
    dist.all_to_all_single(received_expert, flat_expert, recv, send, group=group)
    received_weight = torch.empty(sum(recv), dtype=flat_weight.dtype, device=x.device)
    dist.all_to_all_single(received_weight, flat_weight, recv, send, group=group)
    local = received_expert % experts_per_rank
    by_expert = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=experts_per_rank)
    h = grouped_mm(received[by_expert], w1, counts)
    out_sorted = grouped_mm(swiglu(h, received_weight[by_expert]), w2, counts)
    out = torch.empty_like(out_sorted)
    out[by_expert] = out_sorted
    returned = torch.empty((sum(send), x.shape[1]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(returned, out, send, recv, group=group)
    y = (swiglu(x @ shared_w1.T, torch.ones(tokens, device=x.device)) @ shared_w2.T).float()
    y.index_add_(0, flat_token, returned.float())
    return y.to(torch.bfloat16)


def timed(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000 / iters  # us


def main():
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be a multiple of the {world} ranks")
    experts_per_rank = args.experts // world
    h, i, top_k = args.hidden, args.intermediate, args.top_k

    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed * 1000 + rank)  # this rank's experts and tokens
    w1, w1_sf = block_fp8((experts_per_rank, 2 * i, h), generator, device)
    w2, w2_sf = block_fp8((experts_per_rank, h, i), generator, device)
    shared_generator = torch.Generator(device=device)
    shared_generator.manual_seed(args.seed * 1000 + 999)  # the same shared expert everywhere
    sw1, sw1_sf = block_fp8((1, 2 * i, h), shared_generator, device)
    sw2, sw2_sf = block_fp8((1, h, i), shared_generator, device)
    x_fp8, x_sf = quantize_tokens(torch.randn((args.tokens, h), dtype=torch.bfloat16, device=device,
                                              generator=generator))
    scores = torch.randn((args.tokens, args.experts), device=device, generator=generator)
    topk_weights, topk_idx = torch.topk(scores.softmax(dim=-1), top_k, dim=-1)
    topk_weights = (topk_weights / topk_weights.sum(dim=-1, keepdim=True)).float()

    # megamoe: buffer, weights once, inputs written into the buffer, then the call.
    buffer = mt.get_symm_buffer_for_mega_moe(group, args.experts, args.tokens, top_k, h, i, mma_type="fp8xfp8",
                                             num_shared_experts=1)
    l1, l2 = mt.transform_weights_for_mega_moe((w1, w1_sf), (w2, w2_sf))
    sl1, sl2 = mt.transform_weights_for_mega_moe((sw1, sw1_sf), (sw2, sw2_sf))
    buffer.x[:args.tokens].copy_(x_fp8)
    buffer.x_sf[:args.tokens].copy_(x_sf)
    buffer.topk_idx[:args.tokens].copy_(topk_idx)
    buffer.topk_weights[:args.tokens].copy_(topk_weights)
    y = torch.empty((args.tokens, h), dtype=torch.bfloat16, device=device)
    stats = torch.zeros(experts_per_rank, dtype=torch.int32, device=device)

    def fused():
        mt.fp8_mega_moe(y, l1, l2, buffer, stats, shared_l1_weights=sl1, shared_l2_weights=sl2)

    fused()
    buffer.check_device_error()
    fused_us = timed(fused, args.iters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused()
    graph_us = timed(graph.replay, args.iters)
    buffer.check_device_error()

    compiled_us, compiled_diff = float("nan"), 0.0
    if args.compile:
        @torch.compile(fullgraph=True, mode="reduce-overhead")
        def step(x_codes, scales, ids, weights):
            n = x_codes.shape[0]
            buffer.x[:n].copy_(x_codes)
            buffer.x_sf[:n].copy_(scales)
            buffer.topk_idx[:n].copy_(ids)
            buffer.topk_weights[:n].copy_(weights)
            out = torch.empty((n, h), dtype=torch.bfloat16, device=device)
            mt.fp8_mega_moe(out, l1, l2, buffer, shared_l1_weights=sl1, shared_l2_weights=sl2)
            return out

        compiled_step = lambda: step(x_fp8, x_sf, topk_idx.int(), topk_weights)  # noqa: E731
        compiled_us = timed(compiled_step, args.iters)
        y_compiled = compiled_step().clone()
        buffer.check_device_error()
        compiled_diff = (y_compiled.view(torch.int16) != y.view(torch.int16)).sum().item()

    # The plain layer, on the same (dequantized) weights and activations.
    x = (x_fp8.float().view(args.tokens, -1, 128) * x_sf[..., None]).view(args.tokens, h).to(torch.bfloat16)
    dw1, dw2 = dequantize(w1, w1_sf), dequantize(w2, w2_sf)
    dsw1, dsw2 = dequantize(sw1, sw1_sf)[0], dequantize(sw2, sw2_sf)[0]
    reference = {}

    def plain():
        reference["y"] = plain_layer(x, topk_idx.to(torch.int64), topk_weights, dw1, dw2, dsw1, dsw2,
                                     experts_per_rank, group)

    plain_us = timed(plain, args.iters)
    diff = ((y.float() - reference["y"].float()).norm() / reference["y"].float().norm()).item()

    stats.zero_()
    graph.replay()  # one more call, to count its routes
    routes = torch.tensor([float(stats.sum())], device=device)
    dist.all_reduce(routes, group=group)
    report = torch.tensor([fused_us, graph_us, plain_us, diff, compiled_us, compiled_diff], device=device)
    gathered = [torch.empty_like(report) for _ in range(world)]
    dist.all_gather(gathered, report, group=group)
    if rank == 0:
        print(f"megamoe {megamoe.__version__}: DeepSeek-V3-shaped layer, {world} rank(s), {args.tokens} tokens per rank, "
              f"{args.experts} experts (top-{top_k}), hidden {h}, intermediate {i}, 1 shared expert, fp8")
        for r, (f, g, p, d, c, cd) in enumerate(t.tolist() for t in gathered):
            print(f"rank {r}: megamoe {f:.1f} us ({g:.1f} us as a CUDA graph), plain PyTorch EP {p:.1f} us "
                  f"({p / g:.2f}x the graph), ||y_megamoe - y_plain|| / ||y_plain|| = {d:.2e}")
            if args.compile:
                print(f"rank {r}: compiled step (inputs written, then the call; CUDA graphs) {c:.1f} us, "
                      f"{cd:.0f} output values differ from the eager call's")
        print(f"routes received by all ranks' experts in one call: {routes.item():.0f} "
              f"(expected {world * args.tokens * top_k})")
        worst = max(t[3].item() for t in gathered)
        same = all(t[5].item() == 0 for t in gathered)
        print("result: " + ("ok" if worst < 5e-2 and same else "DIFFERENT") +
              f" (largest difference {worst:.2e}, bound 5e-2" + (", compiled step bit for bit" if args.compile else "")
              + ")")
    del graph
    dist.barrier()
    buffer.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
