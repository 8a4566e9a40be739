#include "io/zip_archive.h"

#include <array>
#include <unordered_map>
#include <utility>

#include "io/read_failure.h"

namespace attnkit::detail {

namespace {

constexpr uint32_t kLocalHeader = 0x04034b50;
constexpr uint32_t kCentralHeader = 0x02014b50;
constexpr uint32_t kEndOfDirectory = 0x06054b50;
constexpr uint32_t kZip64EndOfDirectory = 0x06064b50;
constexpr uint32_t kZip64Locator = 0x07064b50;
constexpr uint32_t kAll32 = 0xFFFFFFFF;

// Little-endian reads that check their bounds.
class ByteReader {
 public:
  ByteReader(const std::string& bytes, const std::string& name) : bytes_(bytes), name_(name) {}
  uint64_t size() const { return bytes_.size(); }
  bool has(uint64_t at, uint64_t count) const { return at <= size() && count <= size() - at; }
  uint64_t unsigned_at(uint64_t at, int width) const {
    if (!has(at, width))
      read_failure(name_, "is truncated: a zip header at byte ", at, " runs past the end (", size(),
                   " bytes); ", kPythonHint);
    uint64_t value = 0;
    for (int i = width - 1; i >= 0; --i)
      value = (value << 8) | static_cast<unsigned char>(bytes_[at + i]);
    return value;
  }
  uint32_t u16(uint64_t at) const { return static_cast<uint32_t>(unsigned_at(at, 2)); }
  uint32_t u32(uint64_t at) const { return static_cast<uint32_t>(unsigned_at(at, 4)); }
  uint64_t u64(uint64_t at) const { return unsigned_at(at, 8); }
  std::string text(uint64_t at, uint64_t count) const {
    if (!has(at, count))
      read_failure(name_, "is truncated: a record name at byte ", at, " runs past the end");
    return bytes_.substr(at, count);
  }

 private:
  const std::string& bytes_;
  const std::string& name_;
};

// Where the central directory is and how many entries it has (zip64 where the classic
// end-of-directory record says so).
struct Directory {
  uint64_t entries = 0, size = 0, offset = 0;
};

Directory find_directory(const ByteReader& in, const std::string& name) {
  constexpr uint64_t kEndSize = 22, kMaxComment = 0xFFFF;
  if (in.size() < kEndSize || in.u32(0) != kLocalHeader)
    read_failure(name, "is not a zip archive (torch.save's format); ", kPythonHint);
  uint64_t end = in.size() - kEndSize;
  while (in.u32(end) != kEndOfDirectory) {
    if (end == 0 || in.size() - end >= kEndSize + kMaxComment)
      read_failure(name, "is truncated or damaged: no zip end-of-directory record");
    --end;
  }
  Directory directory{in.u16(end + 10), in.u32(end + 12), in.u32(end + 16)};
  if (directory.entries == 0xFFFF || directory.size == kAll32 || directory.offset == kAll32) {
    if (end < 20 || in.u32(end - 20) != kZip64Locator)
      read_failure(name, "is damaged: a zip64 archive without its zip64 locator");
    const uint64_t end64 = in.u64(end - 20 + 8);
    if (in.u32(end64) != kZip64EndOfDirectory)
      read_failure(name, "is damaged: the zip64 end-of-directory record is missing");
    directory = Directory{in.u64(end64 + 32), in.u64(end64 + 40), in.u64(end64 + 48)};
  }
  constexpr uint64_t kMinEntrySize = 46;
  if (!in.has(directory.offset, directory.size) ||
      directory.entries > directory.size / kMinEntrySize)
    read_failure(name, "is damaged: its zip directory claims ", directory.entries, " entries in ",
                 directory.size, " bytes at byte ", directory.offset, ", the file has ", in.size());
  return directory;
}

}  // namespace

std::vector<ZipRecord> zip_records(const std::string& bytes, const std::string& name) {
  const ByteReader in(bytes, name);
  const Directory directory = find_directory(in, name);
  std::vector<ZipRecord> records;
  records.reserve(directory.entries);
  std::unordered_map<std::string, size_t> seen;
  uint64_t at = directory.offset;
  for (uint64_t i = 0; i < directory.entries; ++i) {
    if (in.u32(at) != kCentralHeader)
      read_failure(name, "is damaged: zip directory entry ", i, " is not where the directory says");
    const uint32_t flags = in.u16(at + 8), method = in.u16(at + 10), crc = in.u32(at + 16);
    uint64_t stored_size = in.u32(at + 20), size = in.u32(at + 24);
    const uint32_t name_length = in.u16(at + 28), extra_length = in.u16(at + 30),
                   comment_length = in.u16(at + 32);
    uint64_t local = in.u32(at + 42);
    ZipRecord record;
    record.name = in.text(at + 46, name_length);
    // zip64: the sizes and offset that do not fit 32 bits follow in extra field 0x0001.
    const uint64_t extra_end = at + 46 + name_length + extra_length;
    for (uint64_t field = at + 46 + name_length; field + 4 <= extra_end;) {
      const uint32_t id = in.u16(field), length = in.u16(field + 2);
      uint64_t value = field + 4;
      const uint64_t field_end = value + length;
      if (field_end > extra_end)
        read_failure(name, "is damaged: record '", record.name,
                     "' has an extra field past its entry");
      if (id == 0x0001) {
        for (uint64_t* target : {&size, &stored_size, &local}) {
          if (*target == kAll32 && value + 8 <= field_end) {
            *target = in.u64(value);
            value += 8;
          }
        }
      }
      field = field_end;
    }
    if ((flags & 1) != 0 || method != 0 || stored_size != size)
      read_failure(name, "record '", record.name, "' is compressed or encrypted (zip method ",
                   method, "); torch.save stores its records as they are");
    if (in.u32(local) != kLocalHeader)
      read_failure(name, "is damaged: the local header of record '", record.name, "' is missing");
    record.offset = local + 30 + in.u16(local + 26) + in.u16(local + 28);
    record.size = size;
    if (!in.has(record.offset, record.size))
      read_failure(name, "is truncated or damaged: record '", record.name, "' claims ", record.size,
                   " bytes at byte ", record.offset, ", past the end of the file (", in.size(),
                   " bytes)");
    const uint32_t actual = crc32(bytes.data() + record.offset, record.size);
    if (actual != crc)
      read_failure(name, "is damaged: record '", record.name,
                   "' does not match its CRC-32 (computed ", actual, ", the archive says ", crc,
                   ")");
    if (!seen.emplace(record.name, records.size()).second)
      read_failure(name, "is damaged: record '", record.name, "' appears twice");
    records.push_back(std::move(record));
    at = extra_end + comment_length;
  }
  return records;
}

uint32_t crc32(const void* data, size_t size, uint32_t crc) {
  static const auto kTable = [] {
    std::array<uint32_t, 256> table{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t value = i;
      for (int bit = 0; bit < 8; ++bit)
        value = (value & 1) ? 0xEDB88320u ^ (value >> 1) : value >> 1;
      table[i] = value;
    }
    return table;
  }();
  const auto* bytes = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i)
    crc = kTable[(crc ^ bytes[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

}  // namespace attnkit::detail
