// `megamoe run --dump DIR`: inputs, outputs and the weights of every used expert as .npy files,
// with manifest.json saying what each file holds and how to decode it (tools/check_dump.py reads it).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "megamoe/problem.h"
#include "megamoe/reference.h"
#include "megamoe/synthetic.h"

namespace megamoe::cli {

struct DumpInfo {
  std::string preset;
  std::string backend;
  Routing routing = Routing::uniform;
  uint64_t seed = 0;
};

// Creates `dir` if needed and checks that a file can be written in it; throws megamoe::Error naming
// --dump and the reason otherwise. Called before any work, so a bad directory costs no compute.
void prepare_dump_dir(const std::filesystem::path& dir);

// Writes into `dir` (prepare_dump_dir first); returns the number of files written (manifest included).
// `progress`, when set, is called with (experts written, experts to write).
int write_dump(const std::filesystem::path& dir, const DumpInfo& info, const Problem& problem,
               const std::vector<RankBatch>& batches, const ReferenceResult& result, const SyntheticWeights& weights,
               const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace megamoe::cli
