#pragma once

// The command line of the attnkit programs. cxxopts lays out --help; the arguments are read
// here, so that an unknown flag, a missing value or a value of the wrong kind gets attnkit's
// own one-line message, the same with every cxxopts version (3.1 and 3.2 word their errors
// differently, and the programs' tests match the messages).

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cxxopts.hpp>

namespace attnkit::cli {

/// A bad command line. The message names the flag and what was expected; the programs print
/// it as one line and exit with status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class CommandLine {
 public:
  CommandLine(const std::string& program, const std::string& description);

  /// `--name VALUE` or `--name=VALUE`. `names` is "name" or "s,name". With an
  /// `implicit_value`, `--name` alone means that value and another is given as `--name=VALUE`.
  /// Example: `cli.value("Run", "steps", "training steps", "600");`
  CommandLine& value(const std::string& group, const std::string& names, const std::string& help,
                     const std::string& default_value = "", const std::string& implicit_value = "");

  /// `--name` without a value. Example: `cli.flag("Run", "h,help", "show this help");`
  CommandLine& flag(const std::string& group, const std::string& names, const std::string& help);

  /// Reads the arguments. Throws UsageError on an unknown flag, a missing value, a value given
  /// to a flag that takes none, or an argument that is not a flag.
  void parse(int argc, const char* const* argv);

  /// A command line shown at the end of --help, with what it does.
  CommandLine& example(const std::string& command, const std::string& what);

  /// Every group, in the order they were declared, then the examples.
  std::string help() const;

  /// Whether `--name` was given (its default does not count).
  bool given(const std::string& name) const;
  /// The value given, else the default ("" when there is none).
  std::string text(const std::string& name) const;
  /// text(name) as a signed integer; UsageError "--name: expected an integer, got '...'".
  int64_t integer(const std::string& name) const;
  /// text(name) as an integer >= 0.
  uint64_t unsigned_integer(const std::string& name) const;
  /// text(name) as a floating-point number.
  double number(const std::string& name) const;
  /// text(name) as true or false.
  bool boolean(const std::string& name) const;

 private:
  struct Flag {
    std::string long_name;
    bool takes_value = false;
    std::string default_value;
    std::string implicit_value;
  };
  const Flag& declared(const std::string& name) const;
  std::string add(const std::string& group, const std::string& names, Flag flag);

  cxxopts::Options options_;
  std::vector<std::string> groups_;
  std::vector<std::pair<std::string, std::string>> examples_;  // command, what it does
  std::map<std::string, Flag> flags_;                          // by long name
  std::map<char, std::string> short_names_;                    // short name -> long name
  std::map<std::string, std::string> given_;  // long name -> value given ("" for a flag)
};

}  // namespace attnkit::cli
