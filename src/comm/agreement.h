// What ranks exchange before creating a symmetric buffer, and the words for their disagreement.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/problem.h"

namespace megamoe {

// One rank's view of the buffer it is about to create; exchanged byte for byte, so plain fields only.
struct ProblemRecord {
  uint64_t fingerprint = 0;   // megamoe::fingerprint(problem)
  uint64_t buffer_bytes = 0;  // BufferLayout::make(problem).total_bytes
  uint32_t library_version = 0;
  int32_t comm_rank = 0;  // what the communicator says
  int32_t comm_size = 0;
  int32_t rank = 0;  // what the problem says
  int32_t num_ranks = 0;
  int32_t num_experts = 0;
  int32_t top_k = 0;
  int32_t hidden = 0;
  int32_t intermediate = 0;
  int32_t num_shared_experts = 0;
  int32_t max_tokens_per_rank = 0;
  int32_t recipe = 0;
  int32_t front_num_slots = 0;
  int32_t front_tokens_per_slot = 0;
};

// The record of a problem that passed validate().
ProblemRecord make_record(const Problem& problem, int32_t comm_rank, int32_t comm_size);

// Empty when every rank may create the buffer; otherwise one message, identical on every rank, naming
// each field the ranks disagree on with every rank's value that differs from rank 0's (e.g. "ranks
// disagree on hidden: rank 0 has 7168, rank 1 has 4096"), and any rank whose problem does not match
// its place in the communicator.
std::string disagreement(const std::vector<ProblemRecord>& records);

}  // namespace megamoe
