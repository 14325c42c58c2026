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
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline float vsum(vfloat a) { return _mm512_reduce_add_ps(a); }
inline void vstore(float* p, vfloat a) { _mm512_storeu_ps(p, a); }
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
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline float vsum(vfloat a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void vstore(float* p, vfloat a) { _mm256_storeu_ps(p, a); }
#else
constexpr int kLanes = 0;  // scalar reference path: plain loops
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

// x rounded to T and back: the rounding a PyTorch op on T tensors applies to its result.
template <typename T>
inline float round_as(float x) {
  return to_f32(static_cast<T>(x));
}
template <>
inline float round_as<float>(float x) {
  return x;
}

// out[r] = sum_i x[r][i] * w[i] for four rows at once: w is loaded (and widened) once.
template <typename B>
inline void dot4(const float* x0, const float* x1, const float* x2, const float* x3, const B* w,
                 int64_t n, float* out) {
  int64_t i = 0;
  float t0 = 0.f, t1 = 0.f, t2 = 0.f, t3 = 0.f;
#if !defined(KILN_ISA_SCALAR)
  vfloat a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat wv = vload(w + i);
    a0 = vfma(vload(x0 + i), wv, a0);
    a1 = vfma(vload(x1 + i), wv, a1);
    a2 = vfma(vload(x2 + i), wv, a2);
    a3 = vfma(vload(x3 + i), wv, a3);
  }
  t0 = vsum(a0), t1 = vsum(a1), t2 = vsum(a2), t3 = vsum(a3);
#endif
  for (; i < n; ++i) {
    const float wi = to_f32(w[i]);
    t0 += x0[i] * wi, t1 += x1[i] * wi, t2 += x2[i] * wi, t3 += x3[i] * wi;
  }
  out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
}
