"""The layer on torch tensors, with calls shaped like DeepGEMM's MegaMoE (``deep_gemm.mega``).

Upstream (Blackwell)                               here (Hopper)
``deep_gemm.get_symm_buffer_for_mega_moe(...)``    :func:`get_symm_buffer_for_mega_moe` (same arguments)
``deep_gemm.transform_weights_for_mega_moe(...)``  :func:`transform_weights_for_mega_moe`
``deep_gemm.fp8_fp4_mega_moe(y, l1, l2, buf, ...)`` :func:`fp8_fp4_mega_moe` (same arguments)
``deep_gemm.bf16_mega_moe(y, l1, l2, buf, ...)``    :func:`bf16_mega_moe`
(none)                                              :func:`fp8_mega_moe` (DeepSeek-V3's 128x128 FP8 weights)

A :class:`Buffer` bootstraps this library's own NCCL communicator from a unique id broadcast over any
``torch.distributed`` group (NCCL or gloo), allocates the symmetric buffer (collective; ranks whose
shapes disagree all raise ValueError naming the field), and exposes its input regions as torch tensors:
write ``x``, ``x_sf``, ``topk_idx`` and ``topk_weights`` into their first ``num_tokens`` rows, then call.
Calls run on torch's current stream with no host synchronization and no allocation, so they can be
captured with ``torch.cuda.graph``; inside ``torch.compile`` they run as the custom operators
``torch.ops.megamoe.mega_moe`` and ``megamoe::streamed_mega_moe`` (no graph break).
Argument errors raise ValueError naming the argument; errors the
kernels record (an expert id outside [-1, num_experts), a timeout) surface as RuntimeError from
:meth:`Buffer.check_device_error`, which synchronizes. See docs/python.md.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import _megamoe, make_problem

try:
    import torch
except ImportError as error:
    if "nccl" not in str(error).lower():
        raise
    # A process holds one libnccl.so.2: the first loaded, here the one megamoe's extension was built with.
    raise ImportError(f"megamoe.torch: torch could not load its CUDA library beside the NCCL that megamoe "
                      f"loaded ({error}). Import torch before megamoe, and build megamoe against torch's NCCL "
                      f"(NCCL_ROOT=<the venv's nvidia/nccl> pip install .): megamoe refuses another NCCL "
                      f"release than its build's when it creates a communicator") from error
import torch.distributed as dist

__all__ = [
    "Buffer",
    "MegaMoeWeights",
    "get_symm_buffer_for_mega_moe",
    "transform_weights_for_mega_moe",
    "fp8_mega_moe",
    "fp8_fp4_mega_moe",
    "bf16_mega_moe",
    "emulated_group",
    "streamed_mega_moe",
]

_E4M3 = torch.float8_e4m3fn
_MMA_TYPES = {"fp8xfp4": "fp8_fp4", "fp8xfp8": "fp8", "bf16xbf16": "bf16"}
_RECIPES = ("fp8", "fp8_fp4", "bf16")


def _stream_of(stream) -> int:
    return stream.cuda_stream if hasattr(stream, "cuda_stream") else int(stream)


def _nccl_communicator(group, device: int):
    """This library's NCCL communicator over the ranks of `group`, bootstrapped through it."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return _megamoe.nccl_communicator(_megamoe.nccl_unique_id(), 1, 0, device)
    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    unique_id = [_megamoe.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0), group=group)
    return _megamoe.nccl_communicator(unique_id[0], size, rank, device)


def _copy_problem(problem):
    copy = _megamoe.Problem()
    for name in ("num_ranks", "rank", "num_experts", "top_k", "hidden", "intermediate", "num_shared_experts",
                 "max_tokens_per_rank", "recipe", "recv_capacity", "wave_tokens", "front_num_slots",
                 "front_tokens_per_slot"):
        setattr(copy, name, getattr(problem, name))
    return copy


def emulated_group(num_ranks: int):
    """R ranks emulated in this process on one GPU (for tests): ``group.communicator(rank, device)`` gives
    rank r's communicator, for ``Buffer(communicator=...)``; each rank then needs its own host thread to
    create its buffer (collective), and its calls run on the rank's own stream (``Buffer.stream``). The
    process must start with CUDA_MODULE_LOADING=EAGER and CUDA_DEVICE_MAX_CONNECTIONS=32 in its
    environment (before CUDA is initialized), or a rank's spin-wait can starve another's launch."""
    return _megamoe.EmulatedGroup(num_ranks)


def _call_input(problem, name: str, device) -> torch.Tensor:
    """A whole call's input `name` (as a buffer region, with max_tokens_per_rank rows), zeroed."""
    columns = {"x": problem.hidden, "x_scales": problem.hidden // 128, "topk_idx": problem.top_k,
               "topk_weights": problem.top_k}[name]
    dtype = {"x": torch.bfloat16 if problem.recipe == "bf16" else torch.uint8, "x_scales": torch.float32,
             "topk_idx": torch.int32, "topk_weights": torch.float32}[name]
    return torch.zeros((problem.max_tokens_per_rank, columns), dtype=dtype, device=device)


class Buffer:
    """The symmetric buffer of one layer shape on this rank (collective: every rank of the group creates
    one with the same shapes).

    Either ``problem`` (a :class:`megamoe.Problem`, e.g. from :func:`megamoe.preset_problem`) or the
    keyword shapes (DeepGEMM's names) describe the layer; the rank and the number of ranks come from the
    group. ``recv_capacity`` (default: the problem's, 0 = the worst case) bounds the routes one rank
    receives per wave and with it the buffer; a wave past it writes no output and
    :meth:`check_device_error` raises on every rank. ``wave_tokens`` (default: the problem's, 0 = chosen
    from the buffer size, see :func:`megamoe.make_problem`) sizes the buffer for that many tokens per
    rank: a larger call runs in waves, every rank running every wave, and the input tensors below are
    then ordinary device tensors of max tokens rows (the symmetric ones hold one wave).
    ``activation_scales`` says how ``x_sf`` holds the activation scales of the fp8 recipes:
    ``"block"``: float32 [tokens, hidden / 128], one scale per 1x128 (the library's own format, read in
    place); ``"mx"`` (fp8_fp4 only): DeepGEMM's recipe (1, 1, 32), UE8M0 per 32 packed four to an int32
    [tokens, hidden / 128], converted on the GPU at each call (``megamoe/mx.h``: exact wherever the
    values are representable). Tensors:

    - ``x``: [max tokens, hidden] float8_e4m3fn (fp8 recipes) or bfloat16;
    - ``x_sf``: as above (not for bf16);
    - ``topk_idx``: [max tokens, top_k] int32 (-1 = masked route); ``topk_weights``: float32.

    ``streaming=True`` gives the buffer a front ring, so that :func:`streamed_mega_moe` can run the router
    and the quantization into it and the layer read it there; the buffer is then one wave of
    ``num_max_tokens_per_rank``. ``chunk_tokens`` cuts each call's tokens into chunks of that many, which
    the producers publish and the layer reads one by one (default: a whole call in one chunk).
    """

    def __init__(self, group=None, problem=None, *, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, num_topk: Optional[int] = None,
                 hidden: Optional[int] = None, intermediate_hidden: Optional[int] = None,
                 num_shared_experts: int = 0, recipe: Optional[str] = None, activation_scales: str = "block",
                 recv_capacity: Optional[int] = None, wave_tokens: Optional[int] = None, communicator=None,
                 streaming: bool = False, chunk_tokens: Optional[int] = None):
        if communicator is None:
            if not torch.cuda.is_available():
                raise RuntimeError("Buffer: no CUDA device is available")
            device = torch.cuda.current_device()
            rank = dist.get_rank(group) if group is not None or (dist.is_available() and dist.is_initialized()) else 0
            size = dist.get_world_size(group) if group is not None or (dist.is_available() and dist.is_initialized()) else 1
        else:
            device, rank, size = communicator.device, communicator.rank, communicator.size
        if problem is None:
            missing = [n for n, v in (("num_experts", num_experts), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                                      ("num_topk", num_topk), ("hidden", hidden),
                                      ("intermediate_hidden", intermediate_hidden)) if v is None]
            if missing:
                raise ValueError(f"{missing[0]}: is required when no problem is given")
            problem = make_problem(num_experts=num_experts, top_k=num_topk, hidden=hidden,
                                   intermediate=intermediate_hidden, max_tokens_per_rank=num_max_tokens_per_rank,
                                   num_ranks=size, rank=rank, num_shared_experts=num_shared_experts,
                                   recipe=recipe or "fp8_fp4", validate=False)
        else:
            problem = _copy_problem(problem)
            if recipe is not None:
                problem.recipe = recipe
            problem.num_ranks, problem.rank = size, rank
        if recv_capacity is not None:
            problem.recv_capacity = recv_capacity
        if wave_tokens is not None:
            problem.wave_tokens = wave_tokens
        if streaming:
            if activation_scales != "block":
                raise ValueError("activation_scales: a streaming buffer quantizes x itself into 1x128 blocks "
                                 f"('block'), got {activation_scales!r}")
            if wave_tokens not in (None, 0, problem.max_tokens_per_rank):
                raise ValueError(f"wave_tokens: a streaming buffer holds a whole call "
                                 f"({problem.max_tokens_per_rank} tokens), got {wave_tokens}")
            if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
                raise ValueError(f"chunk_tokens: must be a positive int, got {chunk_tokens!r}")
            problem.wave_tokens = problem.max_tokens_per_rank
            problem.front_num_slots, problem.front_tokens_per_slot = _megamoe.front_ring_shape(
                problem.max_tokens_per_rank, chunk_tokens or 0)
        elif chunk_tokens is not None:
            raise ValueError("chunk_tokens: cuts streamed calls: it needs streaming=True")
        if activation_scales not in ("block", "mx"):
            raise ValueError(f"activation_scales: must be 'block' or 'mx', got {activation_scales!r}")
        if activation_scales == "mx" and problem.recipe != "fp8_fp4":
            raise ValueError(f"activation_scales: 'mx' needs recipe fp8_fp4, got {problem.recipe}")
        # The problem is checked on every rank inside the collective creation (all raise together).
        self.group = group
        self.activation_scales = activation_scales
        self._comm = communicator if communicator is not None else _nccl_communicator(group, device)
        self._core = _megamoe.SymmBuffer(self._comm, problem)
        self.problem = self._core.problem
        self.device = torch.device("cuda", self._core.device)
        p = self.problem
        self.rank, self.num_ranks = p.rank, p.num_ranks
        self.num_experts, self.num_topk, self.hidden = p.num_experts, p.top_k, p.hidden
        self.intermediate_hidden, self.num_max_tokens_per_rank = p.intermediate, p.max_tokens_per_rank
        self.num_shared_experts, self.recipe = p.num_shared_experts, p.recipe
        self.num_experts_per_rank = p.experts_per_rank
        self.num_bytes = self._core.total_bytes
        self.waves_per_call = p.waves_per_call
        if self.waves_per_call == 1:
            region = lambda name: torch.from_dlpack(self._core.region(name))  # noqa: E731
        else:
            # The symmetric regions hold one wave, so a whole call's inputs live in tensors of their own,
            # which each call hands over wave by wave.
            region = lambda name: _call_input(p, name, self.device)  # noqa: E731
        self._x = region("x")
        if p.recipe != "bf16":
            self._x = self._x.view(_E4M3)
            self._x_scales = region("x_scales")
        else:
            self._x_scales = None
        self.topk_idx = region("topk_idx")
        self.topk_weights = region("topk_weights")
        if activation_scales == "mx":
            # Staging tensors the caller writes; each call converts them into the kernels' 1x128 blocks
            # (the symmetric regions, or with waves the whole-call tensors).
            self.x = torch.zeros(tuple(self._x.shape), dtype=torch.uint8, device=self.device).view(_E4M3)
            self.x_sf = torch.zeros((p.max_tokens_per_rank, p.hidden // 128), dtype=torch.int32, device=self.device)
            if self.waves_per_call == 1:
                self._core.set_mx_staging(self.x.view(torch.uint8), self.x_sf.view(torch.uint8))
        else:
            self.x, self.x_sf = self._x, self._x_scales
        self._prepare_compiled_calls()
        self.streaming = p.front_tokens_per_slot > 0
        # Streamed calls' scratch: the router's logits and the batch form's routes (made here, so that
        # no call allocates).
        self._logits = self._topk_idx_scratch = None
        if self.streaming:
            self._logits = torch.empty((p.max_tokens_per_rank, p.num_experts), dtype=torch.float32, device=self.device)
            self._topk_idx_scratch = torch.empty((p.max_tokens_per_rank, p.top_k), dtype=torch.int32,
                                                 device=self.device)
        self._stats_scratch = torch.zeros(p.experts_per_rank, dtype=torch.int64, device=self.device)
        self._weights_cache: Dict[tuple, tuple] = {}
        self._emulated = bool(self._comm.emulated)
        self._external_stream = (torch.cuda.ExternalStream(self._comm.stream, device=self.device)
                                 if self._emulated else None)

    def _prepare_compiled_calls(self) -> None:
        """What calls inside torch.compile need ("Inside torch.compile" below): the buffer's handle, the
        tensor their operators declare they write, and the input tensors' fixed addresses, so that CUDA
        graphs of torch.compile (mode "reduce-overhead") may record steps that write into them."""
        self._handle = next(_HANDLES)
        _BUFFERS[self._handle] = self
        self._order = torch.zeros(1, dtype=torch.int32, device=self.device)
        _enable_compiled_calls()
        for tensor in (self.x, self.x_sf, self.topk_idx, self.topk_weights, self._order):
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)

    @property
    def stream(self):
        """The stream calls run on: torch's current stream, or an emulated rank's own."""
        return self._external_stream if self._emulated else torch.cuda.current_stream(self.device)

    def check_device_error(self) -> None:
        """Waits for the calls so far, then raises RuntimeError with the first error the kernels recorded
        (rank, block, the id or what was waited on, expected and seen values) and clears it. After a
        timeout, create a new buffer."""
        self._core.check_device_error(_stream_of(self.stream))

    def call_form(self, uniform_tokens: Optional[int] = None) -> str:
        """The form, ``"streamed"`` or ``"batch"``, that :func:`streamed_mega_moe` with ``form="automatic"``
        takes for a call of ``uniform_tokens`` (default: ``num_max_tokens_per_rank``)."""
        if self._core is None:
            raise ValueError("sym_buffer: was destroyed")
        return self._core.call_form(uniform_tokens or 0)

    def destroy(self) -> None:
        """Frees the buffer and this library's communicator (collective: every rank calls it). Without it
        both are left to process exit, since freeing them waits for every rank."""
        if self._core is not None:
            # Calls still running may read peers' buffers: wait for this rank's (an emulated rank waits for
            # its own stream only, since another rank's kernels may still wait for this one's).
            if self._emulated:
                self.stream.synchronize()
            else:
                torch.cuda.synchronize(self.device)
        self.x = self.x_sf = self.topk_idx = self.topk_weights = self._x = self._x_scales = self._logits = None
        self._topk_idx_scratch = None
        self._weights_cache.clear()
        if self._core is not None:
            self._core.destroy()
            self._core = None
        if self._comm is not None and not self._emulated:
            self._comm.close()
        self._comm = None

    def __repr__(self) -> str:
        return (f"megamoe.torch.Buffer(rank {self.rank}/{self.num_ranks}, {self.problem.describe()}, "
                f"{self.num_bytes / 2 ** 20:.1f} MiB, activation_scales={self.activation_scales})")


def get_symm_buffer_for_mega_moe(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                                 hidden: int, intermediate_hidden: int, use_fp8_dispatch: Optional[bool] = None,
                                 mma_type: str = "fp8xfp4", activation: str = "swiglu", *,
                                 num_shared_experts: int = 0, activation_scales: Optional[str] = None,
                                 recv_capacity: int = 0, wave_tokens: int = 0) -> Buffer:
    """DeepGEMM's buffer getter: ``mma_type`` 'fp8xfp4' (MXFP4 weights; activations with UE8M0 scales per
    32 by default, as upstream), 'fp8xfp8' (this library's fp8 recipe: 128x128 FP32 weight scales, 1x128
    activation scales; upstream's is per-32 UE8M0) or 'bf16xbf16'."""
    if activation != "swiglu":
        raise ValueError(f"activation: only 'swiglu' is supported, got {activation!r}")
    if mma_type not in _MMA_TYPES:
        raise ValueError(f"mma_type: must be one of {', '.join(_MMA_TYPES)}, got {mma_type!r}")
    if use_fp8_dispatch is not None and use_fp8_dispatch != mma_type.startswith("fp8"):
        raise ValueError(f"use_fp8_dispatch: {use_fp8_dispatch} contradicts mma_type {mma_type!r}")
    recipe = _MMA_TYPES[mma_type]
    if activation_scales is None:
        activation_scales = "mx" if recipe == "fp8_fp4" else "block"
    return Buffer(group, num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
                  hidden=hidden, intermediate_hidden=intermediate_hidden, num_shared_experts=num_shared_experts,
                  recipe=recipe, activation_scales=activation_scales, recv_capacity=recv_capacity,
                  wave_tokens=wave_tokens)


# ---- Weights -------------------------------------------------------------------------------------------


@dataclass(eq=False)
class MegaMoeWeights:
    """One linear's weights for all of a rank's experts (or for the shared experts), in the layout the
    kernels read. Made by :func:`transform_weights_for_mega_moe`; pass it to the calls as it is."""

    recipe: str
    linear: int  # 1 or 2
    num_experts: int
    rows: int  # 2I for L1, H for L2
    cols: int  # H for L1, I for L2
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)  # w, scales, shifts
    _key: Optional[tuple] = field(default=None, init=False, repr=False)

    def cache_key(self) -> tuple:
        """Its linear and its tensors' addresses, shapes and dtypes: what names its view in the extension.
        Made once per object: an eager call's weights are the same objects call after call, and the key
        costs several microseconds of host time to build."""
        if self._key is None:
            self._key = (self.linear,) + tuple(
                (name, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in sorted(self.tensors.items()))
        return self._key


def _ue8m0_codes(sf: torch.Tensor, shape, name: str) -> torch.Tensor:
    """MXFP4 scales as UE8M0 bytes [.., rows, cols / 32] from uint8, float8_e8m0fnu, float32 powers of
    two, or int32 with four codes packed per word (DeepGEMM's)."""
    e, rows, groups = shape
    if sf.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        codes = sf.view(torch.uint8)
    elif sf.dtype == torch.int32 and tuple(sf.shape) == (e, rows, groups // 4):
        codes = sf.contiguous().view(torch.uint8)
    elif sf.dtype == torch.float32:
        bits = sf.contiguous().view(torch.int32)
        exponent = (bits >> 23) & 0xFF
        if bool(((bits < 0) | ((bits & 0x7FFFFF) != 0) | (exponent == 0) | (exponent == 0xFF)).any()):
            raise ValueError(f"{name}: float32 MXFP4 scales must be positive, finite powers of two (normal floats)")
        codes = exponent.to(torch.uint8)
    else:
        raise ValueError(f"{name}: MXFP4 scales must be uint8 (UE8M0), float8_e8m0fnu, float32 powers of two or "
                         f"packed int32, got {sf.dtype}")
    if tuple(codes.shape) != (e, rows, groups):
        raise ValueError(f"{name}: must have shape {[e, rows, groups]} (UE8M0 per 32), got {list(sf.shape)}")
    return codes.contiguous()


def _as_experts(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()  # parameters: the layer only reads them
    return t.unsqueeze(0) if t.dim() == 2 else t


def _infer_recipe(l1) -> str:
    if isinstance(l1, torch.Tensor):
        return "bf16"
    w = l1[0]
    if w.dtype == _E4M3:
        return "fp8"
    if w.dtype in (torch.int8, torch.uint8) or w.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return "fp8_fp4"
    raise ValueError(f"l1_weights: cannot tell the recipe from dtype {w.dtype} (float8_e4m3fn: fp8, packed int8 "
                     f"or uint8: fp8_fp4, a bfloat16 tensor: bf16)")


def _transform_linear(recipe: str, linear: int, weights, name: str) -> MegaMoeWeights:
    if recipe == "bf16":
        if not isinstance(weights, torch.Tensor) or weights.dtype != torch.bfloat16:
            raise ValueError(f"{name}: bf16 weights must be one bfloat16 tensor [experts, rows, cols]")
        w, sf = _as_experts(weights), None
    else:
        if not (isinstance(weights, (tuple, list)) and len(weights) == 2):
            raise ValueError(f"{name}: {recipe} weights must be a (weights, scales) pair")
        if not all(isinstance(t, torch.Tensor) for t in weights):
            raise ValueError(f"{name}: {recipe} weights must be a pair of torch tensors (weights, scales)")
        w, sf = _as_experts(weights[0]), _as_experts(weights[1])
    if w.dim() != 3 or not w.is_cuda:
        raise ValueError(f"{name}: must be a CUDA tensor [experts, rows, cols], got {list(w.shape)} on {w.device}")
    e, rows = w.shape[0], w.shape[1]
    cols = w.shape[2] * (2 if recipe == "fp8_fp4" else 1)
    if rows % 128 or cols % 128:
        raise ValueError(f"{name}: rows and columns must be multiples of 128, got {rows} x {cols}")
    out = MegaMoeWeights(recipe, linear, e, rows, cols)
    if linear == 1:
        if rows % 256:
            raise ValueError(f"{name}: L1 rows (2 * intermediate) must be a multiple of 256, got {rows}")
        canonical = torch.from_numpy(_megamoe.l1_canonical_rows(rows // 2)).to(w.device)
    if recipe == "fp8":
        if w.dtype != _E4M3:
            raise ValueError(f"{name}: fp8 weights must be float8_e4m3fn, got {w.dtype}")
        if sf.dtype != torch.float32 or tuple(sf.shape) != (e, rows // 128, cols // 128):
            raise ValueError(f"{name}: fp8 scales must be float32 [{e}, {rows // 128}, {cols // 128}] (128x128 blocks),"
                             f" got {sf.dtype} {list(sf.shape)}")
        codes = w.view(torch.uint8)  # FP8 tensors support few ops; the transform only moves bytes
        if linear == 1:
            codes = codes.index_select(1, canonical)
            scales = sf.index_select(1, canonical[::64] // 128)
        else:
            scales = sf.repeat_interleave(2, dim=1)
        out.tensors = {"w": codes.contiguous().view(_E4M3), "scales": scales.contiguous()}
    elif recipe == "fp8_fp4":
        if w.dtype not in (torch.int8, torch.uint8) and w.dtype != getattr(torch, "float4_e2m1fn_x2", None):
            raise ValueError(f"{name}: fp8_fp4 weights must be packed E2M1 pairs (int8 or uint8), got {w.dtype}")
        codes = w.view(torch.uint8)
        mx = _ue8m0_codes(sf, (e, rows, cols // 32), name)
        if linear == 1:
            codes, mx = codes.index_select(1, canonical), mx.index_select(1, canonical)
        codes = codes.contiguous().clone() if linear == 2 else codes.contiguous()  # prepared in place below
        block_scales = torch.empty((e, rows // 64, cols // 128), dtype=torch.float32, device=w.device)
        shifts = torch.empty((cols // 128, e * rows, 4), dtype=torch.uint8, device=w.device)
        with torch.cuda.device(w.device):
            _megamoe.prepare_fp4_weights(codes.view(e * rows, cols // 2), mx.contiguous().view(e * rows, cols // 32),
                                         block_scales.view(e * rows // 64, cols // 128), shifts,
                                         torch.cuda.current_stream().cuda_stream)
        out.tensors = {"w": codes, "scales": block_scales, "shifts": shifts}
    else:
        out.tensors = {"w": (w.index_select(1, canonical) if linear == 1 else w).contiguous()}
    return out


@torch.no_grad()
def transform_weights_for_mega_moe(l1_weights, l2_weights, activation: str = "swiglu", *,
                                   recipe: Optional[str] = None) -> Tuple[MegaMoeWeights, MegaMoeWeights]:
    """Canonical weights of this rank's experts (or of the shared experts) -> the kernels' layout, on their
    GPU, once at load. Canonical, per recipe (W1 rows: gate 0..I-1, then up; E may be left out for the
    shared experts, whose S experts come concatenated as one of intermediate S*I):

    - fp8: ``l1 = (w1 float8_e4m3fn [E, 2I, H], float32 [E, 2I/128, H/128])``, ``l2 = (w2 [E, H, I],
      float32 [E, H/128, I/128])`` (DeepSeek-V3's block scales);
    - fp8_fp4: ``l1 = (w1 int8/uint8 [E, 2I, H/2] (E2M1 pairs, low nibble first), scales [E, 2I, H/32])``
      with UE8M0 scales as uint8, float8_e8m0fnu, float32 powers of two, or int32 packing four
      ([E, 2I, H/128], DeepGEMM's); ``l2`` likewise [E, H, I/2];
    - bf16: ``l1 = w1 bfloat16 [E, 2I, H]``, ``l2 = w2 [E, H, I]``.
    """
    if activation != "swiglu":
        raise ValueError(f"activation: only 'swiglu' is supported, got {activation!r}")
    recipe = recipe or _infer_recipe(l1_weights)
    if recipe not in _RECIPES:
        raise ValueError(f"recipe: must be one of {', '.join(_RECIPES)}, got {recipe!r}")
    l1 = _transform_linear(recipe, 1, l1_weights, "l1_weights")
    l2 = _transform_linear(recipe, 2, l2_weights, "l2_weights")
    for tensor in (*l1.tensors.values(), *l2.tensors.values()):
        torch._dynamo.mark_static_address(tensor)  # never move: CUDA graphs of torch.compile need not copy them
    if l1.num_experts != l2.num_experts or l1.rows != 2 * l2.cols or l1.cols != l2.rows:
        raise ValueError(f"l2_weights: [{l2.num_experts}, {l2.rows}, {l2.cols}] does not match l1_weights "
                         f"[{l1.num_experts}, {l1.rows}, {l1.cols}] (expected [E, H, I] for l1 [E, 2I, H])")
    return l1, l2


_WEIGHT_ARGUMENTS = ("l1_weights", "l2_weights", "shared_l1_weights", "shared_l2_weights")


def _check_weights(buffer: Buffer, parts) -> None:
    """The four weight arguments (l1, l2, shared l1, shared l2) against the buffer."""
    for part, name in zip(parts, _WEIGHT_ARGUMENTS):
        if part is None:
            continue
        if not isinstance(part, MegaMoeWeights):
            raise ValueError(f"{name}: must come from transform_weights_for_mega_moe, got {type(part).__name__}")
        if part.recipe != buffer.recipe:
            raise ValueError(f"{name}: were prepared for recipe {part.recipe}, the buffer is for {buffer.recipe}")
    shared_l1, shared_l2 = parts[2], parts[3]
    if (shared_l1 is None) != (shared_l2 is None):
        raise ValueError("shared_l1_weights: shared_l1_weights and shared_l2_weights come together")
    if buffer.num_shared_experts > 0 and shared_l1 is None:
        raise ValueError(f"shared_l1_weights: the buffer has {buffer.num_shared_experts} shared experts; pass their "
                         f"weights (transform_weights_for_mega_moe of the concatenated experts)")
    if buffer.num_shared_experts == 0 and shared_l1 is not None:
        raise ValueError("shared_l1_weights: the buffer was made with num_shared_experts=0")


def _layer_weights(buffer: Buffer, parts):
    """The extension's view of checked weights, made once per buffer and set of weight tensors (a compiled
    call hands over the tensors, not the MegaMoeWeights objects; the cache keeps them, so no other
    tensor takes their addresses)."""
    key = tuple(None if part is None else part.cache_key() for part in parts)
    cached = buffer._weights_cache.get(key)
    if cached is not None:
        return cached[1]
    tensors = {}
    for prefix, part in zip(("", "", "shared_", "shared_"), parts):
        if part is None:
            continue
        stem = f"{prefix}w{part.linear}"
        codes = part.tensors["w"]
        tensors[stem] = codes.view(torch.uint8) if codes.dtype == _E4M3 else codes  # DLPack has no FP8 in older torch
        for extra in ("scales", "shifts"):
            if extra in part.tensors:
                tensors[f"{stem}_{extra}"] = part.tensors[extra]
    weights = _megamoe.layer_weights(buffer.recipe, tensors)
    buffer._weights_cache[key] = (parts, weights)
    return weights


# ---- The calls -------------------------------------------------------------------------------------------


def _check_y(y, buffer: Buffer) -> int:
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"y: must be a torch tensor, got {type(y).__name__}")
    if y.dtype != torch.bfloat16 or y.dim() != 2 or y.shape[1] != buffer.hidden:
        raise ValueError(f"y: must be bfloat16 [num_tokens, {buffer.hidden}], got {y.dtype} {list(y.shape)}")
    if y.device != buffer.device:
        raise ValueError(f"y: must be on {buffer.device} (the buffer's device), got {y.device}")
    if y.shape[0] > buffer.num_max_tokens_per_rank:
        raise ValueError(f"y: {y.shape[0]} tokens exceed the buffer's num_max_tokens_per_rank "
                         f"({buffer.num_max_tokens_per_rank})")
    if not y.is_contiguous():
        raise ValueError("y: must be contiguous")
    return y.shape[0]


def _check_buffer(sym_buffer) -> None:
    if not isinstance(sym_buffer, Buffer):
        raise ValueError(f"sym_buffer: must be a megamoe.torch.Buffer, got {type(sym_buffer).__name__}")
    if sym_buffer._core is None:
        raise ValueError("sym_buffer: was destroyed")


def _check_stats(stats, b: Buffer) -> None:
    if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype not in (torch.int32, torch.int64)
                              or tuple(stats.shape) != (b.num_experts_per_rank,) or stats.device != b.device
                              or not stats.is_contiguous()):
        raise ValueError(f"cumulative_local_expert_recv_stats: must be a contiguous int32 or int64 tensor "
                         f"[{b.num_experts_per_rank}] on {b.device}, got "
                         f"{getattr(stats, 'dtype', type(stats))} {list(getattr(stats, 'shape', []))}")


def _stats_target(stats, b: Buffer):
    """Where the launch adds the receive counts: int64 statistics directly, int32 ones through the scratch."""
    return None if stats is None else stats if stats.dtype == torch.int64 else b._stats_scratch


def _add_stats(stats, b: Buffer) -> None:
    if stats is not None and stats.dtype == torch.int32:
        with _on_stream(b):
            stats.add_(b._stats_scratch)
            b._stats_scratch.zero_()


def _on_stream(b: Buffer):
    stream = b.stream
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


_SCHEDULES = ("staged", "fused")


def _check_call(kind, y, sym_buffer, stats, recipe, activation, activation_clamp, parts, num_tokens,
                schedule) -> float:
    """Every argument of a layer call; returns the clamp (0: none)."""
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule: must be 'staged' or 'fused', got {schedule!r}")
    _check_buffer(sym_buffer)
    if activation != "swiglu":
        raise ValueError(f"activation: only 'swiglu' is supported, got {activation!r}")
    if sym_buffer.recipe != kind:
        raise ValueError(f"sym_buffer: was made for recipe {sym_buffer.recipe}; {kind}_mega_moe needs {kind}")
    n = _check_y(y, sym_buffer)
    if num_tokens is not None and num_tokens != n:
        raise ValueError(f"num_tokens: {num_tokens} differs from y's {n} rows")
    if recipe is not None:
        recipe = tuple(recipe)
        want = {"fp8": ((1, 128, 128),), "bf16": ()}.get(kind)
        if kind == "fp8_fp4":
            want = ((1, 1, 32),) if sym_buffer.activation_scales == "mx" else ((1, 1, 128),)
        if recipe not in want:
            raise ValueError(f"recipe: {recipe} does not match the buffer (activation_scales="
                             f"{sym_buffer.activation_scales!r} takes {want[0] if want else 'no recipe'})")
    clamp = 0.0
    if activation_clamp is not None:
        clamp = float(activation_clamp)
        if math.isnan(clamp) or clamp < 0:
            raise ValueError(f"activation_clamp: must be positive (the clamp), 0 or None (no clamp), got {activation_clamp}")
    _check_stats(stats, sym_buffer)
    _check_weights(sym_buffer, parts)
    return clamp


def _run(kind, y, sym_buffer: Buffer, stats, recipe, activation, activation_clamp, parts, num_tokens, schedule):
    """A layer call: checks its arguments, then launches it on the buffer's stream."""
    clamp = _check_call(kind, y, sym_buffer, stats, recipe, activation, activation_clamp, parts, num_tokens, schedule)
    b, n = sym_buffer, y.shape[0]
    weights = _layer_weights(b, parts)
    stream, stats64 = _stream_of(b.stream), _stats_target(stats, b)
    mx = b.activation_scales == "mx"
    if b.waves_per_call == 1:
        b._core.run_from_buffer(kind, n, weights, y, stream, stats64, clamp, mx, schedule)
    else:
        _run_waves(kind, n, weights, y, b, stream, stats64, clamp, mx, schedule)
    _add_stats(stats, b)


def _run_waves(kind, n, weights, y, b: Buffer, stream: int, stats64, clamp, mx, schedule):
    """A call of several waves from the buffer's whole-call input tensors (the library runs the waves)."""
    codes = lambda t: t.view(torch.uint8) if t.dtype == _E4M3 else t  # noqa: E731
    x, scales = codes(b._x[:n]), (b._x_scales[:n] if b._x_scales is not None else None)
    if mx and n > 0:
        with torch.cuda.device(b.device):
            _megamoe.convert_mx_activations(codes(b.x[:n]), b.x_sf[:n].view(torch.uint8), x, scales, stream)
    b._core.run(kind, n, x, scales, b.topk_idx[:n], b.topk_weights[:n], weights, y, stream, stats64, clamp, schedule)


# ---- Inside torch.compile ------------------------------------------------------------------------------
# Compiled code calls the layer through custom operators (torch.ops.megamoe.*), which the compiler keeps
# opaque: no graph break, and their tensor arguments order them after the writes into the buffer's
# input tensors. An operator takes only tensors and plain values: the weights cross as their tensors
# (so that layers whose weights differ share one compiled graph), the buffer as a handle numbered in
# creation order (the same in every process, so compiled graphs can come from the compiler's cache),
# the router as its fields. Eager calls skip the operators (their dispatch costs about 10 us of host
# time).

_HANDLES = itertools.count(1)
# Whether a streamed call compiles into the graph: its router's fields are read through a function
# marked as a constant result, which Dynamo takes the extension's object to from torch 2.15 on (2.11
# refused it: "RouterConfig is not a constant"); before, the call is a graph break and runs eagerly.
STREAMED_CALLS_COMPILE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)
_BUFFERS: "weakref.WeakValueDictionary[int, Buffer]" = weakref.WeakValueDictionary()
_WEIGHT_TENSORS = ("w", "scales", "shifts")


def _router_fields(router) -> tuple:
    """The router's fields as (integers, routed_scaling), read while compiling (Dynamo cannot read the
    extension's objects): marked a constant result by _enable_compiled_calls, which makes the compiled
    graph guard on the router object."""
    return ([router.num_experts, router.top_k, router.num_groups, router.topk_groups, int(router.normalize),
             int(router.scoring == "sigmoid")], router.routed_scaling)


def _enable_compiled_calls() -> None:
    """What compiled calls need from torch.compile's own modules, set up when a buffer is made rather than
    when this module is imported (importing them costs about a second)."""
    torch.compiler.assume_constant_result(_router_fields)


def _router_of(integers: List[int], routed_scaling: float) -> "_megamoe.RouterConfig":
    router = _megamoe.RouterConfig()
    router.num_experts, router.top_k, router.num_groups, router.topk_groups = integers[:4]
    router.normalize, router.scoring = bool(integers[4]), "sigmoid" if integers[5] else "softmax"
    router.routed_scaling = routed_scaling
    return router


def _buffer_of(handle: int) -> Buffer:
    b = _BUFFERS.get(handle)
    if b is None:
        raise RuntimeError(f"megamoe: the buffer of a compiled call (handle {handle}) no longer exists")
    return b


def _flat_weights(parts) -> list:
    """The weights' tensors, three per part (None where a part or tensor is absent)."""
    return [None if part is None else part.tensors.get(name) for part in parts for name in _WEIGHT_TENSORS]


def _parts_of(b: Buffer, flat) -> tuple:
    """MegaMoeWeights again from _flat_weights' list, for the buffer's recipe."""
    parts = []
    for i in range(4):
        tensors = {name: t for name, t in zip(_WEIGHT_TENSORS, flat[3 * i:3 * i + 3]) if t is not None}
        if "w" not in tensors:
            parts.append(None)
            continue
        w = tensors["w"]
        parts.append(MegaMoeWeights(b.recipe, 1 + i % 2, w.shape[0], w.shape[1],
                                    w.shape[2] * (2 if b.recipe == "fp8_fp4" else 1), tensors))
    return tuple(parts)


def _call_inputs(b: Buffer, n: int):
    """The first n rows of the buffer's input tensors, as the caller writes them."""
    return b.x[:n], (b.x_sf[:n] if b.x_sf is not None else None), b.topk_idx[:n], b.topk_weights[:n]


def _adopt_inputs(b, given) -> None:
    """A compiled graph may hand the operator the inputs' new values in tensors of its own (its
    functional form of the writes into the buffer's): copy those into the buffer's tensors, which the
    launch reads."""
    if not isinstance(b, Buffer) or b._core is None or given[2].shape[0] > b.num_max_tokens_per_rank:
        return  # _run says what is wrong
    for own, new in zip(_call_inputs(b, given[2].shape[0]), given):
        if own is not None and new is not None and new.data_ptr() != own.data_ptr() and new.shape == own.shape:
            with _on_stream(b):
                own.copy_(new)


# `order`: the buffer's _order tensor, which the operators declare they write and do not. A call is a
# collective, and a compiled call whose outputs nothing reads (an idle rank's) would otherwise be dropped
# as dead code: a write to a tensor from outside the graph never is.
@torch.library.custom_op("megamoe::mega_moe", mutates_args=("y", "stats", "order"))
def _mega_moe_op(y: torch.Tensor, stats: Optional[torch.Tensor], order: torch.Tensor, x: torch.Tensor,
                 x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 weights: List[Optional[torch.Tensor]], buffer: int, kind: str, recipe: Optional[List[int]],
                 activation: str, activation_clamp: Optional[float], num_tokens: Optional[int], schedule: str) -> None:
    b = _buffer_of(buffer)
    _adopt_inputs(b, (x, x_sf, topk_idx, topk_weights))
    _run(kind, y, b, stats, recipe, activation, activation_clamp, _parts_of(b, weights), num_tokens, schedule)


@_mega_moe_op.register_fake
def _mega_moe_fake(y, stats, order, x, x_sf, topk_idx, topk_weights, weights, buffer, kind, recipe, activation,
                   activation_clamp, num_tokens, schedule) -> None:
    return None


def _call(kind, y, l1, l2, sym_buffer, stats, recipe, activation, activation_clamp, shared_l1, shared_l2, num_tokens,
          schedule) -> None:
    parts = (l1, l2, shared_l1, shared_l2)
    if not torch.compiler.is_compiling():
        _run(kind, y, sym_buffer, stats, recipe, activation, activation_clamp, parts, num_tokens, schedule)
        return
    # While compiling: argument errors raise here, as in an eager call; the operator checks again when it runs.
    clamp = _check_call(kind, y, sym_buffer, stats, recipe, activation, activation_clamp, parts, num_tokens, schedule)
    torch.ops.megamoe.mega_moe(y, stats, sym_buffer._order, *_call_inputs(sym_buffer, y.shape[0]),
                               _flat_weights(parts), sym_buffer._handle, kind,
                               None if recipe is None else [int(v) for v in recipe], activation, clamp,
                               num_tokens, schedule)


def fp8_fp4_mega_moe(y: torch.Tensor, l1_weights: MegaMoeWeights, l2_weights: MegaMoeWeights, sym_buffer: Buffer,
                     cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                     recipe: Optional[Tuple[int, int, int]] = None, activation: str = "swiglu",
                     activation_clamp: Optional[float] = None, fast_math: bool = True, *,
                     shared_l1_weights: Optional[MegaMoeWeights] = None,
                     shared_l2_weights: Optional[MegaMoeWeights] = None, num_tokens: Optional[int] = None,
                     schedule: str = "staged") -> None:
    """y [num_tokens, hidden] bf16 = the MoE layer of the first num_tokens rows of sym_buffer's inputs, with
    MXFP4 expert weights and E4M3 activations. ``recipe`` (1, 1, 32): the buffer's ``x_sf`` holds UE8M0
    per 32 (activation_scales='mx'); (1, 1, 128): float32 per 1x128 ('block'); None: whichever the
    buffer holds. ``activation_clamp`` c: before SwiGLU, gate = min(gate, c) and up = clamp(up, -c, c)
    (None or 0: none). ``cumulative_local_expert_recv_stats`` (int32 or int64 [experts per rank]) has each
    local expert's received routes added. ``fast_math`` is accepted for DeepGEMM's signature; SiLU always
    uses the hardware exp2 and reciprocal here. ``schedule``: 'staged' (six launches, the default) or
    'fused' (one persistent launch; docs/fused.md says where each is faster). Every rank must pass the
    same one."""
    _call("fp8_fp4", y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, recipe, activation,
          activation_clamp, shared_l1_weights, shared_l2_weights, num_tokens, schedule)


def fp8_mega_moe(y: torch.Tensor, l1_weights: MegaMoeWeights, l2_weights: MegaMoeWeights, sym_buffer: Buffer,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 recipe: Optional[Tuple[int, int, int]] = None, activation: str = "swiglu",
                 activation_clamp: Optional[float] = None, fast_math: bool = True, *,
                 shared_l1_weights: Optional[MegaMoeWeights] = None,
                 shared_l2_weights: Optional[MegaMoeWeights] = None, num_tokens: Optional[int] = None,
                 schedule: str = "staged") -> None:
    """As :func:`fp8_fp4_mega_moe` with FP8 weights in 128x128 blocks (DeepSeek-V3's); ``recipe`` (1, 128,
    128) or None."""
    _call("fp8", y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, recipe, activation,
          activation_clamp, shared_l1_weights, shared_l2_weights, num_tokens, schedule)


def bf16_mega_moe(y: torch.Tensor, l1_weights: MegaMoeWeights, l2_weights: MegaMoeWeights, sym_buffer: Buffer,
                  cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, activation: str = "swiglu",
                  activation_clamp: Optional[float] = None, fast_math: bool = True, *,
                  shared_l1_weights: Optional[MegaMoeWeights] = None,
                  shared_l2_weights: Optional[MegaMoeWeights] = None, num_tokens: Optional[int] = None,
                  schedule: str = "staged") -> None:
    """As :func:`fp8_fp4_mega_moe` with BF16 activations and weights (DeepGEMM's bf16_mega_moe signature)."""
    _call("bf16", y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, None, activation,
          activation_clamp, shared_l1_weights, shared_l2_weights, num_tokens, schedule)


def streamed_mega_moe(y: torch.Tensor, x: torch.Tensor, router_weight: torch.Tensor, router, l1_weights: MegaMoeWeights,
                      l2_weights: MegaMoeWeights, sym_buffer: Buffer,
                      cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, *,
                      router_bias: Optional[torch.Tensor] = None, router_logits: Optional[torch.Tensor] = None,
                      shared_l1_weights: Optional[MegaMoeWeights] = None,
                      shared_l2_weights: Optional[MegaMoeWeights] = None, form: str = "automatic",
                      uniform_tokens: Optional[int] = None) -> None:
    """y [num_tokens, hidden] bf16 = the MoE layer of x [num_tokens, hidden] bf16 with the router run on the
    GPU: logits = x @ router_weight.T (router_weight [num_experts, hidden] bf16), ``router``'s scoring and
    top-k (a :class:`megamoe.RouterConfig`: :func:`megamoe.softmax_router` or
    :func:`megamoe.deepseek_v3_router`, whose sigmoid choice takes ``router_bias`` [num_experts] float32),
    x quantized as the recipe needs, all published into ``sym_buffer``'s front ring, which the fused layer
    reads as they land. ``router_logits`` (float32 [num_tokens, num_experts], optional) receives the logits.
    ``sym_buffer`` must be made with ``streaming=True``; every rank calls it, as for the other calls. The
    activation clamp and MX activations are not available here.

    ``form``: ``"streamed"`` as above; ``"batch"``, the same producers writing the layer's inputs, then the
    fused layer on them (an engine's sequence without streaming); ``"automatic"`` (default), whichever pays
    for a call of ``uniform_tokens`` (``sym_buffer.call_form(n)`` says which). Every rank must run a call in
    the same form, so ``uniform_tokens`` must be the same on every rank: the most tokens any rank has in the
    call, e.g. the padded batch size (default: the buffer's ``num_max_tokens_per_rank``)."""
    parts = (l1_weights, l2_weights, shared_l1_weights, shared_l2_weights)
    stats = cumulative_local_expert_recv_stats
    # With older torch the extension's call in _run_streamed is a graph break, and the call runs eagerly.
    if not torch.compiler.is_compiling() or not STREAMED_CALLS_COMPILE:
        _run_streamed(y, x, router_weight, router, sym_buffer, stats, router_bias, router_logits, parts, form,
                      uniform_tokens)
        return
    uniform = _check_streamed(y, x, router_weight, router, sym_buffer, stats, router_bias, router_logits, parts, form,
                              uniform_tokens)
    torch.ops.megamoe.streamed_mega_moe(y, stats, router_logits, sym_buffer._order, x, router_weight, router_bias,
                                        _flat_weights(parts), sym_buffer._handle, *_router_fields(router), form,
                                        uniform)


def _check_streamed(y, x, router_weight, router, b, stats, router_bias, router_logits, parts, form,
                    uniform_tokens) -> int:
    """Every argument of a streamed call; returns uniform_tokens as an int (0: the buffer's maximum)."""
    _check_buffer(b)
    if not b.streaming:
        raise ValueError("sym_buffer: streamed calls need a buffer made with streaming=True")
    if not isinstance(router, _megamoe.RouterConfig):
        raise ValueError(f"router: must be a megamoe.RouterConfig (megamoe.softmax_router, megamoe.deepseek_v3_router), "
                         f"got {type(router).__name__}")
    n = _check_y(y, b)
    for name, t, shape, dtype in (("x", x, (n, b.hidden), torch.bfloat16),
                                  ("router_weight", router_weight, (b.num_experts, b.hidden), torch.bfloat16)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or t.device != b.device \
                or not t.is_contiguous():
            raise ValueError(f"{name}: must be a contiguous {dtype} tensor {list(shape)} on {b.device}, got "
                             f"{getattr(t, 'dtype', type(t))} {list(getattr(t, 'shape', []))}")
    if router_bias is not None and (not isinstance(router_bias, torch.Tensor) or router_bias.dtype != torch.float32
                                    or tuple(router_bias.shape) != (b.num_experts,) or router_bias.device != b.device):
        raise ValueError(f"router_bias: must be a float32 tensor [{b.num_experts}] on {b.device}")
    _check_stats(stats, b)
    if router_logits is not None and (
            not isinstance(router_logits, torch.Tensor) or router_logits.dtype != torch.float32
            or tuple(router_logits.shape) != (n, b.num_experts) or router_logits.device != b.device
            or not router_logits.is_contiguous()):
        raise ValueError(f"router_logits: must be a contiguous float32 tensor [{n}, {b.num_experts}] on {b.device}")
    if form not in ("automatic", "streamed", "batch"):
        raise ValueError(f"form: must be 'automatic', 'streamed' or 'batch', got {form!r}")
    _check_weights(b, parts)
    if uniform_tokens is None:
        return 0
    if not isinstance(uniform_tokens, bool):
        try:
            return operator.index(uniform_tokens)  # int, numpy and torch integers alike
        except TypeError:
            pass
    raise ValueError(f"uniform_tokens: must be an int (the same on every rank), got {uniform_tokens!r}")


def _run_streamed(y, x, router_weight, router, b: Buffer, stats, router_bias, router_logits, parts, form,
                  uniform_tokens) -> None:
    """A streamed call: checks its arguments, then launches the producers and the layer on the buffer's stream."""
    uniform = _check_streamed(y, x, router_weight, router, b, stats, router_bias, router_logits, parts, form,
                              uniform_tokens)
    n = y.shape[0]
    logits = router_logits if router_logits is not None else b._logits[:n]
    # The batch form's routes (automatic needs them alike, whichever form it picks).
    topk_idx = None if form == "streamed" else b._topk_idx_scratch[:n]
    b._core.run_streamed(router, x, router_weight, router_bias, logits, _layer_weights(b, parts), y,
                         _stream_of(b.stream), _stats_target(stats, b), form, uniform, topk_idx)
    _add_stats(stats, b)


@torch.library.custom_op("megamoe::streamed_mega_moe", mutates_args=("y", "stats", "router_logits", "order"))
def _streamed_mega_moe_op(y: torch.Tensor, stats: Optional[torch.Tensor], router_logits: Optional[torch.Tensor],
                          order: torch.Tensor, x: torch.Tensor, router_weight: torch.Tensor,
                          router_bias: Optional[torch.Tensor], weights: List[Optional[torch.Tensor]], buffer: int,
                          router: List[int], routed_scaling: float, form: str, uniform_tokens: int) -> None:
    b = _buffer_of(buffer)
    _run_streamed(y, x, router_weight, _router_of(router, routed_scaling), b, stats, router_bias, router_logits,
                  _parts_of(b, weights), form, uniform_tokens)


@_streamed_mega_moe_op.register_fake
def _streamed_mega_moe_fake(y, stats, router_logits, order, x, router_weight, router_bias, weights, buffer, router,
                            routed_scaling, form, uniform_tokens) -> None:
    return None
