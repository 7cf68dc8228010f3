// Command-line flags of the megamoe commands: "--name value" or "--name=value", each at most once.
// Every mistake throws megamoe::Error whose message starts with the flag it is about.
#pragma once

#include <algorithm>
#include <charconv>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/error.h"
#include "megamoe/presets.h"

namespace megamoe::cli {

// True when `args` asks for help (--help or -h anywhere): commands answer it before parsing.
bool wants_help(const std::vector<std::string>& args);

class Flags {
 public:
  // Throws for an argument that is not a flag, a flag not in `known`, a repeated flag, a missing value.
  Flags(const std::vector<std::string>& args, std::initializer_list<const char*> known);

  std::optional<std::string> value(const char* name) const;

 private:
  std::vector<std::pair<std::string, std::string>> values_;  // in command-line order
};

template <typename T>
T parse_number(const std::string& flag, const std::string& text, T min_value, T max_value) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  const bool digits = !text.empty() && ptr == end;
  require(digits && (ec == std::errc() || ec == std::errc::result_out_of_range), flag.c_str(),
          "expected a whole number, got '", text, "'");
  require(ec == std::errc() && value >= min_value && value <= max_value, flag.c_str(), text,
          " is out of range: must be in [", min_value, ", ", max_value, "]");
  return value;
}

// A comma-separated flag: each item through parse(item, value) -> bool, none twice; `fallback` when
// the flag is absent. `expected` names the items in the error message.
template <typename T, typename Parse>
std::vector<T> parse_list(const Flags& flags, const char* flag, std::vector<T> fallback, const char* expected,
                          const Parse& parse) {
  const std::optional<std::string> text = flags.value(flag);
  if (!text) return fallback;
  std::vector<T> items;
  std::stringstream list(*text);
  std::string item;
  while (std::getline(list, item, ',')) {
    T value{};
    require(parse(item, value), flag, "must be a comma-separated list of ", expected, ", got '", *text, "'");
    require(std::find(items.begin(), items.end(), value) == items.end(), flag, "names ", item, " twice");
    items.push_back(value);
  }
  require(!items.empty() && text->back() != ',', flag, "must be a comma-separated list of ", expected, ", got '",
          *text, "'");
  return items;
}

// --preset (required): the named preset.
const Preset& preset_flag(const Flags& flags);
// --ranks: expert-parallel ranks, which must divide the preset's experts; the preset's default if absent.
int32_t ranks_flag(const Flags& flags, const Preset& preset);

}  // namespace megamoe::cli
