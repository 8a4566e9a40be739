#pragma once

// Whole lines: the ranks of a data-parallel run, and their launcher, share one terminal, and
// unbuffered std::cerr turns every `<<` into its own write(), so two processes' messages came
// out cut into each other. A `Line` collects what is streamed into it and hands it to the
// stream in one piece when it goes out of scope; for std::cout, std::cerr and std::clog that
// is one write() to the file descriptor (atomic on a pipe up to PIPE_BUF bytes).

#include <ostream>
#include <sstream>
#include <string>

namespace attnkit::train {

/// Example: `Line(std::cerr) << "attnkit-train: rank " << rank << " stopped\n";`
/// The text takes `out`'s format flags (precision, fixed), and is written at the end of the
/// full expression. Include the "\n" yourself: a progress bar ends with "\r" instead.
class Line {
 public:
  explicit Line(std::ostream& out) : out_(out) { text_.copyfmt(out); }
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;
  ~Line() { write_whole(out_, text_.str()); }

  template <typename T>
  Line& operator<<(const T& value) {
    text_ << value;
    return *this;
  }
  Line& operator<<(std::ostream& (*manipulator)(std::ostream&)) {
    manipulator(text_);
    return *this;
  }

  /// Writes `text` to `out` in one piece: std::cout, std::cerr and std::clog are flushed and
  /// then written with one write() (repeated only for what a signal or a full pipe left
  /// unwritten); any other stream gets it in one `write` call and is flushed.
  static void write_whole(std::ostream& out, const std::string& text) noexcept;

 private:
  std::ostream& out_;
  std::ostringstream text_;
};

}  // namespace attnkit::train
