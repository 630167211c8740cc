// 4-bit weights times 8-bit activations on the CPU: sluicegate::int4_q8_mm (see cpu_int4_q8.py).
//
// Weights: per output row, groups of 32 along K, two groups to 32 bytes: byte j of a pair holds code j of the
// first group in its low nibble and code j of the second in its high nibble; d and m hold per group the float32
// scale and minimum, w = d * code + m. Codes and d are stored by blocks of four rows (Problem::codes, ::scales). Activations: each row's group of 32 is quantized to int8 by its own absolute
// maximum (dx = max / 127); sx is the group's exact float sum, for the m term. A group's product is then
// d * dx * sum(code * xq) + m * sx, the integer sum exact. Every row is computed alone, in one fixed order,
// whatever the other rows: the result does not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowBlock = 4;  // output rows computed together: independent sums, one read of the activations

// Per-thread scratch for a call's quantized activations (no allocation per call: a decode step makes hundreds).
struct Scratch {
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// One group of 32 values: int8 codes by the group's own absolute maximum, its scale and exact sum.
void quantize_group(const float* vals, int8_t* dst, float* scale, float* sum) {
  float peak = 0.f, total = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) {
    peak = std::fmax(peak, std::fabs(vals[i]));
    total += vals[i];
  }
  const float d = peak / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  for (int64_t i = 0; i < kGroup; ++i) {
    dst[i] = static_cast<int8_t>(std::nearbyint(vals[i] * inv));
  }
  *scale = d;
  *sum = total;
}

// The same numbers with AVX2: the maximum is order-free and the sum keeps the scalar loop's order; vcvtps2dq rounds
// half to even, as nearbyint does in the default rounding mode.
__attribute__((target("avx2,fma"))) void quantize_group_avx2(const float* vals, int8_t* dst, float* scale,
                                                            float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 peak = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(vals + 8 * i);
    peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
  p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
  p4 = _mm_max_ss(p4, _mm_movehdup_ps(p4));
  float total = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) total += vals[i];
  const float d = _mm_cvtss_f32(p4) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // Narrow 32 int32 to int8 (values lie in -127..127, so the saturating packs are exact); the packs work within
  // 128-bit lanes, so the last permute puts the four 8-byte runs back in order.
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]);
  const __m256i w23 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i b = _mm256_packs_epi16(w01, w23);
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
  *scale = d;
  *sum = total;
}

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int8_t* xq, float* dx, float* sx, bool avx2) {
  const int64_t groups = k / kGroup;
  float vals[kGroup];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = x + r * k + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) vals[i] = static_cast<float>(src[i]);
      const int64_t at = r * groups + g;
      if (avx2) {
        quantize_group_avx2(vals, xq + r * k + g * kGroup, dx + at, sx + at);
      } else {
        quantize_group(vals, xq + r * k + g * kGroup, dx + at, sx + at);
      }
    }
  }
}

struct Problem {
  const uint8_t* q4;  // [N, K/2]
  const float* d;     // [N, G]
  const float* mn;    // [N, G]
  const int8_t* xq;   // [M, K]
  const float* dx;    // [M, G]
  const float* sx;    // [M, G]
  int64_t m, k, n, groups;
  float* out;         // [M, N]

  // Blocks of kRowBlock output rows stored together, in the order the loops read them (one stream each for the
  // codes and the scales, however many rows a block has): codes [N / 4][G / 2][4][32 bytes], d [N / 4][G / 2][4][2].
  const uint8_t* codes(int64_t row, int64_t g) const {
    return q4 + ((row / kRowBlock) * (groups / 2) + g / 2) * (kRowBlock * kGroup) + (row % kRowBlock) * kGroup;
  }
  const float* scales(int64_t row, int64_t g) const {
    return d + ((row / kRowBlock) * (groups / 2) + g / 2) * (kRowBlock * 2) + (row % kRowBlock) * 2;
  }
};

// The m term of one output: sum over groups of m[g] * sx[g]. Eight partial sums (lane i takes groups i, i + 8, ...)
// added pairwise at the end: the same order in every loop, so every path gives the same bits for it.
inline float min_term(const float* mn, const float* sx, int64_t groups) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    for (int i = 0; i < 8; ++i) part[i] = std::fma(mn[g + i], sx[g + i], part[i]);
  }
  for (int i = 0; g + i < groups; ++i) part[i] = std::fma(mn[g + i], sx[g + i], part[i]);
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

__attribute__((target("avx2,fma"))) inline float min_term_avx2(const float* mn, const float* sx, int64_t groups) {
  __m256 part = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) part = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(sx + g), part);
  if (g < groups) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(groups - g)), idx);
    part = _mm256_fmadd_ps(_mm256_maskload_ps(mn + g, mask), _mm256_maskload_ps(sx + g, mask), part);
  }
  // Lanes i and i + 4 first, then (0, 2) and (1, 3): the scalar loop's order.
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(part), _mm256_extractf128_ps(part, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [n0, n1) of the output for all activation rows; the reference every vector path must equal in value.
void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t row = n0; row < n1; ++row) {
    for (int64_t r = 0; r < p.m; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < p.groups; g += 2) {
        const uint8_t* pair = p.codes(row, g);
        const float* dr = p.scales(row, g);
        for (int64_t h = 0; h < 2; ++h) {
          int32_t dot = 0;
          const int8_t* xs = p.xq + r * p.k + (g + h) * kGroup;
          for (int64_t i = 0; i < kGroup; ++i) {
            const int32_t code = h == 0 ? (pair[i] & 0xF) : (pair[i] >> 4);
            dot += code * xs[i];
          }
          acc += static_cast<float>(dot) * (dr[h] * p.dx[r * p.groups + g + h]);
        }
      }
      p.out[r * p.n + row] = acc + min_term(p.mn + row * p.groups, p.sx + r * p.groups, p.groups);
    }
  }
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// AVX2: per group, vpmaddubsw (codes 0..15 times int8, pairs summed in int16: at most 3,810) then vpmaddwd by
// ones into 8 int32 sums, converted and scaled into a float accumulator per output. A block's four rows of codes are
// unpacked once per group pair for R activation rows at a time; every output still sums its groups in one order.
template <int R>
__attribute__((target("avx2,fma"))) void block_avx2(const Problem& p, int64_t base, int64_t r0) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][kRowBlock];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kRowBlock; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; g += 2) {
    __m256i lo[kRowBlock], hi[kRowBlock];
    float d0[kRowBlock], d1[kRowBlock];
    for (int j = 0; j < kRowBlock; ++j) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.codes(base + j, g)));
      lo[j] = _mm256_and_si256(packed, low);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      const float* dr = p.scales(base + j, g);
      d0[j] = dr[0];
      d1[j] = dr[1];
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = p.xq + (r0 + r) * p.k;
      const float* dxr = p.dx + (r0 + r) * p.groups;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + g * kGroup));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + (g + 1) * kGroup));
      for (int j = 0; j < kRowBlock; ++j) {
        const __m256 s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(lo[j], x0), ones));
        const __m256 s1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(hi[j], x1), ones));
        acc[r][j] = _mm256_fmadd_ps(s0, _mm256_set1_ps(d0[j] * dxr[g]), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(s1, _mm256_set1_ps(d1[j] * dxr[g + 1]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kRowBlock; ++j) {
      const int64_t row = base + j;
      p.out[(r0 + r) * p.n + row] =
          hsum256(acc[r][j]) + min_term_avx2(p.mn + row * p.groups, p.sx + (r0 + r) * p.groups, p.groups);
    }
  }
}

__attribute__((target("avx2,fma"))) void rows_avx2(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t base = n0; base < n1; base += kRowBlock) {
    int64_t r0 = 0;
    for (; r0 + 2 <= p.m; r0 += 2) block_avx2<2>(p, base, r0);
    if (r0 < p.m) block_avx2<1>(p, base, r0);
  }
}

// AVX-512 VNNI: a group pair's 64 codes in one register against 64 activations, one vpdpbusd; lanes 0-7 sum the
// first group, 8-15 the second, each scaled by its own d * dx. Up to four activation rows share a block's codes.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))) void block_vnni(const Problem& p,
                                                                                       int64_t base, int64_t r0) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R][kRowBlock];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kRowBlock; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; g += 2) {
    __m512i codes[kRowBlock];
    __m512 dv[kRowBlock];
    for (int j = 0; j < kRowBlock; ++j) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.codes(base + j, g)));
      const __m256i lo = _mm256_and_si256(packed, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      // Both groups' codes in one register, in the activations' own order.
      codes[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      // [d_g x 8, d_g+1 x 8] from the two scales side by side.
      dv[j] = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castsi128_ps(
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.scales(base + j, g))))));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xs = _mm512_loadu_si512(p.xq + (r0 + r) * p.k + g * kGroup);
      const __m512 dxv = _mm512_permutexvar_ps(
          halves, _mm512_castps128_ps512(_mm_castsi128_ps(
                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.dx + (r0 + r) * p.groups + g)))));
      for (int j = 0; j < kRowBlock; ++j) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[j], xs);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv[j], dxv), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kRowBlock; ++j) {
      const int64_t row = base + j;
      p.out[(r0 + r) * p.n + row] =
          _mm512_reduce_add_ps(acc[r][j]) + min_term_avx2(p.mn + row * p.groups, p.sx + (r0 + r) * p.groups, p.groups);
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))) void rows_vnni(const Problem& p, int64_t n0,
                                                                                      int64_t n1) {
  for (int64_t base = n0; base < n1; base += kRowBlock) {
    int64_t r0 = 0;
    for (; r0 + 4 <= p.m; r0 += 4) block_vnni<4>(p, base, r0);
    switch (p.m - r0) {
      case 3: block_vnni<3>(p, base, r0); break;
      case 2: block_vnni<2>(p, base, r0); break;
      case 1: block_vnni<1>(p, base, r0); break;
      default: break;
    }
  }
}

// isa: 0 scalar, 1 AVX2, 2 AVX-512 VNNI (the caller picks, from what torch dispatches to and the CPU has).
at::Tensor int4_q8_mm(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& d, const at::Tensor& mn,
                      int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && q4.dim() == 2 && d.dim() == 2 && mn.dim() == 2,
              "int4_q8_mm: x [M, K], q4 [N, K/2], d and m [N, K/32]");
  TORCH_CHECK(q4.scalar_type() == at::kByte && d.scalar_type() == at::kFloat && mn.scalar_type() == at::kFloat,
              "int4_q8_mm: uint8 q4, float32 d and m");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_q8_mm: float32 or bfloat16 x, got ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = q4.size(0), groups = k / kGroup;
  TORCH_CHECK(k % (2 * kGroup) == 0, "int4_q8_mm: K must be a multiple of 64, got ", k);
  TORCH_CHECK(n % kRowBlock == 0, "int4_q8_mm: N must be a multiple of ", kRowBlock, ", got ", n);
  TORCH_CHECK(q4.size(1) == k / 2 && d.size(0) == n && d.size(1) == groups && mn.sizes() == d.sizes(),
              "int4_q8_mm: shapes do not match K = ", k);
  TORCH_CHECK(q4.is_contiguous() && d.is_contiguous() && mn.is_contiguous(), "int4_q8_mm: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) {
    return out;
  }
  Scratch& s = scratch();
  s.xq.resize(m * k);
  s.dx.resize(m * groups);
  s.sx.resize(m * groups);
  if (xc.scalar_type() == at::kBFloat16) {
    quantize_rows(xc.data_ptr<at::BFloat16>(), m, k, s.xq.data(), s.dx.data(), s.sx.data(), isa > 0);
  } else {
    quantize_rows(xc.data_ptr<float>(), m, k, s.xq.data(), s.dx.data(), s.sx.data(), isa > 0);
  }
  const Problem p{q4.data_ptr<uint8_t>(), d.data_ptr<float>(), mn.data_ptr<float>(), s.xq.data(), s.dx.data(),
                  s.sx.data(), m, k, n, groups, out.data_ptr<float>()};
  // Output rows split among threads in whole row blocks; each row's sums are the same however they are split.
  at::parallel_for(0, (n + kRowBlock - 1) / kRowBlock, 8, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kRowBlock, n1 = std::min(n, b1 * kRowBlock);
    if (isa == 2) {
      rows_vnni(p, n0, n1);
    } else if (isa == 1) {
      rows_avx2(p, n0, n1);
    } else {
      rows_scalar(p, n0, n1);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(sluicegate_cpu, m) {
  m.def("int4_q8_mm(Tensor x, Tensor q4, Tensor d, Tensor m, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluicegate_cpu, CPU, m) {
  m.impl("int4_q8_mm", &int4_q8_mm);
}
