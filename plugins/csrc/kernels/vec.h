// Vector helpers for one instruction set. Included once per ISA inside its own namespace
// (kiln::scalar, kiln::avx2, kiln::avx512) under a matching `#pragma GCC target`, so one
// translation unit carries every path and the dispatcher picks one at load time.
// Exactly one of KILN_ISA_AVX512 / KILN_ISA_AVX2 / KILN_ISA_SCALAR is defined by the includer.
// No includes here: the includer brings <immintrin.h>, <cmath> and c10's BFloat16 first.

using bf16 = c10::BFloat16;

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return static_cast<float>(x); }
inline void store_as(float* p, float x) { *p = x; }
inline void store_as(bf16* p, float x) { *p = bf16(x); }

// Quantized KV-cache elements (int8, fp8e4m3 from formats.h): the attention loops read them
// through the same to_f32 / vload as float and bf16 (the per-channel scales are applied outside
// the loops).
inline float to_f32(int8_t x) { return static_cast<float>(x); }
inline float to_f32(fp8e4m3 x) {  // exact; 0x7f / 0xff (NaN) are never written
  const int e = (x.bits >> 3) & 15, m = x.bits & 7;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return (x.bits & 0x80) ? -v : v;
}

constexpr float kFp8Max = 448.f;
inline float round_fp8(float x) {  // to the nearest E4M3 value, ties to even, saturating
  const float v = std::min(kFp8Max, std::max(-kFp8Max, x));
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t sign = bits & 0x80000000u, mag = bits & 0x7fffffffu;
  float r;
  if (mag < 0x3c800000u) {  // below 2^-6: subnormal E4M3, a multiple of 2^-9
    r = std::nearbyint(std::fabs(v) * 512.f) / 512.f;
  } else {  // keep 3 of the 23 mantissa bits, ties to even
    const uint32_t rounded = (mag + 0x7ffffu + ((mag >> 20) & 1u)) & 0xfff00000u;
    std::memcpy(&r, &rounded, 4);
  }
  uint32_t out;
  std::memcpy(&out, &r, 4);
  out |= sign;
  std::memcpy(&r, &out, 4);
  return r;
}
inline uint8_t fp8_bits(float x) {  // an E4M3 value (as round_fp8 returns) -> its bits
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint8_t sign = (b >> 24) & 0x80;
  const float a = std::fabs(x);
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));  // subnormal
  const int e = static_cast<int>(((b >> 23) & 0xff)) - 127 + 7;
  return sign | static_cast<uint8_t>(e << 3) | static_cast<uint8_t>((b >> 20) & 7);
}
inline void store_as(int8_t* p, float x) {  // x already divided by the scale
  *p = static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, x))));
}
inline void store_as(fp8e4m3* p, float x) { p->bits = fp8_bits(round_fp8(x)); }

// Software prefetch of a GEMV's weight stream. A decode step reads every weight once from
// memory; on the hosts measured, the hardware prefetchers alone left one thread streaming a
// GEMV's weights at about half the rate a plain `sum` reads memory (benchmarks/gemv_isa.py
// --cold). The drivers ask for the line g_prefetch_ahead bytes (library.cpp) past the ones they
// are about to read; 0 turns it off.
inline void prefetch_line(const void* p) {
#if !defined(KILN_ISA_SCALAR)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#endif
}
// every cache line of [p, p + bytes)
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_line(static_cast<const char*>(p) + i);
}
// The weight rows a row-layout GEMV streams (row o at base + o * row_bytes); ahead(o), called
// before row o is read, prefetches the lines g_prefetch_ahead bytes past row o's
struct WeightRows {
  const void* base;
  int64_t row_bytes;
  void ahead(int64_t o) const {
#if !defined(KILN_ISA_SCALAR)
    if (g_prefetch_ahead == 0) return;
    prefetch_bytes(static_cast<const char*>(base) + o * row_bytes + g_prefetch_ahead, row_bytes);
#endif
  }
};

// `count` elements from a 64-byte line boundary, zeroed. malloc aligns to 16 bytes, and then one
// 32-byte load in two from a buffer straddles two cache lines: dense rows against a weight row
// (dot4) ran 1.3-1.5x slower from such a buffer than from an aligned one (a scratch program, one
// process, 16 to 128 rows of SmolLM2's shapes).
template <typename V>
struct LineBuffer {
  std::vector<V> storage;
  V* data;
  explicit LineBuffer(int64_t count)
      : storage(count + 64 / sizeof(V)),
        data(reinterpret_cast<V*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~static_cast<uintptr_t>(63))) {}
};

// How a GEMV over many rows blocks its loops: `inputs` rows at a time (a multiple of 4 whose
// bytes fit in half of L1) against `weights` weight rows at a time (within 128 KB of L2), so each
// weight row is read from L2, not memory, for every block of inputs after the first, and each
// input block from L1 for every weight row.
struct RowBlocks {
  int64_t inputs, weights;
};
inline RowBlocks row_blocks(int64_t input_row_bytes, int64_t weight_row_bytes) {
  constexpr int64_t kInputBytes = 16 << 10, kWeightBytes = 128 << 10;
  return {std::max<int64_t>(4, kInputBytes / std::max<int64_t>(input_row_bytes, 1) / 4 * 4),
          std::max<int64_t>(16, kWeightBytes / std::max<int64_t>(weight_row_bytes, 1))};
}

#if defined(KILN_ISA_AVX512)
constexpr int kLanes = 16;
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vfloat vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// E4M3 -> fp32: the sign and the 7 exponent+mantissa bits placed as an fp16 (whose exponent
// bias is 8 more; subnormals land on fp16 subnormals, so it is exact), then * 2^8
// (sign-extended to 16 bits and shifted left by 7, the sign lands on bits 15 and 14 and the
// exponent and mantissa on 13..7: clearing bit 14 leaves the fp16)
inline __m512 fp8_to_f32(__m128i bytes) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16(-16512));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
inline vfloat vload(const fp8e4m3* p) { return fp8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 16 floats -> their int8 bytes, as store_as(int8_t*) makes them (saturated at +-127, rounded to
// nearest even by the default rounding mode, as std::nearbyint)
inline __m128i int8_bytes(__m512 x) {
  const __m512 v = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
}
// 16 floats -> their E4M3 bytes, as store_as(fp8e4m3*) makes them: saturated at +-448; from
// 2^-6 up, 3 mantissa bits kept (ties to even) and the exponent rebiased from 127 to 7; below,
// a multiple of 2^-9 rounded to nearest even (8 of them is 2^-6, the same byte either way)
inline __m128i fp8_bytes(__m512 x) {
  const __m512 v = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-kFp8Max)), _mm512_set1_ps(kFp8Max));
  const __m512i bits = _mm512_castps_si512(v), magnitude_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i mag = _mm512_and_si512(bits, magnitude_mask);
  const __m512i sign = _mm512_srli_epi32(_mm512_andnot_si512(magnitude_mask, bits), 24);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(0x7ffff)), lsb);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
  const __m512i subnormal = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(512.f)));
  const __mmask16 small = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(0x3c800000));  // below 2^-6
  return _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_mask_blend_epi32(small, normal, subnormal), sign));
}
// 16 floats that bf16 holds exactly (int8 and E4M3 values) -> their bf16s: each float's top half
inline __m256i exact_bf16(__m512 x) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vfnmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline float vsum(vfloat a) { return _mm512_reduce_add_ps(a); }
inline void vstore(float* p, vfloat a) { _mm512_storeu_ps(p, a); }
// 16 floats that T holds exactly, stored as T
inline void vstore_exact(float* p, vfloat a) { vstore(p, a); }
inline void vstore_exact(bf16* p, vfloat a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), exact_bf16(a)); }

#elif defined(KILN_ISA_AVX2)
constexpr int kLanes = 8;
using vfloat = __m256;
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const bf16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vfloat vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vfloat vload(const fp8e4m3* p) {  // as the AVX-512 version, 8 at a time
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(-16512));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vfnmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline float vsum(vfloat a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void vstore(float* p, vfloat a) { _mm256_storeu_ps(p, a); }

// 8 int32 lanes (each within int8, saturated otherwise) -> 8 bytes (the low half of the result)
inline __m128i pack8_i8(__m256i v) {
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  return _mm_packs_epi16(w16, w16);
}
inline void store8_i8(int8_t* p, __m256i v) { _mm_storel_epi64(reinterpret_cast<__m128i*>(p), pack8_i8(v)); }
inline int32_t sum8_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
// 8 floats that bf16 holds exactly -> their bf16s (each float's top half)
inline __m128i exact_bf16x8(__m256 x) {
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}
// 8 floats that T holds exactly, stored as T
inline void vstore_exact(float* p, vfloat a) { vstore(p, a); }
inline void vstore_exact(bf16* p, vfloat a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), exact_bf16x8(a)); }
// 8 floats -> their E4M3 bytes (the low 8 bytes), as fp8_bytes on AVX-512
inline __m128i fp8_bytes8(__m256 x) {
  const __m256 v = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-kFp8Max)), _mm256_set1_ps(kFp8Max));
  const __m256i bits = _mm256_castps_si256(v), magnitude_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i mag = _mm256_and_si256(bits, magnitude_mask);
  const __m256i sign = _mm256_srli_epi32(_mm256_andnot_si256(magnitude_mask, bits), 24);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(0x7ffff)), lsb);
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(120 << 3));
  const __m256i subnormal = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(512.f)));
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), mag);  // below 2^-6
  const __m256i value = _mm256_or_si256(_mm256_blendv_epi8(normal, subnormal, small), sign);
  const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(value), _mm256_extracti128_si256(value, 1));
  return _mm_packus_epi16(w16, w16);
}
#else
constexpr int kLanes = 0;  // scalar reference path: plain loops
#endif

#if !defined(KILN_ISA_SCALAR)
// exp(x) (Cephes' expf): x = n ln2 + r with |r| <= ln2 / 2 and n = round(x / ln2), ln2 in two
// parts; e^r by a degree-7 polynomial, then times 2^n (per ISA below). SwiGLU through it stays
// within 4e-7 relative of float64 (tests/plugins/test_dense_ops.py), as through std::exp.
inline vfloat exp_of_remainder(vfloat x, vfloat n) {  // e^r
  vfloat r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  vfloat p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  return vfma(p, vmul(r, r), vadd(r, vset1(1.f)));
}
#endif

#if defined(KILN_ISA_AVX512)
// 16 lanes; 2^n by vscalefps, 0 below the float range
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_of_remainder(x, n), n);
}
inline vfloat vexp(vfloat x) { return exp16(x); }
#elif defined(KILN_ISA_AVX2)
// 8 lanes; 2^n (n in [-151, 128]) as two exact powers of two, each built in the exponent bits
// (AVX2 has no vscalefps), so results below 2^-126 come out subnormal as scalef makes them
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.f)), _mm256_set1_ps(88.8f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  auto pow2 = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(exp_of_remainder(x, n), pow2(n1)), pow2(n2));
}
inline vfloat vexp(vfloat x) { return exp8(x); }
#endif

// sum_i a[i] * b[i]
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if !defined(KILN_ISA_SCALAR)
  vfloat acc0 = vzero(), acc1 = vzero();
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    acc0 = vfma(vload(a + i), vload(b + i), acc0);
    acc1 = vfma(vload(a + i + kLanes), vload(b + i + kLanes), acc1);
  }
  for (; i + kLanes <= n; i += kLanes) acc0 = vfma(vload(a + i), vload(b + i), acc0);
  total = vsum(acc0) + vsum(acc1);
#endif
  for (; i < n; ++i) total += to_f32(a[i]) * to_f32(b[i]);
  return total;
}

// acc[i] += alpha * x[i]
template <typename X>
inline void axpy(float* acc, float alpha, const X* x, int64_t n) {
  int64_t i = 0;
#if !defined(KILN_ISA_SCALAR)
  vfloat va = vset1(alpha);
  for (; i + kLanes <= n; i += kLanes) vstore(acc + i, vfma(va, vload(x + i), vload(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += alpha * to_f32(x[i]);
}

// acc[i] *= alpha
inline void scale_inplace(float* acc, float alpha, int64_t n) {
  int64_t i = 0;
#if !defined(KILN_ISA_SCALAR)
  vfloat va = vset1(alpha);
  for (; i + kLanes <= n; i += kLanes) vstore(acc + i, vmul(va, vload(acc + i)));
#endif
  for (; i < n; ++i) acc[i] *= alpha;
}

// dst[i] <- x[i] * scale[i] as a quantized KV-cache element (store_as), n of them
template <typename P, typename X>
inline void store_scaled(P* dst, const X* x, const float* scale, int64_t n) {
  int64_t i = 0;
#if defined(KILN_ISA_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(vload(x + i), _mm512_loadu_ps(scale + i));
    __m128i bytes;
    if constexpr (std::is_same_v<P, int8_t>)
      bytes = int8_bytes(v);
    else
      bytes = fp8_bytes(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bytes);
  }
#elif defined(KILN_ISA_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(vload(x + i), _mm256_loadu_ps(scale + i));
    __m128i bytes;
    if constexpr (std::is_same_v<P, int8_t>) {
      bytes = pack8_i8(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f))));
    } else {
      bytes = fp8_bytes8(v);
    }
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), bytes);
  }
#endif
  for (; i < n; ++i) store_as(dst + i, to_f32(x[i]) * scale[i]);
}

// dst[i] <- src[i] for KV-cache elements bf16 holds exactly (int8, E4M3, bf16)
template <typename P>
inline void widen_to_bf16(bf16* dst, const P* src, int64_t n) {
  int64_t i = 0;
#if !defined(KILN_ISA_SCALAR)
  for (; i + kLanes <= n; i += kLanes) vstore_exact(dst + i, vload(src + i));
#endif
  for (; i < n; ++i) dst[i] = bf16(to_f32(src[i]));
}

// x rounded to T and back: the rounding a PyTorch op on T tensors applies to its result.
template <typename T>
inline float round_as(float x) {
  return to_f32(static_cast<T>(x));
}
template <>
inline float round_as<float>(float x) {
  return x;
}

#if !defined(KILN_ISA_SCALAR)
#if defined(KILN_ISA_AVX512BF16)
// Lanes vcvtneps2bf16 cannot round as c10::BFloat16 does: it takes denormal inputs as zero, and
// makes a NaN of its own. A vector without them (all but rare ones) takes the instruction.
inline bool bf16_convertible(__m512 x) { return _mm512_fpclass_ps_mask(x, 0x20 | 0x01 | 0x80) == 0; }
#endif

// round_as, kLanes at a time: x rounded to bf16 and back, as c10::BFloat16(float) rounds (to nearest, ties
// to even; NaN stays NaN)
inline vfloat round_bf16(vfloat x) {
#if defined(KILN_ISA_AVX512BF16)
  if (bf16_convertible(x))
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
#endif
#if defined(KILN_ISA_AVX512)
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  const __m512 rounded = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_add_epi32(bits, bias), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, x);
#else
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  const __m256 rounded = _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_add_epi32(bits, bias), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  return _mm256_blendv_ps(rounded, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
#endif
}
template <typename T>
inline vfloat vround_as(vfloat x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return round_bf16(x);
}

// store_as, kLanes at a time: x rounded to T and stored (a NaN as c10::BFloat16(float) makes it, 0x7fc0)
inline void vstore_as(float* p, vfloat x) { vstore(p, x); }
inline void vstore_as(bf16* p, vfloat x) {
#if defined(KILN_ISA_AVX512BF16)
  if (bf16_convertible(x))
    return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#endif
  const vfloat nan = vset1(std::numeric_limits<float>::quiet_NaN());  // 0x7fc00000
#if defined(KILN_ISA_AVX512)
  vstore_exact(p, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), round_bf16(x), nan));
#else
  vstore_exact(p, _mm256_blendv_ps(round_bf16(x), nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
#endif
}
#endif

// dst[i] = x[i] * s rounded to T, as store_as rounds it (kLanes at a time: the same bits)
template <typename T>
inline void store_times_as(T* dst, const float* x, float s, int64_t n) {
  int64_t i = 0;
#if !defined(KILN_ISA_SCALAR)
  const vfloat vs = vset1(s);
  for (; i + kLanes <= n; i += kLanes) vstore_as(dst + i, vmul(vload(x + i), vs));
#endif
  for (; i < n; ++i) store_as(dst + i, x[i] * s);
}

// A tile's 16 outputs of one row: out[j] = sums[j] + bias[j] (+ 0 without a bias), each rounded
// to T as store_as rounds it (a vector at a time: the scalar loop's conversions to bf16 took as
// long as the AMX kernels' multiplies)
template <typename T>
inline void store_row16(T* out, const float* sums, const T* bias) {
#if !defined(KILN_ISA_SCALAR)
  for (int j = 0; j < 16; j += kLanes) vstore_as(out + j, vadd(vload(sums + j), bias ? vload(bias + j) : vzero()));
#else
  for (int j = 0; j < 16; ++j) store_as(out + j, sums[j] + (bias ? to_f32(bias[j]) : 0.f));
#endif
}

#if defined(KILN_ISA_AVX512)
// store_row16 from registers (the AMX kernels' rows): the 16 sums + bias16, bias16 being
// bias16_of's outputs [o0, o0 + 16) of the bias, or zeros without one
template <typename T>
inline __m512 bias16_of(const T* bias, int64_t o0) {
  return bias ? vload(bias + o0) : vzero();
}
template <typename T>
inline void store_row16(T* out, __m512 sums, __m512 bias16) {
  vstore_as(out, vadd(sums, bias16));
}
#endif

// out[r] = sum_i x[r][i] * w[i] for four rows at once: w is loaded (and widened) once. Each row
// is summed as dot() sums it (two chains over pairs of vectors, a last vector into the first,
// then the tail), so a row gets the same bits in a group of four as alone.
template <typename B>
inline void dot4(const float* x0, const float* x1, const float* x2, const float* x3, const B* w,
                 int64_t n, float* out) {
  const float* x[4] = {x0, x1, x2, x3};
  int64_t i = 0;
  float t[4] = {0.f, 0.f, 0.f, 0.f};
#if !defined(KILN_ISA_SCALAR)
  vfloat a[4], b[4];
  for (int r = 0; r < 4; ++r) a[r] = b[r] = vzero();
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    const vfloat w0 = vload(w + i), w1 = vload(w + i + kLanes);
    for (int r = 0; r < 4; ++r) {
      a[r] = vfma(vload(x[r] + i), w0, a[r]);
      b[r] = vfma(vload(x[r] + i + kLanes), w1, b[r]);
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat w0 = vload(w + i);
    for (int r = 0; r < 4; ++r) a[r] = vfma(vload(x[r] + i), w0, a[r]);
  }
  for (int r = 0; r < 4; ++r) t[r] = vsum(a[r]) + vsum(b[r]);
#endif
  for (; i < n; ++i) {
    const float wi = to_f32(w[i]);
    for (int r = 0; r < 4; ++r) t[r] += x[r][i] * wi;
  }
  for (int r = 0; r < 4; ++r) out[r] = t[r];
}
