// Runs a .pt2 that torch.export and AOTInductor made from a model calling
// attnkit.flex_attention, on inputs saved by Python as raw float32, and prints the largest
// difference from the output Python computed (docs/python.md). Exits 1 above --tolerance.
//
//   run_exported MODEL.pt2 DIR B H L D [TOLERANCE]
// DIR holds q.bin, k.bin, v.bin (B, H, L, D) and expected.bin (B, H, L, D), float32.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

torch::Tensor read_floats(const std::string& path, const std::vector<int64_t>& shape) {
  auto t = torch::empty(shape, torch::kFloat);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(t.data_ptr<float>()),
          static_cast<std::streamsize>(t.numel() * sizeof(float)));
  if (!in || in.peek() != std::char_traits<char>::eof())
    throw std::runtime_error(path + ": expected exactly " + std::to_string(t.numel()) +
                             " float32 values");
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7 || argc > 8) {
    std::cerr << "usage: run_exported MODEL.pt2 DIR B H L D [TOLERANCE]\n";
    return 2;
  }
  try {
    const std::string dir = argv[2];
    const std::vector<int64_t> shape{std::stoll(argv[3]), std::stoll(argv[4]), std::stoll(argv[5]),
                                     std::stoll(argv[6])};
    const double tolerance = argc == 8 ? std::stod(argv[7]) : 1e-5;
    const auto start = std::chrono::steady_clock::now();
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    const auto loaded = std::chrono::steady_clock::now();
    std::vector<torch::Tensor> inputs{read_floats(dir + "/q.bin", shape),
                                      read_floats(dir + "/k.bin", shape),
                                      read_floats(dir + "/v.bin", shape)};
    const auto expected = read_floats(dir + "/expected.bin", shape);
    auto out = loader.run(inputs).at(0);  // warm-up, and the output compared
    constexpr int kRuns = 5;
    const auto timed = std::chrono::steady_clock::now();
    for (int i = 0; i < kRuns; ++i)
      loader.run(inputs);
    const auto done = std::chrono::steady_clock::now();
    const double difference = (out - expected).abs().max().item<double>();
    const auto ms = [](auto a, auto b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    std::printf("load %.1f ms, run %.3f ms (mean of %d), max |C++ - Python| %.3g\n",
                ms(start, loaded), ms(timed, done) / kRuns, kRuns, difference);
    return difference <= tolerance ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << "run_exported: " << error.what() << "\n";
    return 2;
  }
}
