// Compile check: every protocol step of megamoe/streaming.h instantiated over the GPU policy for
// sm_90a, so a change that breaks them on the device fails the build, not a later kernel.
#include "kernels/streaming/ring_device.cuh"

namespace megamoe::device {

// Takes each step once, as slice 2's producers and consumers will (never launched).
__global__ void front_ring_compile_check(SymmView view, BufferLayout layout, FrontRingLayout ring, uint64_t seq) {
  ControlBlock* control = layout.control_block(view.local());
  void* own = front_ring_of(view, layout, view.rank);
  if (!front_wait_ok(view, control, front_wait_slot_free<FrontRingAtomics>(ring, own, seq, view.timeout_ns))) return;
  front_publish<FrontRingAtomics>(ring, own, FrontHalf::route, seq);
  front_publish<FrontRingAtomics>(ring, own, FrontHalf::layout, seq);
  for (int32_t src = 0; src < view.num_ranks; ++src) {
    void* src_ring = front_ring_of(view, layout, src);
    if (!front_wait_ok(view, control, front_wait_ready<FrontRingAtomics>(ring, src_ring, static_cast<uint32_t>(src),
                                                                          seq, view.timeout_ns))) {
      return;
    }
    front_acknowledge<FrontRingAtomics>(ring, src_ring, static_cast<uint32_t>(view.rank), seq);
  }
}

}  // namespace megamoe::device
