#include "cli/npy.h"

#include <bit>
#include <fstream>

#include "megamoe/error.h"

namespace megamoe::cli {

static_assert(std::endian::native == std::endian::little, "the .npy writer stores host memory as little-endian");

std::string npy_header(std::string_view descr, const std::vector<int64_t>& shape) {
  std::string dict = "{'descr': '";
  dict += descr;
  dict += "', 'fortran_order': False, 'shape': (";
  for (size_t d = 0; d < shape.size(); ++d) {
    dict += std::to_string(shape[d]);
    if (d + 1 < shape.size() || shape.size() == 1) dict += ",";
    if (d + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  constexpr size_t kPrefix = 10;  // magic (6), version (2), header length (2)
  const size_t padded = (kPrefix + dict.size() + 1 + 63) / 64 * 64;
  dict.append(padded - kPrefix - dict.size() - 1, ' ');
  dict += '\n';
  std::string header = "\x93NUMPY";
  header += '\x01';
  header += '\x00';
  header += static_cast<char>(dict.size() & 0xFF);
  header += static_cast<char>(dict.size() >> 8);
  return header + dict;
}

void write_npy(const std::filesystem::path& path, std::string_view descr, int element_bytes,
               const std::vector<int64_t>& shape, const void* data) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  const std::string header = npy_header(descr, shape);
  std::ofstream out(path, std::ios::binary);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(count * element_bytes));
  out.close();
  require(out.good(), path.string().c_str(), "could not be written");
}

}  // namespace megamoe::cli
