"""megamoe.torch on one GPU, one process (an NCCL communicator of one rank), against the CPU reference:
every recipe, shared experts, masked routes, the activation clamp, MX activations, receive statistics,
a CUDA-graph-captured call, both schedules, waves, device errors and argument errors."""

import numpy as np
import pytest
import torch

import megamoe
import megamoe.torch as mt
from megamoe import reference as ref
from gpu_common import CALLS, bound, mx_batch, transformed, write_inputs, y_bits

HIDDEN, INTER = 512, 256


def problem(recipe, shared=1, experts=8, top_k=4, max_tokens=64):
    return megamoe.make_problem(num_experts=experts, top_k=top_k, hidden=HIDDEN, intermediate=INTER,
                                max_tokens_per_rank=max_tokens, num_shared_experts=shared, recipe=recipe)


@pytest.fixture(scope="module", params=["fp8", "fp8_fp4", "bf16"])
def layer(request):
    recipe = request.param
    p = problem(recipe)
    buffer = mt.Buffer(problem=p)
    _, weights = ref.random_layer(p, [0], seed=1)
    yield p, buffer, weights, transformed(p, weights, 0)
    buffer.destroy()


def run(p, buffer, weights, parts, batch, clamp=None, stats=None, mx=None, recipe=None, schedule="staged"):
    n = write_inputs(buffer, batch, mx)
    y = torch.empty((n, p.hidden), dtype=torch.bfloat16, device="cuda")
    l1, l2, sl1, sl2 = parts
    kwargs = dict(shared_l1_weights=sl1, shared_l2_weights=sl2, schedule=schedule)
    if p.recipe != "bf16":
        kwargs["recipe"] = recipe
    CALLS[p.recipe](y, l1, l2, buffer, stats, activation_clamp=clamp, **kwargs)
    buffer.check_device_error()
    return y


@pytest.mark.parametrize("tokens,clamp,masked", [(1, None, 0.0), (37, None, 0.25), (64, 0.5, 0.0), (0, None, 0.0)])
def test_layer_matches_the_reference(layer, tokens, clamp, masked):
    p, buffer, weights, parts = layer
    batches, _ = ref.random_layer(p, [tokens], seed=tokens + 7, masked=masked)
    stats = torch.zeros(p.experts_per_rank, dtype=torch.int32, device="cuda")
    y = run(p, buffer, weights, parts, batches[0], clamp=clamp, stats=stats)
    want, counts = ref.cpp_mega_moe(p, batches, weights, activation_clamp=clamp)
    assert y.shape == (tokens, p.hidden)
    if tokens:
        error = ref.normalized_error(y_bits(y), want[0])
        assert error < bound(p.recipe, tokens), f"{p.recipe}: error {error}"
    np.testing.assert_array_equal(stats.cpu().numpy(), counts[0])


@pytest.mark.parametrize("tokens", [1, 37])
def test_fused_schedule_matches_the_reference(layer, tokens):
    p, buffer, weights, parts = layer
    batches, _ = ref.random_layer(p, [tokens], seed=tokens + 11, masked=0.1)
    stats = torch.zeros(p.experts_per_rank, dtype=torch.int32, device="cuda")
    y = run(p, buffer, weights, parts, batches[0], stats=stats, schedule="fused")
    want, counts = ref.cpp_mega_moe(p, batches, weights)
    error = ref.normalized_error(y_bits(y), want[0])
    assert error < bound(p.recipe, tokens), f"{p.recipe}, fused: error {error}"
    np.testing.assert_array_equal(stats.cpu().numpy(), counts[0])


@pytest.mark.parametrize("recipe", ["fp8", "fp8_fp4", "bf16"])
def test_waves_match_the_reference(recipe):
    """A buffer of 24-token waves: calls of 0 to 3 waves, both schedules; the inputs are ordinary device
    tensors of the call's size, and the symmetric buffer is smaller than a whole call's."""
    p = problem(recipe)
    whole = mt.Buffer(problem=p)
    buffer = mt.Buffer(problem=p, wave_tokens=24)
    assert (buffer.waves_per_call, whole.waves_per_call) == (3, 1) and buffer.num_bytes < whole.num_bytes
    assert tuple(buffer.topk_idx.shape) == (p.max_tokens_per_rank, p.top_k)
    whole.destroy()
    _, weights = ref.random_layer(p, [0], seed=1)
    parts = transformed(p, weights, 0)
    for tokens, schedule in ((64, "staged"), (25, "fused"), (0, "staged"), (24, "fused"), (49, "staged")):
        batches, _ = ref.random_layer(p, [tokens], seed=tokens + 13, masked=0.1)
        stats = torch.zeros(p.experts_per_rank, dtype=torch.int64, device="cuda")
        y = run(p, buffer, weights, parts, batches[0], stats=stats, schedule=schedule)
        want, counts = ref.cpp_mega_moe(p, batches, weights)
        if tokens:
            error = ref.normalized_error(y_bits(y), want[0])
            assert error < bound(p.recipe, tokens), f"{recipe}, {tokens} tokens, {schedule}: error {error}"
        np.testing.assert_array_equal(stats.cpu().numpy(), counts[0])
    buffer.destroy()


def test_waves_with_mx_activations():
    p = problem("fp8_fp4", shared=0)
    buffer = mt.get_symm_buffer_for_mega_moe(None, p.num_experts, p.max_tokens_per_rank, p.top_k, p.hidden,
                                             p.intermediate, wave_tokens=16)
    assert buffer.activation_scales == "mx" and buffer.waves_per_call == 4
    batches, weights = ref.random_layer(p, [50], seed=19)
    mx, converted = mx_batch(batches[0], seed=20)
    y = run(p, buffer, weights, transformed(p, weights, 0), batches[0], mx=mx, recipe=(1, 1, 32))
    want, _ = ref.cpp_mega_moe(p, [converted], weights)
    assert ref.normalized_error(y_bits(y), want[0]) < bound("fp8_fp4", 50)
    buffer.destroy()


def test_clamp_is_applied_on_the_gpu(layer):
    p, buffer, weights, parts = layer
    batches, _ = ref.random_layer(p, [32], seed=3)
    clamped = y_bits(run(p, buffer, weights, parts, batches[0], clamp=0.25))
    want_clamped, _ = ref.cpp_mega_moe(p, batches, weights, activation_clamp=0.25)
    want_plain, _ = ref.cpp_mega_moe(p, batches, weights)
    assert ref.normalized_error(want_clamped[0], want_plain[0]) > 5 * bound(p.recipe, 32)  # the clamp matters
    assert ref.normalized_error(clamped, want_clamped[0]) < bound(p.recipe, 32)


def test_statistics_accumulate_in_int64(layer):
    p, buffer, weights, parts = layer
    batches, _ = ref.random_layer(p, [20], seed=4)
    stats = torch.full((p.experts_per_rank,), 5, dtype=torch.int64, device="cuda")
    for _ in range(3):
        run(p, buffer, weights, parts, batches[0], stats=stats)
    _, counts = ref.cpp_mega_moe(p, batches, weights)
    np.testing.assert_array_equal(stats.cpu().numpy(), 5 + 3 * counts[0].astype(np.int64))


def test_graph_captured_call(layer):
    p, buffer, weights, parts = layer
    n = 24
    first, _ = ref.random_layer(p, [n], seed=5)
    second, _ = ref.random_layer(p, [n], seed=6)
    l1, l2, sl1, sl2 = parts
    y = torch.empty((n, p.hidden), dtype=torch.bfloat16, device="cuda")
    stats = torch.zeros(p.experts_per_rank, dtype=torch.int32, device="cuda")
    call = lambda: CALLS[p.recipe](y, l1, l2, buffer, stats, activation_clamp=1.0,  # noqa: E731
                                   shared_l1_weights=sl1, shared_l2_weights=sl2)
    write_inputs(buffer, first[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    stats.zero_()
    for batch in (second, first):
        write_inputs(buffer, batch[0])
        graph.replay()
        torch.cuda.synchronize()
        buffer.check_device_error()
        want, _ = ref.cpp_mega_moe(p, batch, weights, activation_clamp=1.0)
        assert ref.normalized_error(y_bits(y), want[0]) < bound(p.recipe, n)
    _, c1 = ref.cpp_mega_moe(p, first, weights)
    _, c2 = ref.cpp_mega_moe(p, second, weights)
    np.testing.assert_array_equal(stats.cpu().numpy(), c1[0] + c2[0])


def test_bad_expert_id_is_a_runtime_error(layer):
    p, buffer, weights, parts = layer
    batches, _ = ref.random_layer(p, [8], seed=8)
    bad = dict(batches[0])
    bad["topk_idx"] = batches[0]["topk_idx"].copy()
    bad["topk_idx"][3, 1] = p.num_experts + 5
    write_inputs(buffer, bad)
    l1, l2, sl1, sl2 = parts
    y = torch.empty((8, p.hidden), dtype=torch.bfloat16, device="cuda")
    CALLS[p.recipe](y, l1, l2, buffer, shared_l1_weights=sl1, shared_l2_weights=sl2)
    with pytest.raises(RuntimeError, match=f"expert id {p.num_experts + 5}"):
        buffer.check_device_error()
    # The record is cleared; the buffer serves exact calls again.
    y = run(p, buffer, weights, parts, batches[0])
    want, _ = ref.cpp_mega_moe(p, batches, weights)
    assert ref.normalized_error(y_bits(y), want[0]) < bound(p.recipe, 8)


def test_mx_activations():
    p = problem("fp8_fp4", shared=0)
    buffer = mt.get_symm_buffer_for_mega_moe(None, p.num_experts, p.max_tokens_per_rank, p.top_k, p.hidden,
                                             p.intermediate)
    assert buffer.activation_scales == "mx" and buffer.x_sf.dtype == torch.int32
    assert tuple(buffer.x_sf.shape) == (p.max_tokens_per_rank, p.hidden // 128)
    batches, weights = ref.random_layer(p, [40], seed=9)
    mx, converted = mx_batch(batches[0], seed=10)
    parts = transformed(p, weights, 0)
    for recipe in ((1, 1, 32), None):
        y = run(p, buffer, weights, parts, batches[0], mx=mx, recipe=recipe, clamp=10.0)
        want, _ = ref.cpp_mega_moe(p, [converted], weights, activation_clamp=10.0)
        assert ref.normalized_error(y_bits(y), want[0]) < bound("fp8_fp4", 40)
    with pytest.raises(ValueError, match="recipe"):
        run(p, buffer, weights, parts, batches[0], mx=mx, recipe=(1, 1, 128))
    buffer.destroy()


def test_deepgemm_weight_formats_for_fp4():
    """Scales as float32 powers of two or as DeepGEMM's packed int32 give the same weights as UE8M0 bytes."""
    p = problem("fp8_fp4", shared=0)
    _, weights = ref.random_layer(p, [0], seed=11)
    from gpu_common import canonical_torch
    (w1, s1), (w2, s2) = canonical_torch("fp8_fp4", weights, 0, p.num_experts)
    base = mt.transform_weights_for_mega_moe((w1, s1), (w2, s2))
    as_float = lambda s: (s.to(torch.int32) << 23).view(torch.float32)  # noqa: E731
    as_packed = lambda s: s.contiguous().view(torch.int32)  # noqa: E731
    for convert in (as_float, as_packed):
        other = mt.transform_weights_for_mega_moe((w1.view(torch.int8), convert(s1)), (w2, convert(s2)))
        for a, b in zip(base, other):
            for key in a.tensors:
                assert torch.equal(a.tensors[key], b.tensors[key]), key


def test_argument_errors_name_the_argument(layer):
    p, buffer, weights, parts = layer
    l1, l2, sl1, sl2 = parts
    call = CALLS[p.recipe]
    shared = dict(shared_l1_weights=sl1, shared_l2_weights=sl2)
    y = torch.empty((4, p.hidden), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="^y: must be bfloat16"):
        call(y.float(), l1, l2, buffer, **shared)
    with pytest.raises(ValueError, match="^y: must be bfloat16"):
        call(y[:, :128], l1, l2, buffer, **shared)
    with pytest.raises(ValueError, match="^y: must be on"):
        call(y.cpu(), l1, l2, buffer, **shared)
    with pytest.raises(ValueError, match="^y: .* exceed"):
        call(torch.empty((p.max_tokens_per_rank + 1, p.hidden), dtype=torch.bfloat16, device="cuda"), l1, l2, buffer,
             **shared)
    with pytest.raises(ValueError, match="^cumulative_local_expert_recv_stats"):
        call(y, l1, l2, buffer, torch.zeros(3, dtype=torch.int64, device="cuda"), **shared)
    with pytest.raises(ValueError, match="^cumulative_local_expert_recv_stats"):
        call(y, l1, l2, buffer, torch.zeros(p.experts_per_rank, dtype=torch.float32, device="cuda"), **shared)
    with pytest.raises(ValueError, match="^activation_clamp"):
        call(y, l1, l2, buffer, activation_clamp=-1.0, **shared)
    with pytest.raises(ValueError, match="^activation:"):
        call(y, l1, l2, buffer, activation="gelu", **shared)
    with pytest.raises(ValueError, match="^schedule: must be 'staged' or 'fused'"):
        call(y, l1, l2, buffer, schedule="overlapped", **shared)
    with pytest.raises(ValueError, match="^sym_buffer"):
        call(y, l1, l2, object(), **shared)
    with pytest.raises(ValueError, match="^l1_weights"):
        call(y, "weights", l2, buffer, **shared)
    with pytest.raises(ValueError, match="^shared_l1_weights"):
        call(y, l1, l2, buffer)
    other = [r for r in CALLS if r != p.recipe][0]
    with pytest.raises(ValueError, match="^sym_buffer: was made for recipe"):
        CALLS[other](y, l1, l2, buffer, **shared)
    if p.recipe != "bf16":
        with pytest.raises(ValueError, match="^recipe"):
            call(y, l1, l2, buffer, recipe=(1, 2, 3), **shared)
    with pytest.raises(ValueError, match="^l1_weights"):
        mt.transform_weights_for_mega_moe(torch.zeros((2, 256, 128), dtype=torch.float16, device="cuda"),
                                          torch.zeros((2, 128, 128), dtype=torch.float16, device="cuda"), recipe="bf16")
    with pytest.raises(ValueError, match="^l2_weights"):
        mt.transform_weights_for_mega_moe(torch.zeros((2, 256, 128), dtype=torch.bfloat16, device="cuda"),
                                          torch.zeros((2, 256, 128), dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="^activation"):
        mt.transform_weights_for_mega_moe(l1, l2, activation="relu")


def test_buffer_errors_name_the_argument():
    # Shapes are checked inside the collective creation, so that every rank raises together.
    with pytest.raises(ValueError, match="hidden: must be a positive multiple of 128"):
        mt.Buffer(num_experts=8, num_max_tokens_per_rank=8, num_topk=2, hidden=100, intermediate_hidden=128)
    with pytest.raises(ValueError, match="^num_topk"):
        mt.Buffer(num_experts=8, num_max_tokens_per_rank=8, hidden=128, intermediate_hidden=128)
    with pytest.raises(ValueError, match="^mma_type"):
        mt.get_symm_buffer_for_mega_moe(None, 8, 8, 2, 128, 128, mma_type="fp4xfp4")
    with pytest.raises(ValueError, match="^activation_scales"):
        mt.Buffer(problem=problem("fp8"), activation_scales="mx")


def test_region_tensors_are_views_of_the_buffer():
    p = problem("fp8", shared=0)
    buffer = mt.Buffer(problem=p)
    assert buffer.x.dtype == torch.float8_e4m3fn and tuple(buffer.x.shape) == (p.max_tokens_per_rank, p.hidden)
    assert buffer.x_sf.dtype == torch.float32 and buffer.topk_idx.dtype == torch.int32
    assert buffer.topk_weights.dtype == torch.float32
    ptrs = sorted(t.data_ptr() for t in (buffer.x, buffer.x_sf, buffer.topk_idx, buffer.topk_weights))
    assert ptrs[-1] - ptrs[0] < buffer.num_bytes  # all four inside the one symmetric allocation
    buffer.destroy()


def _softmax_top_k(logits: np.ndarray, top_k: int):
    """The softmax router's choice (megamoe/router.h) on given logits: ids by decreasing probability, ties
    to the lower id, weights normalized over the chosen."""
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, idx, axis=1)
    return idx.astype(np.int32), (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("recipe,chunk_tokens,form,max_tokens", [
    ("fp8", None, "streamed", 64), ("fp8_fp4", None, "streamed", 64), ("bf16", None, "streamed", 64),
    ("fp8", 16, "streamed", 64), ("fp8", None, "batch", 64), ("bf16", 16, "batch", 64),
    ("fp8", None, "automatic", 64), ("fp8", 16, "automatic", 160)])
def test_streamed_calls_match_the_reference(recipe, chunk_tokens, form, max_tokens):
    """streamed_mega_moe: router logits, top-k and quantization on the GPU into the front ring, the fused
    layer reading them there; calls of 1, 37, 37, 64 and 0 tokens reuse the ring's slots, in one chunk
    per call (two slots) or in chunks of 16 (eight slots: the 64-token call's chunks take slots 7, 0, 1
    and 2). Each call's output against the C++ reference on the same routing (the softmax top-k of the
    call's own logits, which must be x @ router_weight.T) and the same x. form "batch": the same producers
    into the buffer's input regions, then the fused layer (the ring unused); "automatic": the batch form
    for now, in buffers of 64 and 160 tokens."""
    p = problem(recipe, max_tokens=max_tokens)
    buffer = mt.Buffer(problem=p, streaming=True, chunk_tokens=chunk_tokens)
    assert buffer.call_form() == "batch"  # at every size for now (streamed calls measured slower)
    assert buffer.streaming and buffer.problem.front_tokens_per_slot == min(chunk_tokens or p.max_tokens_per_rank,
                                                                            p.max_tokens_per_rank)
    _, weights = ref.random_layer(p, [0], seed=3)
    l1, l2, sl1, sl2 = transformed(p, weights, 0)
    router = megamoe.softmax_router(p.num_experts, p.top_k)
    torch.manual_seed(5)
    router_weight = (0.05 * torch.randn(p.num_experts, p.hidden)).to(torch.bfloat16).cuda()
    stats = torch.zeros(p.experts_per_rank, dtype=torch.int64, device="cuda")
    for tokens in (1, 37, 37, 64, 0):
        x = torch.randn(tokens, p.hidden).to(torch.bfloat16).cuda()
        y = torch.empty((tokens, p.hidden), dtype=torch.bfloat16, device="cuda")
        logits = torch.empty((tokens, p.num_experts), dtype=torch.float32, device="cuda")
        mt.streamed_mega_moe(y, x, router_weight, router, l1, l2, buffer, stats, router_logits=logits,
                             shared_l1_weights=sl1, shared_l2_weights=sl2, form=form)
        buffer.check_device_error()
        if tokens == 0:
            continue
        got_logits = logits.cpu().numpy()
        np.testing.assert_allclose(got_logits, (x.float() @ router_weight.float().T).cpu().numpy(), rtol=1e-4,
                                   atol=1e-4)
        idx, w = _softmax_top_k(got_logits.astype(np.float64), p.top_k)
        codes, scales = ref.quantize_activations(x.float().cpu().numpy(), recipe)
        batch = {"x": codes, "topk_idx": idx, "topk_weights": w}
        if scales is not None:
            batch["x_scales"] = scales
        want, counts = ref.cpp_mega_moe(p, [batch], weights)
        error = ref.normalized_error(y_bits(y), want[0])
        assert error < bound(recipe, tokens), f"{recipe}, form {form}, chunks of {chunk_tokens}, {tokens} tokens: " \
                                              f"error {error}"
    buffer.destroy()


def test_streamed_call_errors_name_the_argument():
    p = problem("fp8")
    _, weights = ref.random_layer(p, [0], seed=1)
    l1, l2, sl1, sl2 = transformed(p, weights, 0)
    router = megamoe.softmax_router(p.num_experts, p.top_k)
    x = torch.zeros((4, p.hidden), dtype=torch.bfloat16, device="cuda")
    y = torch.empty((4, p.hidden), dtype=torch.bfloat16, device="cuda")
    w = torch.zeros((p.num_experts, p.hidden), dtype=torch.bfloat16, device="cuda")
    batch_buffer = mt.Buffer(problem=p)
    with pytest.raises(ValueError, match="^sym_buffer: streamed calls need a buffer made with streaming=True"):
        mt.streamed_mega_moe(y, x, w, router, l1, l2, batch_buffer, shared_l1_weights=sl1, shared_l2_weights=sl2)
    batch_buffer.destroy()
    with pytest.raises(ValueError, match="^activation_scales"):
        mt.Buffer(problem=p, streaming=True, activation_scales="mx")
    with pytest.raises(ValueError, match="^chunk_tokens: cuts streamed calls"):
        mt.Buffer(problem=p, chunk_tokens=16)
    with pytest.raises(ValueError, match="^chunk_tokens: must be a positive int"):
        mt.Buffer(problem=p, streaming=True, chunk_tokens=0)
    buffer = mt.Buffer(problem=p, streaming=True)
    common = dict(shared_l1_weights=sl1, shared_l2_weights=sl2)
    with pytest.raises(ValueError, match="^router: must be a megamoe.RouterConfig"):
        mt.streamed_mega_moe(y, x, w, "softmax", l1, l2, buffer, **common)
    with pytest.raises(ValueError, match="^x: "):
        mt.streamed_mega_moe(y, x[:3], w, router, l1, l2, buffer, **common)
    with pytest.raises(ValueError, match="^router_weight: "):
        mt.streamed_mega_moe(y, x, w.float(), router, l1, l2, buffer, **common)
    with pytest.raises(ValueError, match="router_bias"):  # the softmax router takes none (the library's rule)
        mt.streamed_mega_moe(y, x, w, router, l1, l2, buffer, router_bias=torch.zeros(p.num_experts, device="cuda"),
                             **common)
    other = megamoe.softmax_router(p.num_experts, p.top_k + 1)
    with pytest.raises(ValueError, match="call.router"):
        mt.streamed_mega_moe(y, x, w, other, l1, l2, buffer, **common)
    with pytest.raises(ValueError, match="^form: must be 'automatic', 'streamed' or 'batch'"):
        mt.streamed_mega_moe(y, x, w, router, l1, l2, buffer, form="sideways", **common)
    with pytest.raises(ValueError, match="^uniform_tokens: must be an int"):
        mt.streamed_mega_moe(y, x, w, router, l1, l2, buffer, uniform_tokens="4", **common)
    with pytest.raises(ValueError, match="call.uniform_tokens: is 0 or the most tokens any rank has"):
        mt.streamed_mega_moe(y, x, w, router, l1, l2, buffer, uniform_tokens=3, **common)
    # automatic picks batch at every size for now (kStreamedCallsUpToTokens is 0: streamed calls measured slower).
    assert buffer.call_form() == "batch" and buffer.call_form(1) == "batch"
    # Refused calls published nothing: a good call still runs.
    mt.streamed_mega_moe(y, x, w, router, l1, l2, buffer, **common)
    buffer.check_device_error()
    buffer.destroy()
