#include "command_line.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace attnkit::cli {

namespace {

std::string see_help(const std::string& message) {
  return message + " (see --help)";
}

}  // namespace

CommandLine::CommandLine(const std::string& program, const std::string& description)
    : options_(program, description) {
  options_.set_width(100);
}

std::string CommandLine::add(const std::string& group, const std::string& names, Flag flag) {
  const auto comma = names.find(',');
  flag.long_name = comma == std::string::npos ? names : names.substr(comma + 1);
  if (comma == 1) {
    short_names_[names[0]] = flag.long_name;
  }
  if (std::find(groups_.begin(), groups_.end(), group) == groups_.end()) {
    groups_.push_back(group);
  }
  const auto long_name = flag.long_name;
  flags_[long_name] = std::move(flag);
  return long_name;
}

CommandLine& CommandLine::value(const std::string& group, const std::string& names,
                                const std::string& help, const std::string& default_value,
                                const std::string& implicit_value) {
  add(group, names, Flag{"", /*takes_value=*/true, default_value, implicit_value});
  auto kind = cxxopts::value<std::string>();
  if (!default_value.empty())
    kind->default_value(default_value);
  if (!implicit_value.empty())
    kind->implicit_value(implicit_value);
  options_.add_options(group)(names, help, kind);
  return *this;
}

CommandLine& CommandLine::flag(const std::string& group, const std::string& names,
                               const std::string& help) {
  add(group, names, Flag{"", /*takes_value=*/false, "", ""});
  options_.add_options(group)(names, help);
  return *this;
}

void CommandLine::parse(int argc, const char* const* argv) {
  given_.clear();
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    std::string name, value;
    bool has_value = false;
    if (argument.rfind("--", 0) == 0 && argument.size() > 2) {
      const auto equals = argument.find('=');
      name = argument.substr(2, equals == std::string::npos ? std::string::npos : equals - 2);
      if (equals != std::string::npos) {
        value = argument.substr(equals + 1);
        has_value = true;
      }
      if (flags_.count(name) == 0)
        throw UsageError(see_help("unknown flag '--" + name + "'"));
    } else if (argument.size() == 2 && argument[0] == '-' && argument[1] != '-') {
      const auto found = short_names_.find(argument[1]);
      if (found == short_names_.end())
        throw UsageError(see_help("unknown flag '" + argument + "'"));
      name = found->second;
    } else {
      throw UsageError(see_help("unexpected argument '" + argument + "'"));
    }
    const Flag& flag = flags_.at(name);
    if (!flag.takes_value) {
      if (has_value)
        throw UsageError("--" + name + " takes no value, got '" + argument + "'");
    } else if (!has_value) {
      if (!flag.implicit_value.empty()) {
        value = flag.implicit_value;  // --causal alone; another value needs --causal=VALUE
      } else if (i + 1 < argc) {
        value = argv[++i];  // taken as it is, even "-5": the checks of the value name the flag
      } else {
        throw UsageError(see_help("--" + name + ": expected a value after it"));
      }
    }
    given_[name] = value;
  }
}

CommandLine& CommandLine::example(const std::string& command, const std::string& what) {
  examples_.emplace_back(command, what);
  return *this;
}

std::string CommandLine::help() const {
  std::string text = options_.help(groups_);
  if (!examples_.empty())
    text += "\n Examples:\n";
  for (const auto& [command, what] : examples_)
    text += "  " + command + "\n      " + what + "\n";
  return text;
}

const CommandLine::Flag& CommandLine::declared(const std::string& name) const {
  const auto found = flags_.find(name);
  if (found == flags_.end())
    throw std::logic_error("CommandLine: no flag --" + name + " was declared");
  return found->second;
}

bool CommandLine::given(const std::string& name) const {
  declared(name);
  return given_.count(name) > 0;
}

std::string CommandLine::text(const std::string& name) const {
  const auto found = given_.find(name);
  return found != given_.end() ? found->second : declared(name).default_value;
}

namespace {

// `value` as a number by `convert` (strtoll, strtoull, strtod), which must use all of it.
template <typename Convert>
auto convert_all(const std::string& name, const std::string& value, const char* expected,
                 Convert convert) {
  char* end = nullptr;
  errno = 0;
  const auto parsed = convert(value.c_str(), &end);
  if (value.empty() || *end != '\0' || errno == ERANGE)
    throw UsageError("--" + name + ": expected " + expected + ", got '" + value + "'");
  return parsed;
}

}  // namespace

int64_t CommandLine::integer(const std::string& name) const {
  return convert_all(name, text(name), "an integer",
                     [](const char* s, char** end) { return std::strtoll(s, end, 10); });
}

uint64_t CommandLine::unsigned_integer(const std::string& name) const {
  // strtoull would wrap "-1" around; a leading '-' is left unread, so it fails.
  return convert_all(name, text(name), "an integer >= 0", [](const char* s, char** end) {
    if (*s == '-') {
      *end = const_cast<char*>(s);
      return 0ULL;
    }
    return std::strtoull(s, end, 10);
  });
}

double CommandLine::number(const std::string& name) const {
  return convert_all(name, text(name), "a number",
                     [](const char* s, char** end) { return std::strtod(s, end); });
}

bool CommandLine::boolean(const std::string& name) const {
  const auto value = text(name);
  if (value == "true")
    return true;
  if (value == "false")
    return false;
  throw UsageError("--" + name + ": expected true or false, got '" + value + "'");
}

}  // namespace attnkit::cli
