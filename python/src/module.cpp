// megamoe._megamoe: the library's Python extension (nanobind). Tensors cross as DLPack (torch, CuPy and
// NumPy all speak it), so this module links neither torch nor NumPy. The user-facing API is Python:
// megamoe (problems, presets), megamoe.reference (NumPy) and megamoe.torch (DeepGEMM-shaped calls).
//
// Errors: megamoe::DeviceFailure (a CUDA or NCCL call that failed, an error the kernels recorded)
// raises RuntimeError; every other megamoe::Error (an argument broke a rule; the message names it)
// raises ValueError.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/check.h"
#include "comm/emulated.h"
#include "kernels/gemm/fp4_scales.h"
#include "megamoe/activation.h"
#include "megamoe/comm.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "megamoe/layout.h"
#include "megamoe/mx.h"
#include "megamoe/presets.h"
#include "megamoe/problem.h"
#include "megamoe/reference.h"
#include "megamoe/router.h"
#include "megamoe/streaming.h"
#include "megamoe/weights.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace megamoe::python {
namespace {

using Array = nb::ndarray<>;
using ReadArray = nb::ndarray<nb::ro>;

// ---- DLPack <-> TensorView ----------------------------------------------------------------------

const char* dlpack_dtype_name(nb::dlpack::dtype t) {
  using C = nb::dlpack::dtype_code;
  switch (static_cast<C>(t.code)) {
    case C::Int: return t.bits == 8 ? "int8" : t.bits == 16 ? "int16" : t.bits == 32 ? "int32" : "int64";
    case C::UInt: return t.bits == 8 ? "uint8" : t.bits == 16 ? "uint16" : t.bits == 32 ? "uint32" : "uint64";
    case C::Float: return t.bits == 16 ? "float16" : t.bits == 32 ? "float32" : "float64";
    case C::Bfloat: return "bfloat16";
    case C::Float8_E4M3FN: return "float8_e4m3fn";
    case C::Float8_E8M0FNU: return "float8_e8m0fnu";
    case C::Bool: return "bool";
    default: return "an unsupported dtype";
  }
}

// Whether a DLPack dtype can stand for `want`: 1-byte types hold E4M3, packed E2M1, UE8M0 and u8
// codes alike (torch exports FP8 views as uint8), bf16 may come as uint16 (NumPy has no bf16).
bool dtype_fits(nb::dlpack::dtype t, DType want) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(t.code);
  if (t.lanes != 1) return false;
  switch (want) {
    case DType::f32: return code == C::Float && t.bits == 32;
    case DType::i32: return code == C::Int && t.bits == 32;
    case DType::i64: return code == C::Int && t.bits == 64;
    case DType::bf16: return (code == C::Bfloat && t.bits == 16) || ((code == C::UInt || code == C::Int) && t.bits == 16);
    case DType::e4m3: case DType::e2m1x2: case DType::ue8m0: case DType::u8:
      return t.bits == 8 && (code == C::UInt || code == C::Int || code == C::Float8_E4M3FN ||
                             code == C::Float8_E8M0FNU || static_cast<uint8_t>(code) == 8 /* E4M3 */);
  }
  return false;
}

// A view of `array` as a `want` tensor; the dtype and device are checked here (ValueError naming
// `name`), shapes, contiguity and alignment by the library's own checks.
template <class A>
TensorView to_view(const A& array, const std::string& name, DType want) {
  require(array.is_valid(), name.c_str(), "is missing");
  require(dtype_fits(array.dtype(), want), name.c_str(), "must have dtype ", to_string(want), ", got ",
          dlpack_dtype_name(array.dtype()));
  require(array.ndim() <= static_cast<size_t>(TensorView::kMaxDims), name.c_str(), "must have at most ",
          TensorView::kMaxDims, " dimensions, got ", array.ndim());
  TensorView view;
  view.data = const_cast<void*>(static_cast<const void*>(array.data()));
  view.dtype = want;
  const int device_type = array.device_type();
  require(device_type == nb::device::cpu::value || device_type == nb::device::cuda::value ||
              device_type == nb::device::cuda_host::value || device_type == nb::device::cuda_managed::value,
          name.c_str(), "must be a CPU or CUDA array, got DLPack device type ", device_type);
  view.device = device_type == nb::device::cuda::value || device_type == nb::device::cuda_managed::value
                    ? Device::cuda
                    : Device::host;
  view.ndim = static_cast<int32_t>(array.ndim());
  for (int32_t d = 0; d < view.ndim; ++d) {
    view.shape[d] = static_cast<int64_t>(array.shape(d));
    view.strides[d] = array.stride(d);
  }
  if (view.numel() == 0) {  // an empty array has no layout: producers leave any strides there
    int64_t stride = 1;
    for (int32_t d = view.ndim - 1; d >= 0; --d) {
      view.strides[d] = stride;
      stride *= view.shape[d] > 0 ? view.shape[d] : 1;
    }
  }
  return view;
}

// A CUDA tensor of the buffer's device (checked before the library's own checks).
template <class A>
TensorView device_view(const A& array, const std::string& name, DType want, int32_t device) {
  const TensorView view = to_view(array, name, want);
  require(view.device == Device::cuda && array.device_id() == device, name.c_str(), "must be on cuda:", device,
          " (the buffer's device), got ", view.device == Device::cuda ? "cuda:" : "a CPU array",
          view.device == Device::cuda ? std::to_string(array.device_id()) : std::string());
  return view;
}

// check_tensor without the 16-byte alignment rule (NumPy slices need not be aligned on the host).
void check_tensor_host(const TensorView& view, const std::string& name, std::initializer_list<int64_t> shape) {
  require(view.device == Device::host, name.c_str(), "must be a CPU array");
  bool same = view.ndim == static_cast<int32_t>(shape.size());
  const int64_t* expected = shape.begin();
  for (int d = 0; same && d < view.ndim; ++d) same = view.shape[d] == expected[d];
  if (!same) {
    std::string want = "[", got = "[";
    for (size_t d = 0; d < shape.size(); ++d) want += (d ? ", " : "") + std::to_string(expected[d]);
    for (int d = 0; d < view.ndim; ++d) got += (d ? ", " : "") + std::to_string(view.shape[d]);
    throw Error(name + ": must have shape " + want + "], got " + got + "]");
  }
  require(view.is_contiguous(), name.c_str(), "must be contiguous (row-major)");
}

// A host array holding exactly `count` elements of `want`, contiguous; returns its data.
template <class T, class A>
const T* host_data(const A& array, const std::string& name, DType want, std::initializer_list<int64_t> shape) {
  const TensorView view = to_view(array, name, want);
  check_tensor_host(view, name, shape);
  return static_cast<const T*>(view.data);
}

template <class T>
nb::ndarray<nb::numpy, T> numpy_array(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape, owner);
}

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

void set_device(int32_t device) {
  int current = -1;
  MEGAMOE_CHECK_CUDA(cudaGetDevice(&current));
  if (current != device) MEGAMOE_CHECK_CUDA(cudaSetDevice(device));
}

Recipe recipe_from(const std::string& name) {
  Recipe recipe = Recipe::fp8;
  require(parse_recipe(name, recipe), "recipe", "must be one of fp8, fp8_fp4, bf16, got '", name, "'");
  return recipe;
}

// ---- Communicators --------------------------------------------------------------------------------

// One rank's communicator: an NCCL one this module created (and may destroy), or an emulated rank.
struct PyCommunicator {
  std::unique_ptr<Communicator> comm;
  ncclComm_t owned_nccl = nullptr;
  std::shared_ptr<EmulatedGroup> group;  // emulated: keeps the group alive

  Communicator& get() const {
    require(comm != nullptr, "communicator", "was closed");
    return *comm;
  }
  // Collective for NCCL ranks: every rank closes its communicator.
  void close() {
    comm.reset();
    if (owned_nccl != nullptr) {
      ncclComm_t c = owned_nccl;
      owned_nccl = nullptr;
      MEGAMOE_CHECK_NCCL(ncclCommDestroy(c), nullptr);
    }
  }
  // Without close(), an NCCL communicator is left to process exit: destroying it here could wait for
  // peers that have gone (the garbage collector runs at a different time on each rank).
  ~PyCommunicator() { (void)comm.release(); }
};

nb::bytes nccl_unique_id() {
  ncclUniqueId id{};
  MEGAMOE_CHECK_NCCL(ncclGetUniqueId(&id), nullptr);
  return nb::bytes(id.internal, sizeof(id.internal));
}

std::shared_ptr<PyCommunicator> nccl_communicator(nb::bytes unique_id, int32_t size, int32_t rank, int32_t device) {
  require(unique_id.size() == sizeof(ncclUniqueId), "unique_id", "must be ", sizeof(ncclUniqueId),
          " bytes (nccl_unique_id()), got ", unique_id.size());
  require(size >= 1 && size <= kMaxRanks, "size", "must be in [1, ", kMaxRanks, "], got ", size);
  require(rank >= 0 && rank < size, "rank", "must be in [0, size = ", size, "), got ", rank);
  ncclUniqueId id{};
  std::memcpy(id.internal, unique_id.c_str(), sizeof(id.internal));
  auto out = std::make_shared<PyCommunicator>();
  {
    nb::gil_scoped_release release;
    // No multicast objects: the symmetric buffer needs only load/store access between peers.
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    MEGAMOE_CHECK_CUDA(cudaSetDevice(device));
    ncclComm_t comm = nullptr;
    MEGAMOE_CHECK_NCCL(ncclCommInitRank(&comm, size, id, rank), nullptr);
    out->owned_nccl = comm;
    out->comm = Communicator::from_nccl(comm);
  }
  return out;
}

struct PyEmulatedGroup {
  std::shared_ptr<EmulatedGroup> group;
  explicit PyEmulatedGroup(int32_t num_ranks) {
    require(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks", "must be in [1, ", kMaxRanks, "], got ",
            num_ranks);
    group = std::make_shared<EmulatedGroup>(num_ranks);
  }
  std::shared_ptr<PyCommunicator> communicator(int32_t rank, int32_t device) {
    require(rank >= 0 && rank < group->size(), "rank", "must be in [0, ", group->size(), "), got ", rank);
    auto out = std::make_shared<PyCommunicator>();
    nb::gil_scoped_release release;
    MEGAMOE_CHECK_CUDA(cudaSetDevice(device));
    out->comm = std::make_unique<EmulatedCommunicator>(group, rank, device);
    out->group = group;
    return out;
  }
};

// ---- Weights --------------------------------------------------------------------------------------

// LayerWeights over caller-owned device arrays, which it keeps alive.
struct PyLayerWeights {
  LayerWeights view;
  std::vector<nb::object> keep;
  Recipe recipe = Recipe::fp8;
  int32_t device = 0;
};

std::shared_ptr<PyLayerWeights> make_layer_weights(const std::string& recipe_name, nb::dict tensors) {
  auto out = std::make_shared<PyLayerWeights>();
  out->recipe = recipe_from(recipe_name);
  const Recipe recipe = out->recipe;
  const DType codes = recipe == Recipe::fp8_fp4 ? DType::e2m1x2 : activation_dtype(recipe);
  bool first = true;
  for (auto [key, value] : tensors) {
    const std::string name = nb::cast<std::string>(key);
    if (value.is_none()) continue;
    LayerWeights& w = out->view;
    TensorView* slot = name == "w1"                 ? &w.routed.w1.values
                       : name == "w1_scales"        ? &w.routed.w1.scales
                       : name == "w1_shifts"        ? &w.routed.w1.shifts
                       : name == "w2"               ? &w.routed.w2.values
                       : name == "w2_scales"        ? &w.routed.w2.scales
                       : name == "w2_shifts"        ? &w.routed.w2.shifts
                       : name == "shared_w1"        ? &w.shared.w1.values
                       : name == "shared_w1_scales" ? &w.shared.w1.scales
                       : name == "shared_w1_shifts" ? &w.shared.w1.shifts
                       : name == "shared_w2"        ? &w.shared.w2.values
                       : name == "shared_w2_scales" ? &w.shared.w2.scales
                       : name == "shared_w2_shifts" ? &w.shared.w2.shifts
                                                    : nullptr;
    require(slot != nullptr, name.c_str(), "is not a weight tensor (w1, w1_scales, w1_shifts, w2, ..., shared_w2_shifts)");
    const Array array = nb::cast<Array>(value);
    const bool is_scales = name.size() > 7 && name.compare(name.size() - 7, 7, "_scales") == 0;
    const bool is_shifts = name.size() > 7 && name.compare(name.size() - 7, 7, "_shifts") == 0;
    const DType want = is_scales ? DType::f32 : is_shifts ? DType::u8 : codes;
    const TensorView view = to_view(array, name, want);
    require(view.device == Device::cuda, name.c_str(), "must be a CUDA tensor");
    if (first) out->device = array.device_id();
    require(array.device_id() == out->device, name.c_str(), "must be on the same device as the other weights (cuda:",
            out->device, "), got cuda:", array.device_id());
    first = false;
    *slot = view;
    out->keep.push_back(nb::borrow(value));
  }
  return out;
}

// fp8_fp4: prepares `experts * rows` rows of packed E2M1 codes in place and derives the kernels'
// block scales and shifts from the transformed UE8M0 scales, on `stream`.
void prepare_fp4_weights(const Array& codes, const Array& mx_scales, const Array& block_scales, const Array& shifts,
                         uintptr_t stream) {
  const TensorView c = to_view(codes, "codes", DType::e2m1x2);
  require(c.ndim == 2, "codes", "must be [rows, k / 2], got ", c.ndim, " dimensions");
  const int64_t rows = c.shape[0], k = 2 * c.shape[1];
  require(rows % 64 == 0 && k % 128 == 0 && k > 0, "codes", "must be [rows, k / 2] with rows a multiple of 64 and k of 128");
  check_tensor(c, "codes", DType::e2m1x2, {rows, k / 2}, Device::cuda);
  const TensorView s = to_view(mx_scales, "mx_scales", DType::ue8m0);
  check_tensor(s, "mx_scales", DType::ue8m0, {rows, k / kMxBlock}, Device::cuda);
  const TensorView b = to_view(block_scales, "block_scales", DType::f32);
  check_tensor(b, "block_scales", DType::f32, {rows / 64, k / 128}, Device::cuda);
  const TensorView h = to_view(shifts, "shifts", DType::u8);
  check_tensor(h, "shifts", DType::u8, {k / 128, rows, 4}, Device::cuda);
  set_device(codes.device_id());
  gemm::prepare_fp4_weights(c.as<uint8_t>(), s.as<const uint8_t>(), static_cast<uint32_t>(rows),
                            static_cast<uint32_t>(k), b.as<float>(), h.as<uint8_t>(), as_stream(stream));
}

// ---- The symmetric buffer and the layer call --------------------------------------------------------

struct PyBuffer {
  std::shared_ptr<PyCommunicator> comm;
  std::unique_ptr<SymmBuffer> buffer;
  int32_t device = 0;
  // MX activations (megamoe/mx.h): the caller's staging tensors, converted into the buffer's x and
  // x_scales regions at each call of run_from_buffer(convert_mx = true).
  nb::object mx_x_owner, mx_scales_owner;
  uint8_t* mx_x = nullptr;
  uint8_t* mx_scales = nullptr;

  PyBuffer(std::shared_ptr<PyCommunicator> communicator, const Problem& problem) : comm(std::move(communicator)) {
    Communicator& c = comm->get();
    device = c.device();
    nb::gil_scoped_release release;
    set_device(device);
    buffer = std::make_unique<SymmBuffer>(c, problem);
  }
  // Without destroy(), the buffer is left to process exit: freeing it is collective (see PyCommunicator).
  ~PyBuffer() { (void)buffer.release(); }

  SymmBuffer& get() const {
    require(buffer != nullptr, "buffer", "was destroyed");
    return *buffer;
  }
  void destroy() {
    if (buffer == nullptr) return;
    nb::gil_scoped_release release;
    set_device(device);
    buffer.reset();
  }

  // A region of the buffer's inputs as a CUDA array of one wave's rows (tokens_per_wave), owned by `self`.
  static Array region(nb::handle self_handle, const std::string& name) {
    PyBuffer& self = nb::cast<PyBuffer&>(self_handle);
    SymmBuffer& b = self.get();
    const Problem& p = b.problem();
    const BufferLayout& l = b.layout();
    const size_t rows = static_cast<size_t>(tokens_per_wave(p));
    const Region* region = nullptr;
    size_t cols = 0;
    nb::dlpack::dtype dtype = nb::dtype<uint8_t>();
    if (name == "x") {
      region = &l.x;
      cols = static_cast<size_t>(p.hidden);
      if (p.recipe == Recipe::bf16) dtype = {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    } else if (name == "x_scales") {
      require(p.recipe != Recipe::bf16, "name", "x_scales: recipe bf16 has no activation scales");
      region = &l.x_scales;
      cols = static_cast<size_t>(p.hidden / kScaleBlock);
      dtype = nb::dtype<float>();
    } else if (name == "topk_idx") {
      region = &l.topk_idx;
      cols = static_cast<size_t>(p.top_k);
      dtype = nb::dtype<int32_t>();
    } else if (name == "topk_weights") {
      region = &l.topk_weights;
      cols = static_cast<size_t>(p.top_k);
      dtype = nb::dtype<float>();
    } else {
      throw Error("name: must be x, x_scales, topk_idx or topk_weights, got '" + name + "'");
    }
    const size_t shape[2] = {rows, cols};
    return Array(b.local() + region->offset, 2, shape, self_handle, nullptr, dtype, nb::device::cuda::value,
                 self.device);
  }

  void set_mx_staging(const Array& x, const Array& scales) {
    const Problem& p = get().problem();
    require(p.recipe == Recipe::fp8_fp4, "activation_scales", "MX activations need recipe fp8_fp4, the buffer is ",
            to_string(p.recipe));
    const int64_t t = p.max_tokens_per_rank, h = p.hidden;
    const TensorView xv = device_view(x, "x", DType::e4m3, device);
    check_tensor(xv, "x", DType::e4m3, {t, h}, Device::cuda);
    const TensorView sv = device_view(scales, "x_sf", DType::ue8m0, device);
    check_tensor(sv, "x_sf", DType::ue8m0, {t, h / kMxBlock}, Device::cuda);
    mx_x_owner = nb::cast(x);
    mx_scales_owner = nb::cast(scales);
    mx_x = xv.as<uint8_t>();
    mx_scales = sv.as<uint8_t>();
  }

  // One call on the buffer's own input regions (x, x_scales, topk_idx, topk_weights rows [0, num_tokens)),
  // after converting the MX staging tensors into them when `convert_mx`: only y and recv_stats cross.
  void run_from_buffer(const std::string& kind, int32_t num_tokens, const PyLayerWeights& weights, const Array& y,
                       uintptr_t stream, const nb::object& recv_stats, float activation_clamp, bool convert_mx,
                       const std::string& schedule) {
    const CallOptions options = call_options(schedule);
    SymmBuffer& b = get();
    const Problem& p = b.problem();
    check_weights(weights, p);
    require(num_tokens >= 0 && num_tokens <= p.max_tokens_per_rank, "num_tokens", "must be in [0, ",
            p.max_tokens_per_rank, "], got ", num_tokens);
    require(!convert_mx || mx_x != nullptr, "activation_scales", "'mx' needs the staging tensors (set_mx_staging)");
    const TensorView out = device_view(y, "y", DType::bf16, device);
    TensorView stats;
    if (!recv_stats.is_none()) stats = device_view(nb::cast<Array>(recv_stats), "recv_stats", DType::i64, device);
    const int64_t n = num_tokens;
    const TensorView topk_idx = TensorView::contiguous(b.local() + b.layout().topk_idx.offset, DType::i32,
                                                       {n, p.top_k}, Device::cuda);
    LayerInputs in = buffer_input_views(b, num_tokens, topk_idx);
    in.activation_clamp = activation_clamp;
    nb::gil_scoped_release release;
    set_device(device);
    const cudaStream_t s = as_stream(stream);
    if (convert_mx) {
      convert_mx_activations(TensorView::contiguous(mx_x, DType::e4m3, {n, p.hidden}, Device::cuda),
                             TensorView::contiguous(mx_scales, DType::ue8m0, {n, p.hidden / kMxBlock}, Device::cuda),
                             in.x, in.x_scales, s);
    }
    launch(kind, b, in, weights, out, s, stats, options);
  }

  // Weights prepared for this buffer's recipe, on its device.
  void check_weights(const PyLayerWeights& weights, const Problem& p) const {
    require(weights.recipe == p.recipe, "weights", "were prepared for recipe ", to_string(weights.recipe),
            " but the buffer is for ", to_string(p.recipe));
    require(weights.device == device, "weights", "must be on cuda:", device, " (the buffer's device), got cuda:",
            weights.device);
  }

  static CallOptions call_options(const std::string& schedule) {
    Schedule parsed = Schedule::staged;
    require(parse_schedule(schedule, parsed), "schedule", "must be 'staged' or 'fused', got '", schedule, "'");
    return CallOptions{parsed};
  }

  static void launch(const std::string& kind, SymmBuffer& b, const LayerInputs& in, const PyLayerWeights& weights,
                     const TensorView& out, cudaStream_t s, const TensorView& stats, const CallOptions& options) {
    if (kind == "fp8") {
      fp8_mega_moe(b, in, weights.view, out, s, stats, options);
    } else if (kind == "fp8_fp4") {
      fp8_fp4_mega_moe(b, in, weights.view, out, s, stats, options);
    } else if (kind == "bf16") {
      bf16_mega_moe(b, in, weights.view, out, s, stats, options);
    } else {
      mega_moe(b, in, weights.view, out, s, stats, options);
    }
  }

  void check_device_error(uintptr_t stream) {
    SymmBuffer& b = get();
    nb::gil_scoped_release release;
    set_device(device);
    b.check_device_error(as_stream(stream));
  }

  // One call of the layer. x_scales may be None for bf16, recv_stats for none.
  void run(const std::string& kind, int32_t num_tokens, const Array& x, const nb::object& x_scales, const Array& topk_idx,
           const Array& topk_weights, const PyLayerWeights& weights, const Array& y, uintptr_t stream,
           const nb::object& recv_stats, float activation_clamp, const std::string& schedule) {
    const CallOptions options = call_options(schedule);
    SymmBuffer& b = get();
    const Problem& p = b.problem();
    check_weights(weights, p);
    LayerInputs in;
    in.num_tokens = num_tokens;
    in.x = device_view(x, "x", activation_dtype(p.recipe), device);
    if (!x_scales.is_none()) in.x_scales = device_view(nb::cast<Array>(x_scales), "x_scales", DType::f32, device);
    in.topk_idx = device_view(topk_idx, "topk_idx", DType::i32, device);
    in.topk_weights = device_view(topk_weights, "topk_weights", DType::f32, device);
    in.activation_clamp = activation_clamp;
    const TensorView out = device_view(y, "y", DType::bf16, device);
    TensorView stats;
    if (!recv_stats.is_none()) stats = device_view(nb::cast<Array>(recv_stats), "recv_stats", DType::i64, device);
    nb::gil_scoped_release release;
    set_device(device);
    launch(kind, b, in, weights, out, as_stream(stream), stats, options);
  }

  // One streamed call (streamed_mega_moe): the router, top-k and quantization of x publish into the
  // buffer's front ring and the fused layer reads it there, or run as the batch sequence (`form`).
  // router_bias may be None; logits and topk_idx (None for form "streamed") are scratch.
  void run_streamed(const RouterConfig& router, const Array& x, const Array& router_weight,
                    const nb::object& router_bias, const Array& logits, const PyLayerWeights& weights, const Array& y,
                    uintptr_t stream, const nb::object& recv_stats, const std::string& form, int64_t uniform_tokens,
                    const nb::object& topk_idx) {
    SymmBuffer& b = get();
    CallForm call_form;
    require(parse_call_form(form, call_form), "form", "must be automatic, streamed or batch, got '", form, "'");
    check_weights(weights, b.problem());
    StreamedCall call;
    call.router = &router;
    call.x = device_view(x, "x", DType::bf16, device);
    call.router_weight = device_view(router_weight, "router_weight", DType::bf16, device);
    if (!router_bias.is_none())
      call.router_bias = device_view(nb::cast<Array>(router_bias), "router_bias", DType::f32, device);
    call.logits = device_view(logits, "logits", DType::f32, device);
    call.form = call_form;
    call.uniform_tokens = uniform_tokens;
    if (!topk_idx.is_none()) call.topk_idx = device_view(nb::cast<Array>(topk_idx), "topk_idx", DType::i32, device);
    const TensorView out = device_view(y, "y", DType::bf16, device);
    TensorView stats;
    if (!recv_stats.is_none()) stats = device_view(nb::cast<Array>(recv_stats), "recv_stats", DType::i64, device);
    nb::gil_scoped_release release;
    set_device(device);
    streamed_mega_moe(b, call, weights.view, out, as_stream(stream), stats);
  }
};

// ---- MX activations -------------------------------------------------------------------------------

void convert_mx(const Array& x, const Array& scales, const Array& x_out, const Array& x_scales, uintptr_t stream) {
  const TensorView xv = to_view(x, "x", DType::e4m3);
  const TensorView sv = to_view(scales, "x_sf", DType::ue8m0);
  const TensorView ov = to_view(x_out, "x_out", DType::e4m3);
  const TensorView fv = to_view(x_scales, "x_scales", DType::f32);
  require(xv.device == Device::cuda, "x", "must be a CUDA tensor (convert_mx_activations_host converts on the CPU)");
  nb::gil_scoped_release release;
  set_device(x.device_id());
  convert_mx_activations(xv, sv, ov, fv, as_stream(stream));
}

std::pair<nb::ndarray<nb::numpy, uint8_t>, nb::ndarray<nb::numpy, float>> convert_mx_host(const ReadArray& x,
                                                                                           const ReadArray& scales) {
  const TensorView xv = to_view(x, "x", DType::e4m3);
  require(xv.ndim == 2, "x", "must be [tokens, hidden], got ", xv.ndim, " dimensions");
  const int64_t tokens = xv.shape[0], hidden = xv.shape[1];
  require(hidden > 0 && hidden % kScaleBlock == 0, "x", "hidden must be a positive multiple of ", kScaleBlock,
          ", got ", hidden);
  check_tensor_host(xv, "x", {tokens, hidden});
  const uint8_t* s = host_data<uint8_t>(scales, "x_sf", DType::ue8m0, {tokens, hidden / kMxBlock});
  std::vector<uint8_t> out(static_cast<size_t>(tokens * hidden));
  std::vector<float> out_scales(static_cast<size_t>(tokens * (hidden / kScaleBlock)));
  convert_mx_activations_host(xv.as<const uint8_t>(), s, tokens, hidden, out.data(), out_scales.data());
  return {numpy_array(std::move(out), {static_cast<size_t>(tokens), static_cast<size_t>(hidden)}),
          numpy_array(std::move(out_scales),
                      {static_cast<size_t>(tokens), static_cast<size_t>(hidden / kScaleBlock)})};
}

// ---- The CPU reference on NumPy arrays ------------------------------------------------------------

// Stacked canonical weights (weights.h) in NumPy arrays, per recipe:
//   fp8:     w1 u8 [E, 2I, H], w1_scales f32 [E, 2I/128, H/128], w2 u8 [E, H, I], w2_scales f32 [E, H/128, I/128]
//   fp8_fp4: w1 u8 [E, 2I, H/2], w1_scales u8 [E, 2I, H/32], w2 u8 [E, H, I/2], w2_scales u8 [E, H, I/32]
//   bf16:    w1 u16 [E, 2I, H], w2 u16 [E, H, I]
// and shared_w1 ... shared_w2_scales the same with S experts in place of E.
struct StackedHost {
  const uint8_t *w1 = nullptr, *w2 = nullptr, *w1_scales = nullptr, *w2_scales = nullptr;
  StoredExpertSizes sizes;
  int32_t count = 0;
};

StackedHost stacked_host(const nb::dict& weights, const std::string& prefix, Recipe recipe, int32_t count,
                         int32_t hidden, int32_t intermediate) {
  StackedHost out;
  out.count = count;
  out.sizes = canonical_sizes(recipe, hidden, intermediate);
  const int64_t e = count, h = hidden, i = intermediate;
  const bool fp4 = recipe == Recipe::fp8_fp4;
  const DType codes = fp4 ? DType::e2m1x2 : activation_dtype(recipe);
  auto get = [&](const std::string& key) -> ReadArray {
    require(weights.contains(key.c_str()), (prefix + key).c_str(), "is missing");
    return nb::cast<ReadArray>(weights[key.c_str()]);
  };
  out.w1 = host_data<uint8_t>(get(prefix + "w1"), prefix + "w1", codes, {e, 2 * i, fp4 ? h / 2 : h});
  out.w2 = host_data<uint8_t>(get(prefix + "w2"), prefix + "w2", codes, {e, h, fp4 ? i / 2 : i});
  if (recipe == Recipe::fp8) {
    out.w1_scales = host_data<uint8_t>(get(prefix + "w1_scales"), prefix + "w1_scales", DType::f32,
                                       {e, 2 * i / kScaleBlock, h / kScaleBlock});
    out.w2_scales = host_data<uint8_t>(get(prefix + "w2_scales"), prefix + "w2_scales", DType::f32,
                                       {e, h / kScaleBlock, i / kScaleBlock});
  } else if (fp4) {
    out.w1_scales = host_data<uint8_t>(get(prefix + "w1_scales"), prefix + "w1_scales", DType::ue8m0,
                                       {e, 2 * i, h / kMxBlock});
    out.w2_scales = host_data<uint8_t>(get(prefix + "w2_scales"), prefix + "w2_scales", DType::ue8m0,
                                       {e, h, i / kMxBlock});
  }
  return out;
}

StoredExpert expert_of(const StackedHost& s, Recipe recipe, int32_t hidden, int32_t intermediate, int32_t index) {
  StoredExpert e;
  e.hidden = hidden;
  e.intermediate = intermediate;
  const uint64_t k = static_cast<uint64_t>(index);
  e.w1.assign(s.w1 + k * s.sizes.w1, s.w1 + (k + 1) * s.sizes.w1);
  e.w2.assign(s.w2 + k * s.sizes.w2, s.w2 + (k + 1) * s.sizes.w2);
  if (recipe == Recipe::fp8) {
    const float* w1s = reinterpret_cast<const float*>(s.w1_scales + k * s.sizes.w1_scales);
    const float* w2s = reinterpret_cast<const float*>(s.w2_scales + k * s.sizes.w2_scales);
    e.w1_scales.assign(w1s, w1s + s.sizes.w1_scales / sizeof(float));
    e.w2_scales.assign(w2s, w2s + s.sizes.w2_scales / sizeof(float));
  } else if (recipe == Recipe::fp8_fp4) {
    e.w1_mx_scales.assign(s.w1_scales + k * s.sizes.w1_scales, s.w1_scales + (k + 1) * s.sizes.w1_scales);
    e.w2_mx_scales.assign(s.w2_scales + k * s.sizes.w2_scales, s.w2_scales + (k + 1) * s.sizes.w2_scales);
  }
  return e;
}

class HostWeightSource final : public WeightSource {
 public:
  HostWeightSource(const Problem& p, const nb::dict& weights) : p_(p) {
    routed_ = stacked_host(weights, "", p.recipe, p.num_experts, p.hidden, p.intermediate);
    if (p.num_shared_experts > 0)
      shared_ = stacked_host(weights, "shared_", p.recipe, p.num_shared_experts, p.hidden, p.intermediate);
  }
  StoredExpert routed_expert(int32_t e) const override {
    require(e >= 0 && e < routed_.count, "expert", "out of range: ", e);
    return expert_of(routed_, p_.recipe, p_.hidden, p_.intermediate, e);
  }
  StoredExpert shared_expert(int32_t s) const override {
    require(s >= 0 && s < shared_.count, "shared expert", "out of range: ", s);
    return expert_of(shared_, p_.recipe, p_.hidden, p_.intermediate, s);
  }

 private:
  Problem p_;
  StackedHost routed_, shared_;
};

RankBatch host_batch(const Problem& p, const nb::dict& batch, int32_t rank) {
  const std::string prefix = "batches[" + std::to_string(rank) + "].";
  auto get = [&](const char* key) -> ReadArray {
    require(batch.contains(key), (prefix + key).c_str(), "is missing");
    return nb::cast<ReadArray>(batch[key]);
  };
  const ReadArray idx = get("topk_idx");
  require(idx.ndim() == 2, (prefix + "topk_idx").c_str(), "must be [tokens, top_k]");
  RankBatch out;
  out.num_tokens = static_cast<int32_t>(idx.shape(0));
  const int64_t t = out.num_tokens, h = p.hidden, k = p.top_k;
  const int32_t* ids = host_data<int32_t>(idx, prefix + "topk_idx", DType::i32, {t, k});
  out.topk_idx.assign(ids, ids + t * k);
  const float* w = host_data<float>(get("topk_weights"), prefix + "topk_weights", DType::f32, {t, k});
  out.topk_weights.assign(w, w + t * k);
  const uint8_t* x = host_data<uint8_t>(get("x"), prefix + "x", activation_dtype(p.recipe), {t, h});
  out.x.assign(x, x + t * h * activation_bytes(p.recipe));
  if (has_activation_scales(p.recipe)) {
    const float* s = host_data<float>(get("x_scales"), prefix + "x_scales", DType::f32, {t, h / kScaleBlock});
    out.x_scales.assign(s, s + t * (h / kScaleBlock));
  }
  return out;
}

nb::tuple reference(const Problem& problem, const nb::list& batches, const nb::dict& weights, float activation_clamp,
                    int threads) {
  Problem p = problem;
  p.rank = 0;
  validate(p);
  require(nb::len(batches) == static_cast<size_t>(p.num_ranks), "batches", "must hold one batch per rank (",
          p.num_ranks, "), got ", nb::len(batches));
  std::vector<RankBatch> host;
  for (int32_t r = 0; r < p.num_ranks; ++r) host.push_back(host_batch(p, nb::cast<nb::dict>(batches[r]), r));
  const HostWeightSource source(p, weights);
  ReferenceOptions options;
  options.threads = threads;
  options.activation_clamp = activation_clamp;
  ReferenceResult result;
  {
    nb::gil_scoped_release release;
    result = reference_moe(p, host, source, options);
  }
  nb::list ys, counts;
  for (int32_t r = 0; r < p.num_ranks; ++r) {
    ys.append(nb::cast(
        numpy_array(std::move(result.y[r]), {static_cast<size_t>(host[r].num_tokens), static_cast<size_t>(p.hidden)})));
    const size_t n = result.recv_counts[r].size();
    counts.append(nb::cast(numpy_array(std::move(result.recv_counts[r]), {n})));
  }
  return nb::make_tuple(ys, counts);
}

// transform_weights of one canonical expert given as arrays with a leading dimension of 1 (weights.h);
// returns the transformed arrays without it.
nb::dict transform_host(const std::string& recipe_name, int32_t hidden, int32_t intermediate, const nb::dict& expert) {
  const Recipe recipe = recipe_from(recipe_name);
  // The arrays carry a leading expert dimension of 1, as stacked_host expects.
  const StackedHost s = stacked_host(expert, "", recipe, 1, hidden, intermediate);
  const StoredExpert t = transform_weights(expert_of(s, recipe, hidden, intermediate, 0), recipe);
  const size_t h = static_cast<size_t>(hidden), i = static_cast<size_t>(intermediate);
  const bool fp4 = recipe == Recipe::fp8_fp4;
  const size_t bytes = recipe == Recipe::bf16 ? 2 : 1;
  nb::dict out;
  std::vector<uint8_t> w1 = t.w1, w2 = t.w2;
  out["w1"] = numpy_array(std::move(w1), {2 * i, fp4 ? h / 2 : h * bytes});
  out["w2"] = numpy_array(std::move(w2), {h, fp4 ? i / 2 : i * bytes});
  if (recipe == Recipe::fp8) {
    std::vector<float> a = t.w1_scales, b = t.w2_scales;
    out["w1_scales"] = numpy_array(std::move(a), {2 * i / 64, h / 128});
    out["w2_scales"] = numpy_array(std::move(b), {h / 64, i / 128});
  } else if (fp4) {
    std::vector<uint8_t> a = t.w1_mx_scales, b = t.w2_mx_scales;
    out["w1_scales"] = numpy_array(std::move(a), {2 * i, h / kMxBlock});
    out["w2_scales"] = numpy_array(std::move(b), {h, i / kMxBlock});
  }
  return out;
}

// quantize() of one expert's FP32 canonical weights into the recipe's stored format (weights.h).
nb::dict quantize_host(const std::string& recipe_name, const ReadArray& w1, const ReadArray& w2) {
  const Recipe recipe = recipe_from(recipe_name);
  const TensorView v1 = to_view(w1, "w1", DType::f32), v2 = to_view(w2, "w2", DType::f32);
  require(v1.ndim == 2 && v1.shape[0] % 2 == 0, "w1", "must be [2 * intermediate, hidden]");
  const int64_t i = v1.shape[0] / 2, h = v1.shape[1];
  check_tensor_host(v1, "w1", {2 * i, h});
  check_tensor_host(v2, "w2", {h, i});
  DenseExpert dense;
  dense.hidden = static_cast<int32_t>(h);
  dense.intermediate = static_cast<int32_t>(i);
  dense.w1.assign(v1.as<const float>(), v1.as<const float>() + 2 * i * h);
  dense.w2.assign(v2.as<const float>(), v2.as<const float>() + h * i);
  StoredExpert q;
  {
    nb::gil_scoped_release release;
    q = quantize(dense, recipe);
  }
  const size_t hs = static_cast<size_t>(h), is = static_cast<size_t>(i);
  const bool fp4 = recipe == Recipe::fp8_fp4;
  nb::dict out;
  if (recipe == Recipe::bf16) {
    std::vector<uint16_t> a(q.w1.size() / 2), b(q.w2.size() / 2);
    std::memcpy(a.data(), q.w1.data(), q.w1.size());
    std::memcpy(b.data(), q.w2.data(), q.w2.size());
    out["w1"] = numpy_array(std::move(a), {2 * is, hs});
    out["w2"] = numpy_array(std::move(b), {hs, is});
    return out;
  }
  out["w1"] = numpy_array(std::move(q.w1), {2 * is, fp4 ? hs / 2 : hs});
  out["w2"] = numpy_array(std::move(q.w2), {hs, fp4 ? is / 2 : is});
  if (fp4) {
    out["w1_scales"] = numpy_array(std::move(q.w1_mx_scales), {2 * is, hs / kMxBlock});
    out["w2_scales"] = numpy_array(std::move(q.w2_mx_scales), {hs, is / kMxBlock});
  } else {
    out["w1_scales"] = numpy_array(std::move(q.w1_scales), {2 * is / kScaleBlock, hs / kScaleBlock});
    out["w2_scales"] = numpy_array(std::move(q.w2_scales), {hs / kScaleBlock, is / kScaleBlock});
  }
  return out;
}

// Element-wise conversions of formats.h, for tests of the NumPy formats against the library's bits.
nb::ndarray<nb::numpy, uint32_t> convert_format(const std::string& what, const ReadArray& values) {
  require(what == "float_to_e4m3" || what == "float_to_bf16" || what == "float_to_e2m1", "what",
          "must be float_to_e4m3, float_to_bf16 or float_to_e2m1, got '", what, "'");
  const TensorView v = to_view(values, "values", DType::f32);
  require(v.ndim == 1 && v.is_contiguous() && v.device == Device::host, "values", "must be a 1-D contiguous CPU array");
  const size_t n = static_cast<size_t>(v.shape[0]);
  std::vector<uint32_t> out(n);
  const float* f = v.as<const float>();
  for (size_t j = 0; j < n; ++j)
    out[j] = what == "float_to_e4m3" ? float_to_e4m3(f[j]) : what == "float_to_bf16" ? float_to_bf16(f[j]) : float_to_e2m1(f[j]);
  return numpy_array(std::move(out), {n});
}

nb::ndarray<nb::numpy, int64_t> l1_canonical_rows(int32_t intermediate) {
  require(intermediate > 0 && intermediate % kScaleBlock == 0, "intermediate", "must be a positive multiple of ",
          kScaleBlock, ", got ", intermediate);
  std::vector<int64_t> rows(2 * static_cast<size_t>(intermediate));
  for (size_t r = 0; r < rows.size(); ++r) rows[r] = l1_canonical_row(static_cast<int32_t>(r), intermediate);
  const size_t n = rows.size();
  return numpy_array(std::move(rows), {n});
}

nb::dict preset_dict(const Preset& preset) {
  nb::dict d;
  d["name"] = std::string(preset.name);
  d["num_experts"] = preset.num_experts;
  d["top_k"] = preset.top_k;
  d["hidden"] = preset.hidden;
  d["intermediate"] = preset.intermediate;
  d["num_shared_experts"] = preset.num_shared_experts;
  d["default_ranks"] = preset.default_ranks;
  d["default_tokens"] = preset.default_tokens;
  d["recipe"] = std::string(to_string(preset.recipe));
  d["note"] = std::string(preset.note);
  d["activation_clamp"] = preset.activation_clamp;
  return d;
}

}  // namespace
}  // namespace megamoe::python

NB_MODULE(_megamoe, m) {
  using namespace megamoe;
  using namespace megamoe::python;
  m.doc() = "megamoe's extension: the library's C++ API over DLPack tensors (use megamoe, megamoe.torch)";
  m.attr("__version__") = MEGAMOE_VERSION;
  m.attr("library_version") = kLibraryVersion;
  m.attr("max_ranks") = kMaxRanks;
  m.attr("max_top_k") = kMaxTopK;
  // Buffers and communicators left to process exit are intended (freeing them is collective).
  nb::set_leak_warnings(false);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const DeviceFailure& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  nb::class_<Problem>(m, "Problem", "One MoE layer and this rank's place in it (megamoe/problem.h)")
      .def(nb::init<>())
      .def_rw("num_ranks", &Problem::num_ranks)
      .def_rw("rank", &Problem::rank)
      .def_rw("num_experts", &Problem::num_experts)
      .def_rw("top_k", &Problem::top_k)
      .def_rw("hidden", &Problem::hidden)
      .def_rw("intermediate", &Problem::intermediate)
      .def_rw("num_shared_experts", &Problem::num_shared_experts)
      .def_rw("max_tokens_per_rank", &Problem::max_tokens_per_rank)
      .def_rw("recv_capacity", &Problem::recv_capacity)
      .def_rw("wave_tokens", &Problem::wave_tokens)
      .def_rw("front_num_slots", &Problem::front_num_slots)
      .def_rw("front_tokens_per_slot", &Problem::front_tokens_per_slot)
      .def_prop_ro("tokens_per_wave", [](const Problem& p) { return tokens_per_wave(p); })
      .def_prop_ro("waves_per_call", [](const Problem& p) { return waves_per_call(p); })
      .def_prop_ro("mean_recv_routes", [](const Problem& p) { return mean_recv_routes(p); })
      .def_prop_rw(
          "recipe", [](const Problem& p) { return std::string(to_string(p.recipe)); },
          [](Problem& p, const std::string& name) { p.recipe = recipe_from(name); })
      .def_prop_ro("experts_per_rank", &Problem::experts_per_rank)
      .def("validate", [](const Problem& p) { validate(p); })
      .def("fingerprint", [](const Problem& p) { return fingerprint(p); })
      .def("describe", [](const Problem& p) { return describe(p); })
      .def_prop_ro("buffer_bytes", [](const Problem& p) {
        validate(p);
        return BufferLayout::make(p).total_bytes;
      });

  nb::class_<RouterConfig>(m, "RouterConfig",
                           "The router before the layer (megamoe/router.h): softmax or DeepSeek's grouped sigmoid")
      .def(nb::init<>())
      .def_rw("num_experts", &RouterConfig::num_experts)
      .def_rw("top_k", &RouterConfig::top_k)
      .def_prop_rw(
          "scoring",
          [](const RouterConfig& r) { return std::string(r.scoring == RouterScoring::softmax ? "softmax" : "sigmoid"); },
          [](RouterConfig& r, const std::string& name) {
            require(name == "softmax" || name == "sigmoid", "scoring", "must be 'softmax' or 'sigmoid', got '", name,
                    "'");
            r.scoring = name == "softmax" ? RouterScoring::softmax : RouterScoring::sigmoid;
          })
      .def_rw("num_groups", &RouterConfig::num_groups)
      .def_rw("topk_groups", &RouterConfig::topk_groups)
      .def_rw("normalize", &RouterConfig::normalize)
      .def_rw("routed_scaling", &RouterConfig::routed_scaling)
      .def("validate", [](const RouterConfig& r) { validate(r); });
  m.def("deepseek_v3_router", &deepseek_v3_router);
  m.def("softmax_router", &softmax_router, "num_experts"_a, "top_k"_a, "normalize"_a = true);
  m.def("presets", [] {
    nb::list out;
    for (const Preset& preset : all_presets()) out.append(preset_dict(preset));
    return out;
  });
  m.def("kernel_activation_clamp", [](float c) { return kernel_activation_clamp(c, "activation_clamp"); }, "c"_a);
  m.def(
      "front_ring_shape",
      [](int32_t max_tokens_per_rank, int32_t chunk_tokens) {
        const FrontRingShape shape = front_ring_shape(max_tokens_per_rank, chunk_tokens);
        return std::pair<int32_t, int32_t>(shape.num_slots, shape.tokens_per_slot);
      },
      "max_tokens_per_rank"_a, "chunk_tokens"_a,
      "(front_num_slots, front_tokens_per_slot) of a streaming buffer's ring: two calls' worth of chunks of "
      "chunk_tokens (0: one chunk per call)");

  nb::class_<PyCommunicator>(m, "Communicator", "One rank's communicator (NCCL or emulated)")
      .def_prop_ro("rank", [](const PyCommunicator& c) { return c.get().rank(); })
      .def_prop_ro("size", [](const PyCommunicator& c) { return c.get().size(); })
      .def_prop_ro("device", [](const PyCommunicator& c) { return c.get().device(); })
      .def_prop_ro("emulated", [](const PyCommunicator& c) { return c.get().emulated(); })
      .def_prop_ro("stream", [](const PyCommunicator& c) { return reinterpret_cast<uintptr_t>(c.get().stream()); })
      .def("barrier",
           [](const PyCommunicator& c) {
             Communicator& comm = c.get();
             nb::gil_scoped_release release;
             comm.barrier();
           })
      .def("close", [](PyCommunicator& c) {
        nb::gil_scoped_release release;
        c.close();
      });
  m.def("nccl_unique_id", &nccl_unique_id);
  m.def("nccl_communicator", &nccl_communicator, "unique_id"_a, "size"_a, "rank"_a, "device"_a);
  nb::class_<PyEmulatedGroup>(m, "EmulatedGroup", "R ranks emulated in this process on one GPU, one thread each")
      .def(nb::init<int32_t>(), "num_ranks"_a)
      .def("communicator", &PyEmulatedGroup::communicator, "rank"_a, "device"_a = 0)
      .def("abort", [](PyEmulatedGroup& g) { g.group->abort(); });

  nb::class_<PyLayerWeights>(m, "LayerWeights", "A rank's transformed expert weights on the GPU (megamoe/layer.h)");
  m.def("layer_weights", &make_layer_weights, "recipe"_a, "tensors"_a);
  m.def("prepare_fp4_weights", &prepare_fp4_weights, "codes"_a, "mx_scales"_a, "block_scales"_a, "shifts"_a,
        "stream"_a);

  nb::class_<PyBuffer>(m, "SymmBuffer", "The symmetric buffer of one problem (collective to create and destroy)")
      .def(nb::init<std::shared_ptr<PyCommunicator>, const Problem&>(), "communicator"_a, "problem"_a)
      .def_prop_ro("problem", [](const PyBuffer& b) { return b.get().problem(); })
      .def_prop_ro("total_bytes", [](const PyBuffer& b) { return b.get().layout().total_bytes; })
      .def_prop_ro("device", [](const PyBuffer& b) { return b.device; })
      .def_prop_ro("communicator", [](const PyBuffer& b) { return b.comm; })
      .def("region", &PyBuffer::region)
      .def("check_device_error", &PyBuffer::check_device_error, "stream"_a)
      .def("destroy", &PyBuffer::destroy)
      .def("set_mx_staging", &PyBuffer::set_mx_staging, "x"_a, "x_sf"_a)
      .def("run_from_buffer", &PyBuffer::run_from_buffer, "kind"_a, "num_tokens"_a, "weights"_a, "y"_a, "stream"_a,
           "recv_stats"_a.none(), "activation_clamp"_a, "convert_mx"_a, "schedule"_a = "staged")
      .def(
          "call_form",
          [](PyBuffer& b, int64_t uniform_tokens) {
            return std::string(to_string(choose_call_form(b.get().problem(), uniform_tokens)));
          },
          "uniform_tokens"_a, "the form (streamed or batch) a streamed call with form automatic takes")
      .def("run_streamed", &PyBuffer::run_streamed, "router"_a, "x"_a, "router_weight"_a, "router_bias"_a.none(),
           "logits"_a, "weights"_a, "y"_a, "stream"_a, "recv_stats"_a.none(), "form"_a = "automatic",
           "uniform_tokens"_a = 0, "topk_idx"_a.none() = nb::none())
      .def("run", &PyBuffer::run, "kind"_a, "num_tokens"_a, "x"_a, "x_scales"_a.none(), "topk_idx"_a,
           "topk_weights"_a, "weights"_a, "y"_a, "stream"_a, "recv_stats"_a.none(), "activation_clamp"_a,
           "schedule"_a = "staged");

  m.def("convert_mx_activations", &convert_mx, "x"_a, "x_sf"_a, "x_out"_a, "x_scales"_a, "stream"_a);
  m.def("convert_mx_activations_host", &convert_mx_host, "x"_a, "x_sf"_a);
  m.def("reference_moe", &reference, "problem"_a, "batches"_a, "weights"_a, "activation_clamp"_a = 0.0f,
        "threads"_a = 0);
  m.def("transform_weights_host", &transform_host, "recipe"_a, "hidden"_a, "intermediate"_a, "expert"_a);
  m.def("quantize_weights_host", &quantize_host, "recipe"_a, "w1"_a, "w2"_a);
  m.def("convert_format", &convert_format, "what"_a, "values"_a);
  m.def("l1_canonical_rows", &l1_canonical_rows, "intermediate"_a);
}
