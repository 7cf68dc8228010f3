#include "cli/dump.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/npy.h"
#include "megamoe/error.h"

namespace megamoe::cli {

namespace {

struct FileEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string meaning;
  std::string decode;
};

std::string quote(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

template <typename T>
std::string json_list(const std::vector<T>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

std::vector<uint16_t> bf16_words(const std::vector<uint8_t>& bytes) {
  std::vector<uint16_t> words(bytes.size() / 2);
  for (size_t i = 0; i < words.size(); ++i) words[i] = static_cast<uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8));
  return words;
}

class DumpWriter {
 public:
  explicit DumpWriter(std::filesystem::path dir) : dir_(std::move(dir)) {}

  template <typename T>
  void write(const std::string& name, const std::vector<int64_t>& shape, const std::vector<T>& data,
             std::string meaning, std::string decode) {
    int64_t count = 1;
    for (int64_t extent : shape) count *= extent;
    require(static_cast<int64_t>(data.size()) == count, name.c_str(), "holds ", data.size(),
            " values, its shape needs ", count);
    write_npy(dir_ / name, shape, data.data());
    files_.push_back({name, std::string(npy_descr<T>().substr(1)), shape, std::move(meaning), std::move(decode)});
  }

  const std::vector<FileEntry>& files() const { return files_; }

 private:
  std::filesystem::path dir_;
  std::vector<FileEntry> files_;
};

const char* dtype_name(std::string_view descr) {
  if (descr == "u1") return "uint8";
  if (descr == "u2") return "uint16";
  if (descr == "i4") return "int32";
  if (descr == "u4") return "uint32";
  return "float32";
}

// One expert's canonical stored weights, named <prefix>_w1.npy and so on.
void write_expert(DumpWriter& out, const std::string& prefix, const std::string& who, const StoredExpert& expert,
                  Recipe recipe) {
  const int64_t h = expert.hidden;
  const int64_t i = expert.intermediate;
  struct Matrix {
    const char* name;
    const char* role;
    int64_t rows, cols;
    const std::vector<uint8_t>& codes;
    const std::vector<float>& scales;
    const std::vector<uint8_t>& mx_scales;
  };
  const Matrix matrices[] = {
      {"w1", "[2I][H]: rows 0..I-1 gate_proj, rows I..2I-1 up_proj", 2 * i, h, expert.w1, expert.w1_scales,
       expert.w1_mx_scales},
      {"w2", "[H][I]: down_proj", h, i, expert.w2, expert.w2_scales, expert.w2_mx_scales},
  };
  for (const Matrix& m : matrices) {
    const std::string base = prefix + "_" + m.name;
    const std::string meaning = who + " " + m.name + " " + m.role;
    switch (recipe) {
      case Recipe::fp8:
        out.write(base + ".npy", {m.rows, m.cols}, m.codes, meaning,
                  "E4M3 codes as uint8; value = e4m3(code) * " + base + "_scales[row / 128][col / 128]");
        out.write(base + "_scales.npy", {m.rows / kScaleBlock, m.cols / kScaleBlock}, m.scales,
                  who + " " + m.name + " scales, one per 128x128 block", "float32 as is");
        break;
      case Recipe::fp8_fp4:
        out.write(base + ".npy", {m.rows, m.cols / 2}, m.codes, meaning,
                  "E2M1 pairs as uint8: low nibble = even column, high nibble = odd column; value = e2m1(nibble) "
                  "* ue8m0(" + base + "_scales[row][col / 32])");
        out.write(base + "_scales.npy", {m.rows, m.cols / kMxBlock}, m.mx_scales,
                  who + " " + m.name + " scales, one per 32 columns of a row",
                  "UE8M0 as uint8; scale = 2^(code - 127)");
        break;
      case Recipe::bf16:
        out.write(base + ".npy", {m.rows, m.cols}, bf16_words(m.codes), meaning,
                  "BF16 bits as uint16; value = float32 with bits (code << 16)");
        break;
    }
  }
}

std::string manifest_json(const DumpInfo& info, const Problem& p, const std::vector<RankBatch>& batches,
                          const std::vector<int32_t>& experts, const std::vector<FileEntry>& files) {
  std::vector<int32_t> tokens;
  for (const RankBatch& batch : batches) tokens.push_back(batch.num_tokens);
  const bool fp8_activations = p.recipe != Recipe::bf16;
  const std::string requant =
      fp8_activations ? "a' = E4M3 re-quantization of a per 1x128 channels: scale = max(amax, 1e-12) / 448, "
                        "code = e4m3_rne_saturating(a * (448 / max(amax, 1e-12))), a' = e4m3(code) * scale"
                      : "a' = BF16(a), round to nearest even";
  std::ostringstream out;
  out << "{\n"
      << "  \"format\": \"megamoe-dump\",\n"
      << "  \"format_version\": 1,\n"
      << "  \"preset\": " << quote(info.preset) << ",\n"
      << "  \"backend\": " << quote(info.backend) << ",\n"
      << "  \"recipe\": " << quote(to_string(p.recipe)) << ",\n"
      << "  \"seed\": " << info.seed << ",\n"
      << "  \"routing\": " << quote(to_string(info.routing)) << ",\n"
      << "  \"problem\": {\"num_ranks\": " << p.num_ranks << ", \"num_experts\": " << p.num_experts
      << ", \"experts_per_rank\": " << p.experts_per_rank() << ", \"top_k\": " << p.top_k
      << ", \"hidden\": " << p.hidden << ", \"intermediate\": " << p.intermediate
      << ", \"num_shared_experts\": " << p.num_shared_experts << ", \"max_tokens_per_rank\": " << p.max_tokens_per_rank
      << "},\n"
      << "  \"tokens_per_rank\": " << json_list(tokens) << ",\n"
      << "  \"dumped_experts\": " << json_list(experts) << ",\n"
      << "  \"computation\": [\n"
      << "    " << quote("x, weights: dequantized to FP32; FP32 accumulation") << ",\n"
      << "    " << quote("per route (token t, choice k) with e = topk_idx[t][k] >= 0, w = topk_weights[t][k]: "
                         "h = W1[e] . x[t]; a[c] = SiLU(h[c]) * h[I + c] * w for c < I") << ",\n"
      << "    " << quote(requant) << ",\n"
      << "    " << quote("slot k of token t = BF16(W2[e] . a')") << ",\n"
      << "    " << quote("shared experts: each token of a rank, route weight 1, all shared experts' channels "
                         "together (their L2 outputs are summed in FP32 before one BF16 rounding) into slot top_k")
      << ",\n"
      << "    " << quote("y[t] = BF16(FP32 sum of the written slots in order 0..top_k); masked routes (-1) write "
                         "nothing")
      << "\n  ],\n"
      << "  \"formats\": {\n"
      << "    \"e4m3\": " << quote("sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; exponent 0: "
                                   "(m / 8) * 2^-6; else (1 + m / 8) * 2^(e - 7); 0x7F and 0xFF are NaN; max 448")
      << ",\n"
      << "    \"e2m1\": " << quote("sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; magnitudes of codes "
                                   "0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6")
      << ",\n"
      << "    \"ue8m0\": " << quote("2^(code - 127); 0xFF is NaN") << ",\n"
      << "    \"bf16\": " << quote("the upper 16 bits of an FP32") << "\n"
      << "  },\n"
      << "  \"files\": [\n";
  for (size_t f = 0; f < files.size(); ++f) {
    const FileEntry& file = files[f];
    out << "    {\"name\": " << quote(file.name) << ", \"dtype\": " << quote(dtype_name(file.dtype))
        << ", \"shape\": " << json_list(file.shape) << ", \"meaning\": " << quote(file.meaning)
        << ", \"decode\": " << quote(file.decode) << "}" << (f + 1 < files.size() ? "," : "") << "\n";
  }
  out << "  ]\n}\n";
  return out.str();
}

}  // namespace

void prepare_dump_dir(const std::filesystem::path& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  require(!error, "--dump", "cannot create directory '", dir.string(), "': ", error.message());
  require(std::filesystem::is_directory(dir, error), "--dump", "'", dir.string(), "' is not a directory");
  const std::filesystem::path probe = dir / ".megamoe-write-check";
  {
    std::ofstream file(probe);
    file << "x";
    file.close();
    require(file.good(), "--dump", "cannot write files in '", dir.string(), "'");
  }
  std::filesystem::remove(probe, error);
}

int write_dump(const std::filesystem::path& dir, const DumpInfo& info, const Problem& p,
               const std::vector<RankBatch>& batches, const ReferenceResult& result, const SyntheticWeights& weights,
               const std::function<void(int64_t, int64_t)>& progress) {
  prepare_dump_dir(dir);
  DumpWriter out(dir);
  const int64_t hidden = p.hidden;
  const int64_t top_k = p.top_k;
  for (int32_t r = 0; r < p.num_ranks; ++r) {
    const RankBatch& batch = batches[static_cast<size_t>(r)];
    const std::string rank = "rank" + std::to_string(r);
    const int64_t tokens = batch.num_tokens;
    if (p.recipe == Recipe::bf16) {
      out.write(rank + "_x.npy", {tokens, hidden}, bf16_words(batch.x),
                "rank " + std::to_string(r) + " input x [tokens][H]",
                "BF16 bits as uint16; value = float32 with bits (code << 16)");
    } else {
      out.write(rank + "_x.npy", {tokens, hidden}, batch.x, "rank " + std::to_string(r) + " input x [tokens][H]",
                "E4M3 codes as uint8; value = e4m3(code) * " + rank + "_x_scales[token][col / 128]");
      out.write(rank + "_x_scales.npy", {tokens, hidden / kScaleBlock}, batch.x_scales,
                "scales of x, one per 1x128 block [tokens][H/128]", "float32 as is");
    }
    out.write(rank + "_topk_idx.npy", {tokens, top_k}, batch.topk_idx, "global expert id of each top-k choice",
              "int32; -1 = masked route");
    out.write(rank + "_topk_weights.npy", {tokens, top_k}, batch.topk_weights, "route weight of each top-k choice",
              "float32 as is; ignored for masked routes");
    out.write(rank + "_y.npy", {tokens, hidden}, result.y[static_cast<size_t>(r)],
              "layer output y [tokens][H] computed by the " + info.backend + " backend",
              "BF16 bits as uint16; value = float32 with bits (code << 16)");
    out.write(rank + "_recv_counts.npy", {p.experts_per_rank()}, result.recv_counts[static_cast<size_t>(r)],
              "routes received by each local expert l (global id " + std::to_string(r) + " * experts_per_rank + l) "
              "from all ranks",
              "uint32 as is");
  }

  std::vector<int32_t> used;
  for (int32_t e = 0; e < p.num_experts; ++e) {
    if (result.recv_counts[static_cast<size_t>(p.owner_rank(e))][static_cast<size_t>(p.local_expert(e))] > 0) {
      used.push_back(e);
    }
  }
  const int64_t experts = static_cast<int64_t>(used.size());
  for (int64_t i = 0; i < experts; ++i) {
    const int32_t e = used[static_cast<size_t>(i)];
    write_expert(out, "expert" + std::to_string(e), "routed expert " + std::to_string(e), weights.routed_expert(e),
                 p.recipe);
    if (progress) progress(i + 1, experts);
  }
  for (int32_t s = 0; s < p.num_shared_experts; ++s) {
    write_expert(out, "shared" + std::to_string(s), "shared expert " + std::to_string(s), weights.shared_expert(s),
                 p.recipe);
  }

  const std::filesystem::path manifest_path = dir / "manifest.json";
  std::ofstream manifest(manifest_path);
  manifest << manifest_json(info, p, batches, used, out.files());
  manifest.close();
  require(manifest.good(), manifest_path.string().c_str(), "could not be written");
  return static_cast<int>(out.files().size()) + 1;
}

}  // namespace megamoe::cli
