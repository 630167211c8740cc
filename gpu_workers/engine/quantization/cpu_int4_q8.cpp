// 4-bit weights times 8-bit activations on the CPU: sluicegate::int4_q8_mm (see cpu_int4_q8.py).
//
// Weights: groups of 32 along K, w = d * code + m per row and group, with m = z - 8 d from the bfloat16 scale d and
// zero z the layer keeps (half the bytes of float32 ones, a quarter of the codes' bytes, read every step). Rows are
// stored by blocks of 8, interleaved so that one 32-byte run holds 4 codes of each of the 8 rows (Problem::codes):
// the vector loops then keep the 8 rows in the lanes, and a group's scaling is one multiply-add for all 8, as in
// llama.cpp's repacked kernels. Activations: each row's group of 32 is quantized to int8 by its own absolute
// maximum (dx = max / 127); sx is the group's float sum, for the m term. A group's product is then
// d * dx * sum(code * xq) + m * sx, the integer sum exact. Every output is computed alone, in one fixed order,
// whatever the other rows and whichever loop (scalar, AVX2, VNNI): the same bits, independent of the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowBlock = 8;  // output rows interleaved and computed together, one per 32-bit lane

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
  const uint8_t* q4;  // [N / 8][G][4][8][4] bytes: see the header
  const uint16_t* d;  // [N / 8][G][8] bfloat16
  const uint16_t* z;  // [N / 8][G][8] bfloat16
  const int8_t* xq;   // [M, K]
  const float* dx;    // [M, G]
  const float* sx;    // [M, G]
  int64_t m, k, n, groups;
  float* out;         // [M, N]

  // One block's group: 4 runs of 32 bytes (run c: row j's bytes 4j..4j+3 hold its codes 4c..4c+3 of the group in
  // their low nibbles and 16+4c..16+4c+3 in their high ones); its 8 scales and 8 zeros.
  const uint8_t* codes(int64_t block, int64_t g) const { return q4 + (block * groups + g) * (kRowBlock * kGroup / 2); }
  const uint16_t* scales(int64_t block, int64_t g) const { return d + (block * groups + g) * kRowBlock; }
  const uint16_t* zeros(int64_t block, int64_t g) const { return z + (block * groups + g) * kRowBlock; }
};

inline float bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, 4);
  return v;
}

__attribute__((target("avx2,fma"))) inline __m256 bf16x8(const uint16_t* bits) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The value every loop computes for output (r, row): over the groups in order, acc = fma(dot, d * dx, acc) then
// acc = fma(m, sx, acc), where dot is the group's exact integer sum. The reference every vector loop equals in bits.
void rows_scalar(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t j = 0; j < kRowBlock; ++j) {
      for (int64_t r = 0; r < p.m; ++r) {
        const int8_t* xr = p.xq + r * p.k;
        float acc = 0.f;
        for (int64_t g = 0; g < p.groups; ++g) {
          const uint8_t* run = p.codes(b, g);
          const int8_t* xs = xr + g * kGroup;
          int32_t dot = 0;
          for (int64_t c = 0; c < 4; ++c) {
            for (int64_t t = 0; t < 4; ++t) {
              const uint8_t byte = run[c * 32 + j * 4 + t];
              dot += (byte & 0xF) * xs[4 * c + t] + (byte >> 4) * xs[16 + 4 * c + t];
            }
          }
          const float d = bf16(p.scales(b, g)[j]);
          const float mn = bf16(p.zeros(b, g)[j]) - 8.f * d;
          acc = std::fma(static_cast<float>(dot), d * p.dx[r * p.groups + g], acc);
          acc = std::fma(mn, p.sx[r * p.groups + g], acc);
        }
        p.out[r * p.n + b * kRowBlock + j] = acc;
      }
    }
  }
}

// 4 bytes of activations in every 32-bit lane.
__attribute__((target("avx2,fma"))) inline __m256i splat4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// The group's tail for R activation rows: integer dots (8 rows of weights in the lanes) scaled and added.
template <int R>
__attribute__((target("avx2,fma"))) inline void scale_into(const Problem& p, int64_t b, int64_t g, int64_t r0,
                                                          const __m256i (&dot)[R], __m256 (&acc)[R]) {
  const __m256 dv = bf16x8(p.scales(b, g));
  const __m256 mv = _mm256_sub_ps(bf16x8(p.zeros(b, g)), _mm256_mul_ps(_mm256_set1_ps(8.f), dv));
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * p.groups + g;
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dv, _mm256_set1_ps(p.dx[at])), acc[r]);
    acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(p.sx[at]), acc[r]);
  }
}

// One run of 32 bytes unpacked: the low nibbles (codes 4c..4c+3 of each row) and the high ones (16+4c..16+4c+3).
struct Run {
  __m256i lo, hi;
  __attribute__((target("avx2,fma"))) explicit Run(const uint8_t* bytes) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    lo = _mm256_and_si256(packed, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
  }
};

// AVX2: a run of 32 bytes holds 4 codes of each of the block's 8 rows; vpmaddubsw against the same 4 activations in
// every lane gives each row's pairs in int16 (codes 0..15 times -127..127: at most 3,810 a pair), and the group's
// 8 such products per row add up in int16 without overflow (at most 30,480) before one vpmaddwd widens them. The
// decoded codes serve R activation rows; the scaling is one multiply-add for the 8 rows together.
template <int R>
__attribute__((target("avx2,fma"))) void block_avx2(const Problem& p, int64_t b, int64_t r0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const Run run(p.codes(b, g) + 32 * c);
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = p.xq + (r0 + r) * p.k + g * kGroup + 4 * c;
        sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(run.lo, splat4(xs)));
        sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(run.hi, splat4(xs + 16)));
      }
    }
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_madd_epi16(sum[r], ones);
    scale_into<R>(p, b, g, r0, dot, acc);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(p.out + (r0 + r) * p.n + b * kRowBlock, acc[r]);
}

// AVX-512 VNNI on 256-bit registers: vpdpbusd sums each lane's 4 products straight into int32, the same integers
// (1.3x the AVX2 loop's speed from 4 activation rows on, the same at one).
template <int R>
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni"))) void block_vnni(const Problem& p, int64_t b,
                                                                                int64_t r0) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const Run run(p.codes(b, g) + 32 * c);
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = p.xq + (r0 + r) * p.k + g * kGroup + 4 * c;
        dot[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(dot[r], run.lo, splat4(xs)), run.hi, splat4(xs + 16));
      }
    }
    scale_into<R>(p, b, g, r0, dot, acc);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(p.out + (r0 + r) * p.n + b * kRowBlock, acc[r]);
}

// Blocks [b0, b1) for every activation row, up to four rows at a time sharing each run's decoded codes.
template <template <int> class Loop>
void rows_vector(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t r0 = 0;
    for (; r0 + 4 <= p.m; r0 += 4) Loop<4>::run(p, b, r0);
    switch (p.m - r0) {
      case 3: Loop<3>::run(p, b, r0); break;
      case 2: Loop<2>::run(p, b, r0); break;
      case 1: Loop<1>::run(p, b, r0); break;
      default: break;
    }
  }
}
template <int R>
struct Avx2 {
  static void run(const Problem& p, int64_t b, int64_t r0) { block_avx2<R>(p, b, r0); }
};
template <int R>
struct Vnni {
  static void run(const Problem& p, int64_t b, int64_t r0) { block_vnni<R>(p, b, r0); }
};

// isa: 0 scalar, 1 AVX2, 2 AVX-512 VNNI (the caller picks, from what torch dispatches to and the CPU has).
at::Tensor int4_q8_mm(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& d, const at::Tensor& z,
                      int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && q4.dim() == 2 && d.dim() == 2 && z.dim() == 2,
              "int4_q8_mm: x [M, K], q4 [N, K/2], d and z [N, K/32]");
  TORCH_CHECK(q4.scalar_type() == at::kByte && d.scalar_type() == at::kBFloat16 && z.scalar_type() == at::kBFloat16,
              "int4_q8_mm: uint8 q4, bfloat16 d and z");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_q8_mm: float32 or bfloat16 x, got ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = q4.size(0), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "int4_q8_mm: K must be a multiple of 32, got ", k);
  TORCH_CHECK(n % kRowBlock == 0, "int4_q8_mm: N must be a multiple of ", kRowBlock, ", got ", n);
  TORCH_CHECK(q4.size(1) == k / 2 && d.size(0) == n && d.size(1) == groups && z.sizes() == d.sizes(),
              "int4_q8_mm: shapes do not match K = ", k);
  TORCH_CHECK(q4.is_contiguous() && d.is_contiguous() && z.is_contiguous(), "int4_q8_mm: contiguous weights");
  TORCH_CHECK(isa >= 0 && isa <= 2, "int4_q8_mm: isa 0, 1 or 2, got ", isa);
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
  const Problem p{q4.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(z.data_ptr<at::BFloat16>()), s.xq.data(), s.dx.data(),
                  s.sx.data(), m, k, n, groups, out.data_ptr<float>()};
  // Row blocks split among threads; each output's sums are the same however they are split.
  at::parallel_for(0, n / kRowBlock, 4, [&](int64_t b0, int64_t b1) {
    if (isa == 2) {
      rows_vector<Vnni>(p, b0, b1);
    } else if (isa == 1) {
      rows_vector<Avx2>(p, b0, b1);
    } else {
      rows_scalar(p, b0, b1);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(sluicegate_cpu, m) {
  m.def("int4_q8_mm(Tensor x, Tensor q4, Tensor d, Tensor z, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluicegate_cpu, CPU, m) {
  m.impl("int4_q8_mm", &int4_q8_mm);
}
