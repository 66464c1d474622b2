// Register-tiled products with one short side, shared by the RMT's read (matrix_rmsnorm_cpu.cpp)
// and write (matrix_write_cpu.cpp) kernels, float32, with Dk (the key width) 16 or 32, every RMT
// config's. With a[h, j] = a[h*sh + j*sj] (a strided [n, m] operand, n = the number of keys:
// 3 to 36):
//
//   rows_by_keys   out[j, k] = sum_h a[h, j] b[h, k]     b [n, Dk]   (the write; the read's dy)
//   keys_by_rows   out[h, k] = sum_j a[h, j] y[j, k]     y [m, Dk]   (the read's and the write's dkeys)
//
// Written by hand because these GEMMs have a reduction or output side of only n or Dk, shapes for
// which MKL's sgemm ran at a fraction of its speed on larger ones (docs/benchmarks.md): register
// tiles of 64 / Dk rows (or keys) by Dk lanes, 8 accumulators of 8 floats, vectorized with GCC's
// vector extension (AVX registers, or pairs of SSE ones). Each sum runs in a fixed order (h,
// respectively j, ascending), so results do not depend on the thread count. The plain
// references are the same products through at::mm / F.linear.
#pragma once

#include <cstdint>
#include <cstring>

namespace rmt_cpu {

typedef float v8 __attribute__((vector_size(32)));
inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// out rows [j, j + J): J x Dk/8 accumulators, one pass over b.
template <int DK, int J>
inline void rows_by_keys_tile(const float* a, int64_t sh, int64_t sj, const float* b, float* out, int64_t n,
                              int64_t j) {
  constexpr int NV = DK / 8;
  v8 acc[J][NV] = {};
  for (int64_t h = 0; h < n; ++h) {
    v8 bv[NV];
    for (int q = 0; q < NV; ++q) bv[q] = load8(b + h * DK + 8 * q);
    for (int jj = 0; jj < J; ++jj) {
      const float s = a[h * sh + (j + jj) * sj];
      for (int q = 0; q < NV; ++q) acc[jj][q] += s * bv[q];
    }
  }
  for (int jj = 0; jj < J; ++jj)
    for (int q = 0; q < NV; ++q) store8(out + (j + jj) * DK + 8 * q, acc[jj][q]);
}

// out rows [h, h + H): H x Dk/8 accumulators, one pass over y.
template <int DK, int H>
inline void keys_by_rows_tile(const float* a, int64_t sh, int64_t sj, const float* y, float* out, int64_t m,
                              int64_t h) {
  constexpr int NV = DK / 8;
  v8 acc[H][NV] = {};
  for (int64_t j = 0; j < m; ++j) {
    v8 yv[NV];
    for (int q = 0; q < NV; ++q) yv[q] = load8(y + j * DK + 8 * q);
    for (int hh = 0; hh < H; ++hh) {
      const float s = a[(h + hh) * sh + j * sj];
      for (int q = 0; q < NV; ++q) acc[hh][q] += s * yv[q];
    }
  }
  for (int hh = 0; hh < H; ++hh)
    for (int q = 0; q < NV; ++q) store8(out + (h + hh) * DK + 8 * q, acc[hh][q]);
}

template <int DK>
void rows_by_keys(const float* a, int64_t sh, int64_t sj, const float* b, float* out, int64_t n, int64_t m) {
  constexpr int J = 64 / DK;
  int64_t j = 0;
  for (; j + J <= m; j += J) rows_by_keys_tile<DK, J>(a, sh, sj, b, out, n, j);
  for (; j < m; ++j) rows_by_keys_tile<DK, 1>(a, sh, sj, b, out, n, j);
}

template <int DK>
void keys_by_rows(const float* a, int64_t sh, int64_t sj, const float* y, float* out, int64_t n, int64_t m) {
  constexpr int H = 64 / DK;
  int64_t h = 0;
  for (; h + H <= n; h += H) keys_by_rows_tile<DK, H>(a, sh, sj, y, out, m, h);
  for (; h < n; ++h) keys_by_rows_tile<DK, 1>(a, sh, sj, y, out, m, h);
}

// rows_by_keys / keys_by_rows for a runtime Dk of 16 or 32 (the caller checks tiled_width).
inline bool tiled_width(int64_t dk) { return dk == 16 || dk == 32; }

inline void rows_by_keys(int64_t dk, const float* a, int64_t sh, int64_t sj, const float* b, float* out, int64_t n,
                         int64_t m) {
  if (dk == 16)
    rows_by_keys<16>(a, sh, sj, b, out, n, m);
  else
    rows_by_keys<32>(a, sh, sj, b, out, n, m);
}

inline void keys_by_rows(int64_t dk, const float* a, int64_t sh, int64_t sj, const float* y, float* out, int64_t n,
                         int64_t m) {
  if (dk == 16)
    keys_by_rows<16>(a, sh, sj, y, out, n, m);
  else
    keys_by_rows<32>(a, sh, sj, y, out, n, m);
}

}  // namespace rmt_cpu
