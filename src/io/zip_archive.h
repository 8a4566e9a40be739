#pragma once

// torch.save's zip archive, checked record by record. Nothing here decides how much memory is
// allocated: every size is checked against the bytes that are there first.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace attnkit::detail {

/// CRC-32 (the zip format's: polynomial 0xEDB88320), continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t size, uint32_t crc = 0);

struct ZipRecord {
  std::string name;     // as stored, with the archive's folder: "archive/data/0"
  uint64_t offset = 0;  // of its bytes in the file
  uint64_t size = 0;
};

/// Every record of the zip archive `bytes`, each checked: stored uncompressed (as torch.save
/// writes), inside the file, and matching its CRC-32 (a damaged record is an error naming it).
std::vector<ZipRecord> zip_records(const std::string& bytes, const std::string& name);

}  // namespace attnkit::detail
