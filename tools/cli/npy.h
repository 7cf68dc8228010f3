// A small writer of NumPy .npy files (format version 1.0, little-endian, C order).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace megamoe::cli {

// The NumPy dtype string of an element type.
template <typename T>
constexpr std::string_view npy_descr();
template <> constexpr std::string_view npy_descr<uint8_t>() { return "|u1"; }
template <> constexpr std::string_view npy_descr<uint16_t>() { return "<u2"; }
template <> constexpr std::string_view npy_descr<int32_t>() { return "<i4"; }
template <> constexpr std::string_view npy_descr<uint32_t>() { return "<u4"; }
template <> constexpr std::string_view npy_descr<float>() { return "<f4"; }

// Magic, version, header length and the header dictionary padded with spaces and a newline so the
// data starts on a 64-byte boundary.
std::string npy_header(std::string_view descr, const std::vector<int64_t>& shape);

// Writes shape-many elements of `element_bytes` each from `data`; throws megamoe::Error naming the
// path when the file cannot be written.
void write_npy(const std::filesystem::path& path, std::string_view descr, int element_bytes,
               const std::vector<int64_t>& shape, const void* data);

template <typename T>
void write_npy(const std::filesystem::path& path, const std::vector<int64_t>& shape, const T* data) {
  write_npy(path, npy_descr<T>(), sizeof(T), shape, data);
}

}  // namespace megamoe::cli
