#include "comm/agreement.h"

#include <sstream>

#include "megamoe/config.h"
#include "megamoe/error.h"
#include "megamoe/layout.h"
#include "megamoe/types.h"

namespace megamoe {

ProblemRecord make_record(const Problem& p, int32_t comm_rank, int32_t comm_size) {
  ProblemRecord r;
  r.fingerprint = fingerprint(p);
  r.buffer_bytes = BufferLayout::make(p).total_bytes;
  r.library_version = kLibraryVersion;
  r.comm_rank = comm_rank;
  r.comm_size = comm_size;
  r.rank = p.rank;
  r.num_ranks = p.num_ranks;
  r.num_experts = p.num_experts;
  r.top_k = p.top_k;
  r.hidden = p.hidden;
  r.intermediate = p.intermediate;
  r.num_shared_experts = p.num_shared_experts;
  r.max_tokens_per_rank = p.max_tokens_per_rank;
  r.recipe = static_cast<int32_t>(p.recipe);
  r.front_num_slots = p.front_num_slots;
  r.front_tokens_per_slot = p.front_tokens_per_slot;
  return r;
}

namespace {

std::string recipe_name(int64_t value) {
  switch (value) {
    case static_cast<int64_t>(Recipe::fp8): return "fp8";
    case static_cast<int64_t>(Recipe::fp8_fp4): return "fp8_fp4";
    case static_cast<int64_t>(Recipe::bf16): return "bf16";
    default: return "recipe #" + std::to_string(value);
  }
}

// A field every rank must agree on: its name, how to read it, and how to print a value.
struct Field {
  const char* name;
  int64_t (*read)(const ProblemRecord&);
  bool is_recipe = false;
};

const Field kFields[] = {
    {"library version", [](const ProblemRecord& r) { return int64_t{r.library_version}; }},
    {"num_ranks", [](const ProblemRecord& r) { return int64_t{r.num_ranks}; }},
    {"num_experts", [](const ProblemRecord& r) { return int64_t{r.num_experts}; }},
    {"top_k", [](const ProblemRecord& r) { return int64_t{r.top_k}; }},
    {"hidden", [](const ProblemRecord& r) { return int64_t{r.hidden}; }},
    {"intermediate", [](const ProblemRecord& r) { return int64_t{r.intermediate}; }},
    {"num_shared_experts", [](const ProblemRecord& r) { return int64_t{r.num_shared_experts}; }},
    {"max_tokens_per_rank", [](const ProblemRecord& r) { return int64_t{r.max_tokens_per_rank}; }},
    {"recipe", [](const ProblemRecord& r) { return int64_t{r.recipe}; }, true},
    {"front_num_slots", [](const ProblemRecord& r) { return int64_t{r.front_num_slots}; }},
    {"front_tokens_per_slot", [](const ProblemRecord& r) { return int64_t{r.front_tokens_per_slot}; }},
    {"buffer bytes", [](const ProblemRecord& r) { return static_cast<int64_t>(r.buffer_bytes); }},
};

void append(std::ostringstream& out, bool& first, const std::string& clause) {
  out << (first ? "" : "; ") << clause;
  first = false;
}

}  // namespace

std::string disagreement(const std::vector<ProblemRecord>& records) {
  std::ostringstream out;
  bool first = true;
  for (size_t i = 0; i < records.size(); ++i) {
    const ProblemRecord& r = records[i];
    if (r.rank != r.comm_rank) {
      append(out, first, detail::concat("rank ", i, ": problem.rank is ", r.rank, " but the communicator's rank is ",
                                        r.comm_rank));
    }
    if (r.num_ranks != r.comm_size) {
      append(out, first, detail::concat("rank ", i, ": problem.num_ranks is ", r.num_ranks,
                                        " but the communicator has ", r.comm_size, " ranks"));
    }
  }
  bool any_field = false;
  for (const Field& field : kFields) {
    const int64_t reference = field.read(records.front());
    auto show = [&field](int64_t value) { return field.is_recipe ? recipe_name(value) : std::to_string(value); };
    std::ostringstream clause;
    clause << "ranks disagree on " << field.name << ": rank 0 has " << show(reference);
    bool differs = false;
    for (size_t i = 1; i < records.size(); ++i) {
      const int64_t value = field.read(records[i]);
      if (value == reference) continue;
      clause << ", rank " << i << " has " << show(value);
      differs = true;
    }
    if (differs) {
      append(out, first, clause.str());
      any_field = true;
    }
  }
  if (!any_field) {
    // Every listed field agrees, yet the digest (which also covers what this list may not) differs.
    std::ostringstream clause;
    clause << "ranks disagree on the problem fingerprint: rank 0 has 0x" << std::hex << records.front().fingerprint;
    bool differs = false;
    for (size_t i = 1; i < records.size(); ++i) {
      if (records[i].fingerprint == records.front().fingerprint) continue;
      clause << ", rank " << std::dec << i << " has 0x" << std::hex << records[i].fingerprint;
      differs = true;
    }
    if (differs) append(out, first, clause.str());
  }
  return out.str();
}

}  // namespace megamoe
