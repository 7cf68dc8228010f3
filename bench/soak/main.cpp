// megamoe_soak: the layer called many times against the CPU reference. `megamoe soak ARGS` runs this
// binary with ARGS. Exit codes: 0 every variant passed, 1 a variant failed or the run failed, 2 bad
// command line.
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "bench/soak/soak.h"
#include "megamoe/error.h"

int main(int argc, char** argv) {
  using namespace megamoe;
  const std::vector<std::string> args(argv + 1, argv + argc);
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      std::cout << "usage:\n" << soak::soak_usage();
      return 0;
    }
  }
  soak::SoakOptions options;
  try {
    options = soak::parse_soak(args);
  } catch (const Error& error) {
    std::cerr << "megamoe soak: " << error.what() << "\n";
    return 2;
  }
  try {
    return soak::run_soak(options) == 0 ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << "megamoe soak: error: " << error.what() << "\n";
    return 1;
  }
}
