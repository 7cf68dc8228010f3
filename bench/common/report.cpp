#include "bench/common/report.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>

#include "megamoe/error.h"

namespace megamoe::bench {
namespace {

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

std::string json_value(const Value& value) {
  if (const double* d = std::get_if<double>(&value)) {
    if (!std::isfinite(*d)) return "null";
    char text[64];
    std::snprintf(text, sizeof(text), "%.6g", *d);
    return text;
  }
  if (const long long* i = std::get_if<long long>(&value)) return std::to_string(*i);
  return "\"" + json_escape(std::get<std::string>(value)) + "\"";
}

std::string table_value(const Value& value) {
  if (const double* d = std::get_if<double>(&value)) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.4g", *d);
    return text;
  }
  if (const long long* i = std::get_if<long long>(&value)) return std::to_string(*i);
  return std::get<std::string>(value);
}

std::string iso_date() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

}  // namespace

std::string device_description() {
  int count = 0;
  cudaGetDeviceCount(&count);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  return std::string(prop.name) + " x " + std::to_string(count);
}

std::string commit_id() {
  const char* commit = std::getenv("MEGAMOE_COMMIT");
  return commit != nullptr && *commit != 0 ? commit : "unknown";
}

std::string command_line(int argc, char** argv) {
  std::string text;
  for (int i = 0; i < argc; ++i) text += (i ? " " : "") + std::string(argv[i]);
  return text;
}

void write_report(const Report& report, const std::string& path) {
  // Table: one line per row, fields in the first row's order.
  if (!report.rows.empty()) {
    std::ostringstream header;
    for (const auto& [name, value] : report.rows.front()) header << name << "\t";
    std::printf("%s\n", header.str().c_str());
    for (const Row& row : report.rows) {
      std::ostringstream line;
      for (const auto& [name, value] : row) line << table_value(value) << "\t";
      std::printf("%s\n", line.str().c_str());
    }
  }
  for (const auto& [name, value] : report.ceilings) std::printf("ceiling %s = %.4g\n", name.c_str(), value);

  std::ostringstream json;
  json << "{\n  \"benchmark\": \"" << json_escape(report.benchmark) << "\",\n";
  json << "  \"commit\": \"" << json_escape(commit_id()) << "\",\n";
  json << "  \"device\": \"" << json_escape(device_description()) << "\",\n";
  json << "  \"command\": \"" << json_escape(report.command) << "\",\n";
  json << "  \"date\": \"" << iso_date() << "\",\n  \"ceilings\": {";
  bool first = true;
  for (const auto& [name, value] : report.ceilings) {
    json << (first ? "" : ", ") << "\"" << name << "\": " << json_value(value);
    first = false;
  }
  json << "},\n  \"rows\": [\n";
  for (size_t r = 0; r < report.rows.size(); ++r) {
    json << "    {";
    for (size_t f = 0; f < report.rows[r].size(); ++f)
      json << (f ? ", " : "") << "\"" << report.rows[r][f].first << "\": " << json_value(report.rows[r][f].second);
    json << "}" << (r + 1 < report.rows.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  std::ofstream file(path);
  require(file.good(), "--out", "cannot write ", path);
  file << json.str();
  std::printf("wrote %s\n", path.c_str());
}

}  // namespace megamoe::bench
