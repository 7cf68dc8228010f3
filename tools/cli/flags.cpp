#include "cli/flags.h"

#include <algorithm>

#include "megamoe/config.h"

namespace megamoe::cli {

bool wants_help(const std::vector<std::string>& args) {
  return std::any_of(args.begin(), args.end(), [](const std::string& arg) { return arg == "--help" || arg == "-h"; });
}

Flags::Flags(const std::vector<std::string>& args, std::initializer_list<const char*> known) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    require(arg.rfind("--", 0) == 0, arg.c_str(), "unexpected argument (flags start with --)");
    std::string name = arg;
    std::string value;
    const size_t equals = arg.find('=');
    if (equals != std::string::npos) {
      name = arg.substr(0, equals);
      value = arg.substr(equals + 1);
    } else {
      require(i + 1 < args.size(), arg.c_str(), "needs a value");
      value = args[++i];
    }
    require(std::find(known.begin(), known.end(), name) != known.end(), name.c_str(),
            "unknown flag (see --help)");
    for (const auto& seen : values_) require(seen.first != name, name.c_str(), "given more than once");
    values_.emplace_back(name, value);
  }
}

std::optional<std::string> Flags::value(const char* name) const {
  for (const auto& [flag, value] : values_) {
    if (flag == name) return value;
  }
  return std::nullopt;
}

const Preset& preset_flag(const Flags& flags) {
  const std::optional<std::string> name = flags.value("--preset");
  require(name.has_value(), "--preset", "is required (see 'megamoe help' for the names)");
  try {
    return find_preset(*name);
  } catch (const Error& error) {
    throw Error(std::string("--") + error.what());
  }
}

int32_t ranks_flag(const Flags& flags, const Preset& preset) {
  int32_t ranks = preset.default_ranks;
  if (auto text = flags.value("--ranks")) ranks = parse_number<int32_t>("--ranks", *text, 1, kMaxRanks);
  require(preset.num_experts % ranks == 0, "--ranks", "must divide the ", preset.num_experts, " experts of ",
          preset.name, ", got ", ranks);
  return ranks;
}

}  // namespace megamoe::cli
