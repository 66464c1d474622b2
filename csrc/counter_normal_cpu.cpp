// Counter-based normal draws. rmt/ops/counter_normal.py holds the specification and the torch
// reference; this kernel performs the same IEEE float64 operations in the same order (compiled
// with -ffp-contract=off: no fused multiply-add), so both give identical bits. Each element is a
// pure function of (key, global position), written with selects rather than branches so that
// the compiler vectorizes the column loop; rows are split over OpenMP threads; nothing is
// allocated.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;
constexpr double kLn2 = 0.69314718055994530942;
constexpr double kSqrt2 = 1.4142135623730950488;
constexpr double kPiO2 = 1.5707963267948966192;
constexpr double kTwoM30 = 1.0 / 1073741824.0;

// LOG_COEFFS, SIN_COEFFS, COS_COEFFS of the Python specification (each a correctly rounded
// quotient of exact integers).
constexpr double kLog[7] = {2.0 / 1, 2.0 / 3, 2.0 / 5, 2.0 / 7, 2.0 / 9, 2.0 / 11, 2.0 / 13};
constexpr double kSin[8] = {1.0 / 1, -1.0 / 6, 1.0 / 120, -1.0 / 5040, 1.0 / 362880, -1.0 / 39916800,
                            1.0 / 6227020800.0, -1.0 / 1307674368000.0};
constexpr double kCos[8] = {1.0 / 1, -1.0 / 2, 1.0 / 24, -1.0 / 720, 1.0 / 40320, -1.0 / 3628800,
                            1.0 / 479001600, -1.0 / 87178291200.0};

template <int N>
inline double horner(double t, const double (&c)[N]) {
  double p = c[N - 1];
  for (int j = N - 2; j >= 0; --j) p = p * t + c[j];
  return p;
}

inline double normal_at(uint64_t key, uint64_t e) {
  uint64_t z = key + (e + 1) * kGamma;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  z ^= z >> 31;
  // ln u1: a = (z >> 32) + 1 = m * 2^k with m in [1, 2) read off the float64 bits (exact).
  const double a = static_cast<double>((z >> 32) + 1);
  uint64_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  int64_t k = static_cast<int64_t>(bits >> 52) - 1023;
  const uint64_t mbits = (bits & ((1ULL << 52) - 1)) | (1023ULL << 52);
  double m;
  std::memcpy(&m, &mbits, sizeof(m));
  const bool big = m >= kSqrt2;
  m = big ? m * 0.5 : m;
  const double kf = static_cast<double>(k + (big ? 1 : 0) - 32);
  const double s = (m - 1.0) / (m + 1.0);
  const double ln_u1 = kf * kLn2 + s * horner(s * s, kLog);
  // cos(2 pi u2) = cos(q pi / 2 + x).
  const uint64_t q = (z >> 30) & 3;
  const double x = static_cast<double>(z & 0x3FFFFFFFULL) * kTwoM30 * kPiO2;
  const double x2 = x * x;
  const double sn = x * horner(x2, kSin), cs = horner(x2, kCos);
  double trig = (q & 1) ? sn : cs;
  trig = (q == 1 || q == 2) ? -trig : trig;
  return std::sqrt(ln_u1 * -2.0) * trig;
}

template <typename scalar_t>
void fill(scalar_t* out, uint64_t key, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
          int64_t global_cols, double stdev) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t base = static_cast<uint64_t>(row0 + r) * static_cast<uint64_t>(global_cols) +
                          static_cast<uint64_t>(col0);
    scalar_t* dst = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      dst[c] = static_cast<scalar_t>(normal_at(key, base + static_cast<uint64_t>(c)) * stdev);
    }
  }
}

void fill_normal(torch::Tensor out, int64_t key, int64_t row0, int64_t col0, int64_t global_cols,
                 double stdev) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous(),
              "fill_normal: out must be a contiguous 2-D CPU tensor");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "fill_normal", [&] {
    fill<scalar_t>(out.data_ptr<scalar_t>(), static_cast<uint64_t>(key), out.size(0), out.size(1), row0, col0,
                   global_cols, stdev);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fill_normal", &fill_normal, "counter-based normal fill of a block of a global matrix");
}
