// mask_of_form (mask_form.h): a Mask from its value form.

#include "core/masks/mask_form.h"

#include <cctype>
#include <limits>
#include <vector>

namespace attnkit::detail {

namespace {

constexpr const char* kExpected =
    "expected causal(OFFSET), causal(OFFSET, window=W), key_padding(#I) or documents(#I), "
    "joined by \" & \"";

std::string trimmed(const std::string& text) {
  size_t first = 0, last = text.size();
  while (first < last && std::isspace(static_cast<unsigned char>(text[first])))
    ++first;
  while (last > first && std::isspace(static_cast<unsigned char>(text[last - 1])))
    --last;
  return text.substr(first, last - first);
}

// The text's integer, whole and in int64, or nullopt (digits only: the form is written by a
// program, not typed).
c10::optional<int64_t> integer_of(const std::string& text) {
  if (text.empty())
    return c10::nullopt;
  int64_t value = 0;
  for (char c : text) {
    const int digit = c - '0';
    if (digit < 0 || digit > 9 || value > (std::numeric_limits<int64_t>::max() - digit) / 10)
      return c10::nullopt;
    value = value * 10 + digit;
  }
  return value;
}

// One part: NAME(ARGUMENTS), split at ", ".
struct Part {
  std::string name;
  std::vector<std::string> arguments;
};

c10::optional<Part> part_of(const std::string& text) {
  const auto open = text.find('(');
  if (open == std::string::npos || open == 0 || text.back() != ')')
    return c10::nullopt;
  Part part{text.substr(0, open), {}};
  const auto inside = text.substr(open + 1, text.size() - open - 2);
  size_t start = 0;
  while (start <= inside.size()) {
    const auto comma = inside.find(',', start);
    const auto end = comma == std::string::npos ? inside.size() : comma;
    part.arguments.push_back(trimmed(inside.substr(start, end - start)));
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  return part;
}

}  // namespace

Mask mask_of_form(const char* fn, const std::string& form, at::TensorList tensors) {
  Mask mask;
  std::vector<bool> read(tensors.size(), false);
  const auto tensor_of = [&](const std::string& part, const std::string& argument) {
    const auto index = argument.size() > 1 && argument[0] == '#' ? integer_of(argument.substr(1))
                                                                 : c10::optional<int64_t>();
    TORCH_CHECK(index.has_value(), fn, " mask: in '", part, "', expected a tensor as #I, got '",
                argument, "'");
    TORCH_CHECK(*index < static_cast<int64_t>(tensors.size()), fn, " mask: '", part,
                "' reads mask_tensors[", *index, "], but mask_tensors holds ", tensors.size());
    read[*index] = true;
    return tensors[*index];
  };
  size_t start = 0;
  while (!trimmed(form).empty() && start <= form.size()) {
    const auto joint = form.find('&', start);
    const auto text =
        trimmed(form.substr(start, joint == std::string::npos ? std::string::npos : joint - start));
    const auto part = part_of(text);
    TORCH_CHECK(part.has_value(), fn, " mask: cannot read '", text, "' in '", form, "'; ",
                kExpected);
    const auto& args = part->arguments;
    Mask next;
    if (part->name == "causal" && (args.size() == 1 || args.size() == 2)) {
      const auto offset = integer_of(args[0]);
      TORCH_CHECK(offset.has_value(), fn, " mask: in '", text,
                  "', the query offset must be an integer >= 0, got '", args[0], "'");
      next = Mask::causal(*offset);
      if (args.size() == 2) {
        const auto window =
            args[1].rfind("window=", 0) == 0 ? integer_of(args[1].substr(7)) : c10::nullopt;
        TORCH_CHECK(window.has_value(), fn, " mask: in '", text,
                    "', expected window=W with an integer W >= 1, got '", args[1], "'");
        next = next.sliding_window(*window);
      }
    } else if (part->name == "key_padding" && args.size() == 1) {
      next = Mask::key_padding(tensor_of(text, args[0]));
    } else if (part->name == "documents" && args.size() == 1) {
      next = Mask::documents(tensor_of(text, args[0]));
    } else {
      TORCH_CHECK(false, fn, " mask: cannot read '", text, "' in '", form, "'; ", kExpected);
    }
    mask = mask.is_none() ? next : mask & next;
    if (joint == std::string::npos)
      break;
    start = joint + 1;
  }
  for (size_t i = 0; i < read.size(); ++i)
    TORCH_CHECK(read[i], fn, " mask: mask_tensors[", i, "] is not read by the mask '", form, "'");
  return mask;
}

}  // namespace attnkit::detail
