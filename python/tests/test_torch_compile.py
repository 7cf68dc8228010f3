"""megamoe.torch inside torch.compile, on the CPU (skipped without torch): the calls trace as one graph
through the custom operators torch.ops.megamoe.*, run after the writes into the buffer's input tensors
that precede them, are never dropped, let layers with different weights share one graph, and raise the
eager calls' argument errors. The layer itself is a stand-in here (a buffer whose extension object
records each launch); gpu/test_torch_compiled_layer.py runs the real one."""

import types

import pytest

torch = pytest.importorskip("torch")

import megamoe  # noqa: E402
import megamoe.torch as mt  # noqa: E402

HIDDEN, EXPERTS, TOP_K, MAX_TOKENS = 256, 8, 2, 16


class RecordingCore:
    """Stands in for the extension's symmetric buffer: each launch records the inputs it reads from the
    buffer at that moment and writes y = x * (sum of the route weights), and the routes into the
    statistics, so that a test sees which values a launch read."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.launches = []

    def _record(self, kind, x, idx, w, weights, y, stats64, **extra):
        self.launches.append(dict(kind=kind, x=x.float().clone(), idx=idx.clone(), weights=weights, **extra))
        y.copy_((x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16))
        if stats64 is not None:
            routed = idx[idx >= 0].long()
            stats64 += torch.bincount(routed % self.buffer.num_experts_per_rank,
                                      minlength=self.buffer.num_experts_per_rank)

    def run_from_buffer(self, kind, n, weights, y, stream, stats64, clamp, mx, schedule):
        b = self.buffer
        self._record(kind, b.x[:n], b.topk_idx[:n], b.topk_weights[:n], weights, y, stats64, clamp=clamp,
                     schedule=schedule)

    def run(self, kind, n, x, scales, topk_idx, topk_weights, weights, y, stream, stats64, clamp, schedule):
        """A call of several waves, from the buffer's whole-call input tensors."""
        x = x.view(torch.float8_e4m3fn) if x.dtype == torch.uint8 else x
        self._record(kind, x, topk_idx, topk_weights, weights, y, stats64, clamp=clamp, schedule=schedule)

    def run_streamed(self, router, x, router_weight, router_bias, logits, weights, y, stream, stats64, form,
                     uniform_tokens, topk_idx):
        logits.copy_(x.float() @ router_weight.float().T)
        w, idx = logits.softmax(-1).topk(router.top_k, dim=-1)
        self._record("streamed", x, idx.int(), w, weights, y, stats64, form=form, uniform_tokens=uniform_tokens)


def recording_buffer(recipe="bf16", streaming=False, waves=1):
    """A megamoe.torch.Buffer on the CPU whose launches RecordingCore takes (the attributes Buffer.__init__
    sets from the extension's buffer, for a one-wave buffer of one rank)."""
    b = mt.Buffer.__new__(mt.Buffer)
    b.recipe, b.hidden, b.num_max_tokens_per_rank = recipe, HIDDEN, MAX_TOKENS
    b.num_experts, b.num_topk, b.num_experts_per_rank, b.num_shared_experts = EXPERTS, TOP_K, EXPERTS, 0
    b.rank, b.num_ranks, b.waves_per_call, b.activation_scales = 0, 1, waves, "block"
    b.device, b.streaming = torch.device("cpu"), streaming
    x_dtype = torch.bfloat16 if recipe == "bf16" else torch.float8_e4m3fn
    b._x = b.x = torch.zeros((MAX_TOKENS, HIDDEN), dtype=x_dtype)
    b._x_scales = b.x_sf = None if recipe == "bf16" else torch.ones((MAX_TOKENS, HIDDEN // 128))
    b.topk_idx = torch.full((MAX_TOKENS, TOP_K), -1, dtype=torch.int32)
    b.topk_weights = torch.zeros((MAX_TOKENS, TOP_K))
    b._logits = torch.zeros((MAX_TOKENS, EXPERTS)) if streaming else None
    b._topk_idx_scratch = torch.zeros((MAX_TOKENS, TOP_K), dtype=torch.int32) if streaming else None
    b._stats_scratch = torch.zeros(EXPERTS, dtype=torch.int64)
    b._weights_cache = {}
    b._emulated, b._external_stream = True, types.SimpleNamespace(cuda_stream=0)  # no CUDA stream on the CPU
    b._core = RecordingCore(b)
    b._prepare_compiled_calls()
    return b


def weights(recipe="bf16"):
    """A layer's l1 and l2 (zeros: the stand-in launch reads none of them)."""
    dtype = torch.bfloat16 if recipe == "bf16" else torch.float8_e4m3fn
    l1 = mt.MegaMoeWeights(recipe, 1, EXPERTS, 256, HIDDEN, {"w": torch.zeros((EXPERTS, 256, HIDDEN), dtype=dtype)})
    l2 = mt.MegaMoeWeights(recipe, 2, EXPERTS, HIDDEN, 128, {"w": torch.zeros((EXPERTS, HIDDEN, 128), dtype=dtype)})
    return l1, l2


def weight_tensors(parts):
    """Which weight tensors a launch was given (by address: a compiled call hands over the tensors)."""
    return [None if part is None else part.tensors["w"].data_ptr() for part in parts]


@pytest.fixture(autouse=True)
def cpu_weights(monkeypatch):
    """The extension's weight view needs CUDA tensors: a stand-in naming the weights it was made from."""
    monkeypatch.setattr(mt, "_layer_weights", lambda buffer, parts: parts)
    torch._dynamo.reset()


def inputs(seed, n, recipe="bf16"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16 if recipe == "bf16" else torch.float8_e4m3fn)
    idx = torch.randint(0, EXPERTS, (n, TOP_K), generator=g, dtype=torch.int32)
    return x, idx, torch.rand((n, TOP_K), generator=g)


def test_the_operators_are_registered():
    layer = torch.ops.megamoe.mega_moe.default._schema
    streamed = torch.ops.megamoe.streamed_mega_moe.default._schema
    assert [a.name for a in layer.arguments if a.is_write] == ["y", "stats", "order"]
    assert [a.name for a in streamed.arguments if a.is_write] == ["y", "stats", "router_logits", "order"]
    assert not layer.returns and not streamed.returns


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_compiled_call_is_one_graph_and_reads_what_was_written_before_it(backend):
    b, (l1, l2) = recording_buffer(), weights()
    stats = torch.zeros(EXPERTS, dtype=torch.int64)

    def step(x, idx, w, y):
        n = x.shape[0]
        b.x[:n].copy_(x)
        b.topk_idx[:n].copy_(idx)
        b.topk_weights[:n].copy_(w)
        mt.bf16_mega_moe(y, l1, l2, b, stats, schedule="fused")
        return y.float() * 2

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for seed, n in ((1, 5), (2, 5), (3, 9)):
        x, idx, w = inputs(seed, n)
        y = torch.empty((n, HIDDEN), dtype=torch.bfloat16)
        before = stats.clone()
        out = compiled(x, idx, w, y)
        launch = b._core.launches[-1]
        assert torch.equal(launch["x"], x.float()) and torch.equal(launch["idx"], idx), "the launch read stale inputs"
        assert launch["schedule"] == "fused" and weight_tensors(launch["weights"]) == weight_tensors((l1, l2, None, None))
        want = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)
        assert torch.equal(y, want) and torch.equal(out, want.float() * 2)
        assert torch.equal(stats - before, torch.bincount(idx.flatten().long(), minlength=EXPERTS))
    assert len(b._core.launches) == 3


def test_compiled_and_eager_calls_agree_for_fp8():
    b, (l1, l2) = recording_buffer("fp8"), weights("fp8")

    def step(x, idx, w, y, stats):
        n = x.shape[0]
        b.x[:n].copy_(x)
        b.topk_idx[:n].copy_(idx)
        b.topk_weights[:n].copy_(w)
        mt.fp8_mega_moe(y, l1, l2, b, stats, recipe=(1, 128, 128), activation_clamp=10)
        return y

    x, idx, w = inputs(4, 7, "fp8")
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        y, stats = torch.empty((7, HIDDEN), dtype=torch.bfloat16), torch.zeros(EXPERTS, dtype=torch.int32)
        results.append((fn(x, idx, w, y, stats).clone(), stats.clone(), b._core.launches[-1]["clamp"]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2] == 10.0


def test_argument_errors_raise_as_in_eager_calls():
    b, (l1, l2) = recording_buffer(), weights()
    y = torch.empty((4, HIDDEN), dtype=torch.bfloat16)
    cases = [(dict(schedule="overlapped"), "^schedule: must be 'staged' or 'fused'"),
             (dict(activation_clamp=-1.0), "^activation_clamp"),
             (dict(l1="weights"), "^l1_weights: must come from transform_weights_for_mega_moe"),
             (dict(y=y[:, :128]), "^y: must be bfloat16"),
             (dict(stats=torch.zeros(3, dtype=torch.int64)), "^cumulative_local_expert_recv_stats")]
    for change, message in cases:
        args = dict(y=y, l1=l1, l2=l2, stats=None, schedule="staged", activation_clamp=None)
        args.update(change)

        def call(args=args):
            mt.bf16_mega_moe(args["y"], args["l1"], args["l2"], b, args["stats"], schedule=args["schedule"],
                             activation_clamp=args["activation_clamp"])

        for fn in (call, torch.compile(call, backend="eager")):
            with pytest.raises(ValueError, match=message):
                fn()
    assert not b._core.launches


def test_a_compiled_call_of_several_waves_reads_what_was_written_before_it():
    """With waves the input tensors are ordinary ones of a whole call, handed to the library's wave loop."""
    b, (l1, l2) = recording_buffer(waves=2), weights()

    def step(x, idx, w, y):
        n = x.shape[0]
        b.x[:n].copy_(x)
        b.topk_idx[:n].copy_(idx)
        b.topk_weights[:n].copy_(w)
        mt.bf16_mega_moe(y, l1, l2, b)
        return y

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for seed in (8, 9):
        x, idx, w = inputs(seed, 12)
        y = compiled(x, idx, w, torch.empty((12, HIDDEN), dtype=torch.bfloat16))
        assert torch.equal(b._core.launches[-1]["x"], x.float())
        assert torch.equal(y, (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16))


def test_the_operator_passes_opcheck():
    """torch.library.opcheck: the schema's mutations are the ones the operator makes, its fake form and
    the compiler's functional form (which may hand it copies of the inputs) run alike."""
    b, (l1, l2) = recording_buffer(), weights()
    x, idx, w = inputs(5, 6)
    b.x[:6].copy_(x)
    b.topk_idx[:6].copy_(idx)
    b.topk_weights[:6].copy_(w)
    y, stats = torch.zeros((6, HIDDEN), dtype=torch.bfloat16), torch.zeros(EXPERTS, dtype=torch.int64)
    args = (y, stats, b._order, b.x[:6], None, b.topk_idx[:6], b.topk_weights[:6], mt._flat_weights((l1, l2, None, None)),
            b._handle, "bf16", None, "swiglu", None, None, "staged")
    torch.library.opcheck(torch.ops.megamoe.mega_moe.default, args)


@pytest.mark.skipif(not mt.STREAMED_CALLS_COMPILE, reason="streamed calls compile from torch 2.15 on")
def test_a_compiled_streamed_call_is_one_graph():
    b, (l1, l2) = recording_buffer(streaming=True), weights()
    router = megamoe.softmax_router(EXPERTS, TOP_K)
    router_weight = torch.randn((EXPERTS, HIDDEN), generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)

    def step(x, y, logits):
        mt.streamed_mega_moe(y, x, router_weight, router, l1, l2, b, router_logits=logits, form="batch",
                             uniform_tokens=8)
        return logits.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn((8, HIDDEN), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    y, logits = torch.empty((8, HIDDEN), dtype=torch.bfloat16), torch.zeros((8, EXPERTS))
    total = compiled(x, y, logits)
    launch = b._core.launches[-1]
    assert launch["form"] == "batch" and launch["uniform_tokens"] == 8 and torch.equal(launch["x"], x.float())
    assert torch.allclose(logits, x.float() @ router_weight.float().T) and torch.allclose(total, logits.sum())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_call_whose_outputs_nothing_reads_still_launches(backend):
    """A call is a collective: a rank with no tokens calls too and may discard y. Nothing reads the
    operator's outputs then, but it writes the buffer's _order tensor, so the compiler keeps it."""
    b, (l1, l2) = recording_buffer(), weights()

    def idle_step(h):
        mt.bf16_mega_moe(torch.empty((0, HIDDEN), dtype=torch.bfloat16), l1, l2, b)
        return h + 1

    torch.compile(idle_step, backend=backend, fullgraph=True)(torch.ones(3))
    assert len(b._core.launches) == 1


@pytest.mark.skipif(not mt.STREAMED_CALLS_COMPILE, reason="streamed calls compile from torch 2.15 on")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_streamed_call_whose_outputs_nothing_reads_still_launches(backend):
    b, (l1, l2) = recording_buffer(streaming=True), weights()
    router = megamoe.softmax_router(EXPERTS, TOP_K)
    router_weight = torch.randn((EXPERTS, HIDDEN), generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)

    def step(x):
        mt.streamed_mega_moe(torch.empty((x.shape[0], HIDDEN), dtype=torch.bfloat16), x, router_weight, router, l1, l2,
                             b, form="batch")
        return x + 1

    torch.compile(step, backend=backend, fullgraph=True)(torch.ones((4, HIDDEN), dtype=torch.bfloat16))
    assert len(b._core.launches) == 1


def test_layers_with_their_own_weights_share_one_compiled_graph():
    """Compiling each MoE block (module.compile(), as for repeated layers): the weights cross as tensors,
    so twelve layers with weights of their own run one graph, past Dynamo's limit of eight recompiles
    (their tensors marked as static addresses, as transform_weights_for_mega_moe marks them)."""
    b = recording_buffer()

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = weights()
            for tensor in (*self.l1.tensors.values(), *self.l2.tensors.values()):
                torch._dynamo.mark_static_address(tensor)

        def forward(self, x, idx, w):
            n = x.shape[0]
            b.x[:n].copy_(x)
            b.topk_idx[:n].copy_(idx)
            b.topk_weights[:n].copy_(w)
            y = torch.empty((n, HIDDEN), dtype=torch.bfloat16)
            mt.bf16_mega_moe(y, self.l1, self.l2, b)
            return y

    layers = [MoE() for _ in range(12)]
    for layer in layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    x, idx, w = inputs(11, 4)
    for layer in layers:
        layer(x, idx, w)
    assert [weight_tensors(launch["weights"])[:2] for launch in b._core.launches] == \
        [weight_tensors((layer.l1, layer.l2)) for layer in layers]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_two_layers_on_one_buffer_in_one_graph_match_eager(backend):
    b, first, second = recording_buffer(), weights(), weights()

    def two(x, idx, w):
        n = x.shape[0]
        b.x[:n].copy_(x)
        b.topk_idx[:n].copy_(idx)
        b.topk_weights[:n].copy_(w)
        y1 = torch.empty((n, HIDDEN), dtype=torch.bfloat16)
        mt.bf16_mega_moe(y1, *first, b)
        b.x[:n].copy_(y1 + 1)
        y2 = torch.empty((n, HIDDEN), dtype=torch.bfloat16)
        mt.bf16_mega_moe(y2, *second, b)
        return y1, y2

    x, idx, w = inputs(12, 6)
    want = [t.clone() for t in two(x, idx, w)]
    got = torch.compile(two, backend=backend, fullgraph=True)(x, idx, w)
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    assert [weight_tensors(launch["weights"])[:2] for launch in b._core.launches[2:]] == \
        [weight_tensors(first), weight_tensors(second)]


def test_an_argument_error_under_fullgraph_names_the_argument():
    """With fullgraph=True Dynamo reports the ValueError as its own Unsupported error, whose message
    holds the ValueError's (docs/python.md says so)."""
    b, (l1, l2) = recording_buffer(), weights()

    def call(y):
        mt.bf16_mega_moe(y, l1, l2, b, schedule="overlapped")

    with pytest.raises(Exception, match="schedule: must be 'staged' or 'fused'"):
        torch.compile(call, backend="aot_eager", fullgraph=True)(torch.empty((4, HIDDEN), dtype=torch.bfloat16))
    assert not b._core.launches
