#include "heatmap.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "attnkit/serialize.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_easy_font.h>
#include <stb/stb_image_write.h>

namespace attnkit::train {

namespace {

using Rgb = std::array<uint8_t, 3>;

constexpr int kTextScale = 2;  // stb_easy_font glyphs are ~6x7 px; doubled to be legible
constexpr int kLineHeight = 9 * kTextScale;
constexpr int kCharWidth = 6 * kTextScale;
constexpr int kMargin = 12;

class Image {
 public:
  Image(int width, int height) : width_(width), height_(height), pixels_(width * height * 3, 255) {}

  void fill(int x0, int y0, int x1, int y1, Rgb color) {
    for (int y = std::max(0, y0); y < std::min(height_, y1); ++y) {
      for (int x = std::max(0, x0); x < std::min(width_, x1); ++x) {
        std::copy(color.begin(), color.end(), pixels_.begin() + 3 * (y * width_ + x));
      }
    }
  }

  // stb_easy_font turns text into axis-aligned quads; each quad is filled as a rectangle.
  void text(int x, int y, const std::string& text, Rgb color = {0, 0, 0}) {
    std::vector<char> buffer(text.size() * 270 + 1000);
    std::string copy = text;
    const int quads = stb_easy_font_print(0, 0, copy.data(), nullptr, buffer.data(),
                                          static_cast<int>(buffer.size()));
    const auto* vertices = reinterpret_cast<const float*>(buffer.data());
    for (int q = 0; q < quads; ++q) {
      const float* v = vertices + q * 16;  // 4 vertices of (x, y, z, rgba as a float slot)
      const int left = static_cast<int>(std::min({v[0], v[4], v[8], v[12]}));
      const int top = static_cast<int>(std::min({v[1], v[5], v[9], v[13]}));
      const int right = static_cast<int>(std::max({v[0], v[4], v[8], v[12]}));
      const int bottom = static_cast<int>(std::max({v[1], v[5], v[9], v[13]}));
      fill(x + left * kTextScale, y + top * kTextScale, x + right * kTextScale,
           y + bottom * kTextScale, color);
    }
  }

  // Encoded in memory, then written as every attnkit file is (flushed, checked, renamed):
  // stbi_write_png would report success on a full disk, where its fwrite fails unchecked.
  void write_png(const std::string& path) const {
    std::string png;
    const auto append = [](void* context, void* data, int size) {
      static_cast<std::string*>(context)->append(static_cast<const char*>(data), size);
    };
    TORCH_CHECK(
        stbi_write_png_to_func(append, &png, width_, height_, 3, pixels_.data(), width_ * 3) != 0,
        "--dump-attention: cannot encode the heatmap for '", path, "'");
    write_atomically(path, "--dump-attention:", [&](std::ostream& out) {
      out.write(png.data(), static_cast<std::streamsize>(png.size()));
    });
  }

 private:
  int width_, height_;
  std::vector<uint8_t> pixels_;
};

// White (0) through blue to dark navy (1).
Rgb color_of(double weight) {
  const double w = std::clamp(weight, 0.0, 1.0);
  const auto mix = [&](double a, double b) { return static_cast<uint8_t>(a + (b - a) * w); };
  return {mix(255, 8), mix(255, 48), mix(255, 107)};
}

}  // namespace

void write_attention_heatmap(const std::string& path, const std::vector<torch::Tensor>& maps,
                             const std::vector<std::string>& labels, const std::string& title) {
  TORCH_CHECK(!maps.empty(), "[write_attention_heatmap] no attention maps to draw");
  const auto heads = static_cast<int>(maps.front().size(0));
  const auto n = static_cast<int>(maps.front().size(-1));
  TORCH_CHECK(static_cast<int>(labels.size()) == n, "[write_attention_heatmap] ", labels.size(),
              " labels for ", n, " tokens");
  size_t longest = 1;
  for (const auto& label : labels)
    longest = std::max(longest, label.size());

  const int cell = std::clamp(480 / n, 12, 40);
  const int label_width = static_cast<int>(longest) * kCharWidth + 8;
  const int panel_width = label_width + n * cell;
  const int panel_height = 2 * kLineHeight + label_width + n * cell;  // title, keys caption
  const int width = kMargin + heads * (panel_width + kMargin);
  const int height = kLineHeight * 2 + static_cast<int>(maps.size()) * (panel_height + kMargin);
  Image image(width, height);
  image.text(kMargin, kMargin / 2,
             title + ": attention weights (rows: queries, columns: keys; darker = more)");

  for (size_t layer = 0; layer < maps.size(); ++layer) {
    const auto weights = maps[layer].to(torch::kFloat64).contiguous();
    const auto* w = weights.data_ptr<double>();
    for (int head = 0; head < heads; ++head) {
      const int x0 = kMargin + head * (panel_width + kMargin);
      const int y0 = kLineHeight * 2 + static_cast<int>(layer) * (panel_height + kMargin);
      image.text(x0, y0,
                 "layer " + std::to_string(layer + 1) + ", head " + std::to_string(head + 1) +
                     "   keys ->");
      const int grid_x = x0 + label_width;
      const int grid_y = y0 + kLineHeight + label_width;
      // Key labels above the columns (one character per line), query labels left of rows.
      for (int j = 0; j < n; ++j) {
        for (size_t c = 0; c < labels[j].size(); ++c) {
          image.text(grid_x + j * cell + (cell - kCharWidth) / 2 + 2,
                     grid_y - static_cast<int>(labels[j].size() - c) * kLineHeight,
                     std::string(1, labels[j][c]));
        }
      }
      for (int i = 0; i < n; ++i) {
        image.text(x0, grid_y + i * cell + (cell - kLineHeight) / 2 + 2, labels[i]);
        for (int j = 0; j < n; ++j) {
          image.fill(grid_x + j * cell, grid_y + i * cell, grid_x + (j + 1) * cell,
                     grid_y + (i + 1) * cell, color_of(w[(head * n + i) * n + j]));
        }
      }
    }
  }
  image.write_png(path);
}

}  // namespace attnkit::train
