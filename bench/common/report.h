// Benchmark results: a readable table on stdout and one JSON file in the format of
// docs/results.md (benchmark, commit, device, command, date, same-run ceilings, rows).
#pragma once

#include <map>
#include <string>
#include <variant>
#include <vector>

namespace megamoe::bench {

using Value = std::variant<double, long long, std::string>;
using Row = std::vector<std::pair<std::string, Value>>;  // ordered fields

struct Report {
  std::string benchmark;
  std::string command;
  std::map<std::string, double> ceilings;
  std::vector<Row> rows;
};

// "<cudaGetDeviceProperties name> x <count>"
std::string device_description();
// MEGAMOE_COMMIT from the environment (tools/gpu_check.sh sets it), else "unknown".
std::string commit_id();
std::string command_line(int argc, char** argv);

// Prints the rows as a table (columns in first-row order) and writes the JSON file.
void write_report(const Report& report, const std::string& path);

}  // namespace megamoe::bench
