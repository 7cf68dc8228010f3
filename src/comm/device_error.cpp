// Host side of the device error record: the spin-wait timeout and the words for a recorded error.
#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <string>

#include "megamoe/comm.h"
#include "megamoe/error.h"

namespace megamoe {

namespace {

constexpr uint64_t kDefaultTimeoutMs = 5000;
constexpr uint64_t kMaxTimeoutMs = 1000000000;  // about 11 days: beyond that a typo is likelier than intent

// What a spin-wait at `site` was waiting for, and the name of the value it compared. Waits between
// ranks or blocks put their timeout (ms) in `detail`; a GEMM pipeline wait puts its stage there.
struct SiteWords {
  std::string phrase;
  const char* unit;
  bool detail_is_timeout = true;
};

SiteWords site_words(const DeviceError& error) {
  const std::string peer = std::to_string(error.peer);
  switch (error.site) {
    case kWaitGridBarrier: return {"at the grid barrier", "generation"};
    case kWaitRankBarrier: return {"at the cross-rank barrier for rank " + peer, "epoch"};
    case kWaitFrontRouteReady: return {"for a front-ring slot's routes", "value"};
    case kWaitFrontLayoutReady: return {"for a front-ring slot's layout", "value"};
    case kWaitFrontConsumed: return {"for a front-ring slot to be consumed", "value"};
    case kWaitTest: return {"on a test flag from rank " + peer, "value"};
    case kWaitGemmStage:
      if (error.detail == kGemmScaleHandOver) return {"for the weight-scale warp's hand-over", "parity", false};
      return {"for GEMM pipeline stage " + std::to_string(error.detail), "parity", false};
    case kWaitFusedInputs: return {"for this rank's send units (inputs staged)", "count"};
    case kWaitFusedRows: return {"for the rows of local expert " + std::to_string(error.choice), "rows"};
    case kWaitFusedL1Tile: return {"for the L1 outputs of routed token tile " + std::to_string(error.choice), "count"};
    case kWaitFusedSharedL1Tile:
      return {"for the L1 outputs of shared-expert token tile " + std::to_string(error.choice), "count"};
    case kWaitFusedRoutes: return {"for this rank's route units (every source's routes read)", "count"};
    case kWaitFusedTileDone:
      return {"for math warpgroup " + std::to_string(error.detail) + " to hand over its next tile-done count",
              "count", false};
    default: return {"at unknown wait site " + std::to_string(error.site) + " (peer " + peer + ")", "value"};
  }
}

}  // namespace

uint64_t default_timeout_ns() {
  const char* text = std::getenv("MEGAMOE_TIMEOUT_MS");
  if (text == nullptr || text[0] == '\0') return kDefaultTimeoutMs * 1000000ull;
  char* end = nullptr;
  errno = 0;
  const unsigned long long ms = std::strtoull(text, &end, 10);
  const bool whole_number = text[0] >= '0' && text[0] <= '9' && *end == '\0' && errno == 0;
  require(whole_number && ms >= 1 && ms <= kMaxTimeoutMs, "MEGAMOE_TIMEOUT_MS",
          "must be a whole number of milliseconds in [1, ", kMaxTimeoutMs, "], got '", text, "'");
  return static_cast<uint64_t>(ms) * 1000000ull;
}

std::string describe(const DeviceError& error) {
  std::ostringstream out;
  out << "rank " << error.rank << ", block " << error.block << ", thread " << error.thread << ": ";
  switch (error.code) {
    case kDeviceOk:
      out << "no error";
      break;
    case kDeviceTimeout: {
      const SiteWords words = site_words(error);
      out << "timed out";
      if (words.detail_is_timeout) out << " after " << error.detail << " ms";
      out << " waiting " << words.phrase << " (expected " << words.unit << " " << error.expected << ", saw "
          << error.seen << ")";
      break;
    }
    case kDeviceBadExpertId:
      out << "token " << error.detail << ", choice " << error.choice << " routes to expert id "
          << static_cast<int64_t>(static_cast<int32_t>(error.seen)) << ", outside [-1, num_experts)";
      break;
    case kDeviceSlotOverflow:
      out << "more routes to one (expert, source rank) than a token count allows (at most " << error.expected
          << ", saw " << error.seen << ")";
      break;
    case kDeviceCapacityExceeded:
      out << "rank " << error.peer << " received ";
      if (error.seen != 0) out << error.seen << " routes, more than its receive capacity " << error.expected;
      else out << "more routes than its receive capacity";
      out << " (Problem::recv_capacity): the call was refused on every rank and wrote no output";
      break;
    case kDeviceStreamedChunks: {
      // expected and seen: a chunk's first token (high word) and its call's token count (low word).
      const uint64_t seen_token = error.seen >> 32, seen_call = error.seen & 0xFFFFFFFFu;
      const uint64_t want_token = error.expected >> 32, want_call = error.expected & 0xFFFFFFFFu;
      out << "a streamed call read rank " << error.peer << "'s front-ring chunk " << error.detail
          << " as starting at token " << seen_token << " of a call of " << seen_call << " tokens, where ";
      if (error.choice == 1) {
        out << "a call holds at most " << want_call << " tokens (max_tokens_per_rank)";
      } else if (error.choice == 2) {
        out << "its token count in the slot or its last-chunk flag disagrees with that";
      } else {
        out << "the call puts it at token " << want_token << " of " << want_call;
      }
      out << ": the ring's sequence numbers are out of step (make a new buffer; with one rank, check_device_error "
             "resets it)";
      break;
    }
    case kDeviceStreamedTokens:
      out << "a streamed call of " << error.expected << " tokens found " << error.seen
          << " in this rank's front ring: inputs.num_tokens must be the producers' token count";
      break;
    default:
      out << "unknown device error code " << error.code << " (site " << error.site << ", peer " << error.peer
          << ", detail " << error.detail << ", expected " << error.expected << ", seen " << error.seen << ")";
      break;
  }
  return out.str();
}

}  // namespace megamoe
