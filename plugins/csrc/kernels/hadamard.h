// The key transform of a quantized KV cache: x <- H x for H the orthonormal Walsh-Hadamard
// matrix of a power-of-two block, applied to q and k after rotary embedding (attention.h), so
// that q . k is unchanged while the cache stores Hk (plugins/formats.py explains why; its
// hadamard_transform is the reference, the same butterflies in the same order).
// Included per ISA inside kiln::<isa> after vec.h.

#if defined(KILN_ISA_AVX512)
// One block of 16 V floats transformed in registers. Within a vector, the partner lane comes by
// a permute and one FMA with +-1 makes a + b (lanes without bit h) or a - b (lanes with it):
// the product by +-1 is exact, so the sums are rounded as the scalar passes round them.
template <int V>
inline void hadamard_registers(float* x) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 v[V];
  for (int i = 0; i < V; ++i) v[i] = _mm512_loadu_ps(x + 16 * i);
  for (int h = 1; h < 16; h *= 2) {
    const __m512i partner = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
    const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));
    const __m512 sign = _mm512_mask_blend_ps(upper, _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f));
    for (int i = 0; i < V; ++i) v[i] = _mm512_fmadd_ps(v[i], sign, _mm512_permutexvar_ps(partner, v[i]));
  }
  for (int h = 1; h < V; h *= 2)  // whole vectors
    for (int i = 0; i < V; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const __m512 a = v[j], b = v[j + h];
        v[j] = _mm512_add_ps(a, b);
        v[j + h] = _mm512_sub_ps(a, b);
      }
  const __m512 norm = _mm512_set1_ps(1.f / std::sqrt(16.f * V));
  for (int i = 0; i < V; ++i) _mm512_storeu_ps(x + 16 * i, _mm512_mul_ps(v[i], norm));
}
#endif

// x <- H x in place, H the orthonormal Walsh-Hadamard matrix of size `block` on each block of
// x (Sylvester order: H[i][j] = (-1)^popcount(i & j) / sqrt(block)); block divides n. Each
// butterfly pass turns (a, b) = (x[j], x[j + h]) into (a + b, a - b).
inline void hadamard_inplace(float* x, int64_t n, int64_t block) {
#if defined(KILN_ISA_AVX512)
  switch (block) {
    case 16: for (int64_t i = 0; i < n; i += 16) hadamard_registers<1>(x + i); return;
    case 32: for (int64_t i = 0; i < n; i += 32) hadamard_registers<2>(x + i); return;
    case 64: for (int64_t i = 0; i < n; i += 64) hadamard_registers<4>(x + i); return;
    case 128: for (int64_t i = 0; i < n; i += 128) hadamard_registers<8>(x + i); return;
  }
#endif
  for (int64_t h = 1; h < block; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = 1.f / std::sqrt(static_cast<float>(block));
  for (int64_t d = 0; d < n; ++d) x[d] *= norm;
}
