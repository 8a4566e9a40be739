#include "io/state_dict_reader.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "io/read_failure.h"
#include "io/tensor_unpickler.h"
#include "io/zip_archive.h"

namespace attnkit::detail {

StateDict parse_state_dict(const std::string& bytes, const std::string& name) {
  // Every record is checked (bounds, CRC-32) before anything reads it.
  const auto records = zip_records(bytes, name);
  for (const auto& record : records) {
    if (record.name.size() > 13 &&
        record.name.compare(record.name.size() - 13, 13, "constants.pkl") == 0)
      read_failure(name,
                   "is a TorchScript archive (torch.jit.save, or an attnkit-train checkpoint "
                   "older than format 3), not a dict of tensors; ",
                   kPythonHint);
  }
  // One folder holds every record, and the format version is one torch.load reads. (Not
  // LibTorch's PyTorchStreamReader: fuzzing found that it leaks its zip state when its
  // constructor throws, and it throws std::invalid_argument for a version that is no number.)
  const auto slash = records.empty() ? std::string::npos : records.front().name.find('/');
  if (slash == std::string::npos || slash == 0)
    read_failure(name, "is not a torch.save archive (its first record is not in a folder); ",
                 kPythonHint);
  const std::string folder = records.front().name.substr(0, slash + 1);
  const ZipRecord* version = nullptr;
  for (const auto& record : records) {
    if (record.name.compare(0, folder.size(), folder) != 0)
      read_failure(name, "is not a torch.save archive (record '", record.name, "' is outside '",
                   folder, "')");
    if (record.name == folder + ".data/version" ||
        (version == nullptr && record.name == folder + "version"))
      version = &record;
  }
  if (version == nullptr)
    read_failure(name, "is not a torch.save archive (it has no version record); ", kPythonHint);
  {
    std::string text = bytes.substr(version->offset, std::min<uint64_t>(version->size, 16));
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r'))
      text.pop_back();
    const bool digits = !text.empty() && text.size() <= 3 &&
                        text.find_first_not_of("0123456789") == std::string::npos;
    const int number = digits ? std::stoi(text) : 0;
    if (version->size > 16 || number < 1 || number > 6)
      read_failure(name, "has archive format version '", text,
                   "', expected 1 to 6 (torch.save writes 3)");
  }
  std::unordered_map<std::string, const ZipRecord*> by_name;
  for (const auto& record : records)
    by_name.emplace(record.name.substr(folder.size()), &record);
  // The record `key` (without the folder); null when the archive has none.
  auto find = [&](const std::string& key) -> const ZipRecord* {
    const auto found = by_name.find(key);
    return found == by_name.end() ? nullptr : found->second;
  };
  const ZipRecord* pickle = find("data.pkl");
  const ZipRecord* order = find("byteorder");
  if (order != nullptr && bytes.compare(order->offset, order->size, "little") != 0)
    read_failure(name, "was written on a big-endian machine; attnkit reads little-endian files");
  if (pickle == nullptr)
    read_failure(name, "has no data.pkl record; ", kPythonHint);

  return unpickle_state_dict(
      bytes.substr(pickle->offset, pickle->size), name, [&](const std::string& key) {
        const ZipRecord* record = find("data/" + key);
        if (record == nullptr)
          read_failure(name, "is damaged: storage '", key, "' has no record data/", key);
        return std::make_pair(bytes.data() + record->offset, record->size);
      });
}

}  // namespace attnkit::detail
