// The .npy writer: header layout (NumPy format 1.0) and data, read back byte by byte.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "cli/npy.h"
#include "megamoe/error.h"

namespace megamoe::cli {
namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Checks the fixed parts of a version 1.0 header and returns the dictionary text.
std::string header_dict(const std::string& file) {
  EXPECT_GE(file.size(), 10u);
  EXPECT_EQ(file.substr(0, 6), "\x93NUMPY");
  EXPECT_EQ(file[6], '\x01');
  EXPECT_EQ(file[7], '\x00');
  const size_t length = static_cast<uint8_t>(file[8]) | (static_cast<uint8_t>(file[9]) << 8);
  EXPECT_EQ((10 + length) % 64, 0u) << "data must start on a 64-byte boundary";
  EXPECT_EQ(file[10 + length - 1], '\n');
  return file.substr(10, length);
}

TEST(Npy, WritesHeaderAndData) {
  const auto path = std::filesystem::temp_directory_path() / "megamoe_npy_test_f32.npy";
  const std::vector<float> values = {1.5f, -2.0f, 0.25f, 3.0f, 4.0f, -0.0f};
  write_npy(path, {2, 3}, values.data());
  const std::string file = read_file(path);
  const std::string dict = header_dict(file);
  EXPECT_TRUE(dict.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }")) << dict;
  const size_t data_start = 10 + dict.size();
  ASSERT_EQ(file.size(), data_start + values.size() * sizeof(float));
  std::vector<float> back(values.size());
  std::memcpy(back.data(), file.data() + data_start, back.size() * sizeof(float));
  EXPECT_EQ(back, values);
  std::filesystem::remove(path);
}

TEST(Npy, ShapesAndTypes) {
  const std::string vector = header_dict(npy_header("<u4", {5}));
  EXPECT_TRUE(vector.starts_with("{'descr': '<u4', 'fortran_order': False, 'shape': (5,), }")) << vector;
  const std::string empty = header_dict(npy_header("|u1", {0, 256}));
  EXPECT_TRUE(empty.starts_with("{'descr': '|u1', 'fortran_order': False, 'shape': (0, 256), }")) << empty;
  const std::string cube = header_dict(npy_header("<i4", {2, 3, 4}));
  EXPECT_TRUE(cube.starts_with("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3, 4), }")) << cube;
  EXPECT_EQ(npy_descr<uint8_t>(), "|u1");
  EXPECT_EQ(npy_descr<uint16_t>(), "<u2");
  EXPECT_EQ(npy_descr<int32_t>(), "<i4");
  EXPECT_EQ(npy_descr<uint32_t>(), "<u4");
  EXPECT_EQ(npy_descr<float>(), "<f4");
}

TEST(Npy, WritesLittleEndianIntegers) {
  const auto path = std::filesystem::temp_directory_path() / "megamoe_npy_test_u16.npy";
  const std::vector<uint16_t> values = {0x1234, 0xABCD};
  write_npy(path, {2}, values.data());
  const std::string file = read_file(path);
  const std::string tail = file.substr(file.size() - 4);
  EXPECT_EQ(tail, std::string("\x34\x12\xCD\xAB", 4));
  std::filesystem::remove(path);
}

TEST(Npy, UnwritablePathIsAnError) {
  const std::vector<float> values = {1.0f};
  EXPECT_THROW(write_npy("/nonexistent-dir/x.npy", {1}, values.data()), Error);
}

}  // namespace
}  // namespace megamoe::cli
