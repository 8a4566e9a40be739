#include "line.h"

#include <cerrno>
#include <iostream>

#include <unistd.h>

namespace attnkit::train {

namespace {

// The file descriptor behind one of the standard streams, or -1 for any other stream.
int standard_descriptor(const std::ostream& out) {
  const auto* buffer = out.rdbuf();
  if (buffer == std::cout.rdbuf())
    return STDOUT_FILENO;
  if (buffer == std::cerr.rdbuf() || buffer == std::clog.rdbuf())
    return STDERR_FILENO;
  return -1;
}

}  // namespace

void Line::write_whole(std::ostream& out, const std::string& text) noexcept {
  if (text.empty())
    return;
  const int descriptor = standard_descriptor(out);
  try {
    out.flush();  // what was streamed before this line goes first
    if (descriptor < 0) {
      out.write(text.data(), static_cast<std::streamsize>(text.size()));
      out.flush();
      return;
    }
  } catch (...) {
    return;  // a stream set to throw: a message that cannot be written is dropped
  }
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t count = ::write(descriptor, text.data() + written, text.size() - written);
    if (count < 0 && errno == EINTR)
      continue;
    if (count <= 0) {
      // A closed terminal or pipe, or a full disk: the message is lost; the stream says so,
      // for a program that must not report success after it (attnkit-train's report).
      try {
        out.setstate(std::ios::badbit);
      } catch (...) {  // a stream set to throw on badbit
      }
      return;
    }
    written += static_cast<size_t>(count);
  }
}

}  // namespace attnkit::train
