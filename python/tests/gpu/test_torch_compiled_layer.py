"""megamoe.torch inside torch.compile on one GPU: a compiled step that writes the inputs into the buffer and
runs the layer gives the eager step's output bit for bit (the same kernels), as one graph (fullgraph),
with the default backend, with CUDA graphs (mode "reduce-overhead") and for a streamed call; and against
the CPU reference."""

import numpy as np
import pytest
import torch

import megamoe
import megamoe.torch as mt
from megamoe import reference as ref
from gpu_common import CALLS, bound, to_device, transformed, y_bits

HIDDEN, INTER = 512, 256


def problem(recipe, max_tokens=64):
    return megamoe.make_problem(num_experts=8, top_k=4, hidden=HIDDEN, intermediate=INTER,
                                max_tokens_per_rank=max_tokens, num_shared_experts=1, recipe=recipe)


def device_batch(batch, recipe):
    x_dtype = torch.bfloat16 if recipe == "bf16" else torch.float8_e4m3fn
    tensors = [to_device(batch["x"], x_dtype), to_device(batch["topk_idx"]), to_device(batch["topk_weights"])]
    return tensors + ([to_device(batch["x_scales"])] if recipe != "bf16" else [])


@pytest.mark.parametrize("recipe", ["fp8", "fp8_fp4", "bf16"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_steps_match_eager_ones(recipe, mode):
    torch._dynamo.reset()
    p = problem(recipe)
    buffer = mt.Buffer(problem=p)
    _, weights = ref.random_layer(p, [0], seed=1)
    l1, l2, sl1, sl2 = transformed(p, weights, 0)
    stats = torch.zeros(p.experts_per_rank, dtype=torch.int64, device="cuda")
    torch._dynamo.mark_static_address(stats)  # the buffer's input tensors are marked already
    hidden = p.hidden  # a Python int: Dynamo cannot read the extension's Problem

    def step(x, idx, w, *scales):
        n = x.shape[0]
        buffer.x[:n].copy_(x)
        if scales:
            buffer.x_sf[:n].copy_(scales[0])
        buffer.topk_idx[:n].copy_(idx)
        buffer.topk_weights[:n].copy_(w)
        y = torch.empty((n, hidden), dtype=torch.bfloat16, device="cuda")
        CALLS[recipe](y, l1, l2, buffer, stats, shared_l1_weights=sl1, shared_l2_weights=sl2, schedule="fused")
        return y

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    # With CUDA graphs: fail rather than run without them (a skipped graph is only a warning).
    with torch._inductor.config.patch({"triton.cudagraph_or_error": mode == "reduce-overhead"}):
        for seed in (2, 3, 4):  # the same size each time: CUDA graphs replay from the second call on
            batches, _ = ref.random_layer(p, [24], seed=seed, masked=0.1)
            inputs = device_batch(batches[0], recipe)
            stats.zero_()
            eager = step(*inputs).clone()
            eager_stats = stats.clone()
            stats.zero_()
            got = compiled(*inputs).clone()
            buffer.check_device_error()
            assert torch.equal(got.view(torch.int16), eager.view(torch.int16)), f"{recipe}, seed {seed}"
            assert torch.equal(stats, eager_stats)
            want, _ = ref.cpp_mega_moe(p, batches, weights)
            assert ref.normalized_error(y_bits(got), want[0]) < bound(recipe, 24)
    buffer.destroy()


@pytest.mark.skipif(not mt.STREAMED_CALLS_COMPILE, reason="streamed calls compile from torch 2.15 on")
def test_a_compiled_streamed_call_matches_the_eager_one():
    torch._dynamo.reset()
    p = problem("fp8")
    buffer = mt.Buffer(problem=p, streaming=True)
    _, weights = ref.random_layer(p, [0], seed=3)
    l1, l2, sl1, sl2 = transformed(p, weights, 0)
    router = megamoe.softmax_router(p.num_experts, p.top_k)
    torch.manual_seed(5)
    router_weight = (0.05 * torch.randn(p.num_experts, p.hidden)).to(torch.bfloat16).cuda()

    hidden, experts = p.hidden, p.num_experts  # Python ints: Dynamo cannot read the extension's Problem

    def step(x):
        y = torch.empty((x.shape[0], hidden), dtype=torch.bfloat16, device="cuda")
        logits = torch.empty((x.shape[0], experts), dtype=torch.float32, device="cuda")
        mt.streamed_mega_moe(y, x, router_weight, router, l1, l2, buffer, router_logits=logits,
                             shared_l1_weights=sl1, shared_l2_weights=sl2, form="streamed")
        return y, logits

    compiled = torch.compile(step, fullgraph=True)
    for tokens in (37, 37, 5):
        x = torch.randn(tokens, p.hidden).to(torch.bfloat16).cuda()
        y_eager, logits_eager = (t.clone() for t in step(x))
        y, logits = compiled(x)
        buffer.check_device_error()
        assert torch.equal(logits, logits_eager)
        assert torch.equal(y.view(torch.int16), y_eager.view(torch.int16)), f"{tokens} tokens"
    np.testing.assert_allclose(logits.cpu().numpy(), (x.float() @ router_weight.float().T).cpu().numpy(), rtol=1e-4,
                               atol=1e-4)
    buffer.destroy()
