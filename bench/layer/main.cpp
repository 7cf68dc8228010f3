// megamoe_layer_bench: the layer benchmark. `megamoe bench ARGS` runs this binary with ARGS.
// Exit codes: 0 success, 1 the run failed, 2 bad command line.
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "bench/layer/layer_bench.h"
#include "megamoe/error.h"

int main(int argc, char** argv) {
  using namespace megamoe;
  const std::vector<std::string> args(argv + 1, argv + argc);
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      std::cout << "usage:\n" << bench::bench_usage();
      return 0;
    }
  }
  bench::BenchOptions options;
  try {
    options = bench::parse_bench(args);
  } catch (const Error& error) {
    std::cerr << "megamoe bench: " << error.what() << "\n";
    return 2;
  }
  try {
    bench::run_bench(options);
    return 0;
  } catch (const std::exception& error) {
    std::cerr << "megamoe bench: error: " << error.what() << "\n";
    return 1;
  }
}
