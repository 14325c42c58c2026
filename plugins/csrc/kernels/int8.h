// int8 weights, one scale per output channel, float / bf16 activations (W8A16), in the row
// layout the engine stores ([out, in] int8). Included per ISA inside kiln::<isa> after gemv.h.
//
//   linear_w8_float   inputs widened to fp32, weights widened per vector, FMAs (scalar)
//   linear_w8_i16     inputs quantized to int16, weights widened to int16, vpdpwssd /
//                     vpmaddwd: one instruction per 32 (AVX-512) or 16 (AVX2) weights and row;
//                     on AVX2 from 15 rows, lanes_w8: the rows in the vector lanes (lanes.h)
//   linear_w8_vnni    AVX512-VNNI, rows of kVnniBytesMinK inputs or more: inputs as two int8
//                     planes, the weights as bytes with vpdpbusd (64 multiply-adds a step)
// The decode path on AVX-512 is the tiled layout (int8_tiled.h); select.h chooses.

template <typename T>
void linear_w8_float(const T* x, const int8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                     int64_t k, int64_t n) {
  gemv_float_rows({w, k}, x, bias, out, rows, k, n, [&](auto R, const float* xr, int64_t o, float* sums) {
    dot_rows_bytes<decltype(R)::value>(xr, k, w + o * k, sums);
    for (int r = 0; r < R; ++r) sums[r] *= scale[o];
  });
}

#if defined(KILN_ISA_AVX2)
// The inputs have 15 bits (kExactQmax), so the int32 sums of kFlush inputs are exact
// (1,024 * 16,383 * 128 < 2^31); they add up exactly (int64, or double below 2^53) and a dot
// product goes to float once, at its end: the same float however its products were split
// among lanes, so the one-row kernel (a sum across lanes) and the lanes kernel (a sum per
// lane) agree bit for bit.
constexpr int64_t kFlush = 1024;
constexpr float kExactQmax = 16383.f;

// R input rows (int16, padded to kp with zeros) against one int8 weight row: vpmaddwd on 16
// weights widened to int16; C independent chains per row (one chain is latency-bound). The same
// on AVX-VNNI: vpdpwssd would put its latency on the accumulator chain (measured 2-3% slower)
template <int R>
inline void dot_rows_w8_i16(const int16_t* xq, int64_t kp, const int8_t* w, int64_t k, float* sums) {
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t total[R] = {};
  const int64_t full = k / 16 * 16;
  for (int64_t b0 = 0; b0 < k; b0 += kFlush) {
    const int64_t b1 = std::min(k, b0 + kFlush);
    __m256i acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_si256();
    int64_t i = b0;
    for (; i + 16 * C <= std::min(b1, full); i += 16 * C)
      for (int c = 0; c < C; ++c) {
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16 * c)));
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm256_add_epi32(
              acc[r][c], _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * kp + i + 16 * c)), wv));
      }
    for (; i + 16 <= std::min(b1, full); i += 16) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
      for (int r = 0; r < R; ++r)
        acc[r][0] = _mm256_add_epi32(
            acc[r][0], _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * kp + i)), wv));
    }
    int32_t tail[R] = {};
    for (; i < b1; ++i)  // the row's last k % 16 weights
      for (int r = 0; r < R; ++r) tail[r] += static_cast<int32_t>(xq[r * kp + i]) * w[i];
    for (int r = 0; r < R; ++r) {
      __m256i lanes = acc[r][0];
      for (int c = 1; c < C; ++c) lanes = _mm256_add_epi32(lanes, acc[r][c]);
      total[r] += sum8_i32(lanes) + tail[r];
    }
  }
  // (a standalone comparison of the ways to reduce, 1 and 4 rows, k 576 and 1,536, one
  // process: this one within 3% of summing the lanes in float, the rows' totals side by side
  // with vphaddd 4-20% slower)
  for (int r = 0; r < R; ++r) sums[r] = static_cast<float>(total[r]);
}

// int8 weights at many rows: the rows in the vector lanes (lanes.h), W8A16 here and W8A8 on
// plain AVX2 (w8a8.h). A tile of kLaneOutputs outputs goes a pass of kLanePass input pairs at a
// time: the pass's weights widened to int16 once (8 KB, kept in L1) serve every chunk of rows;
// each kFlush inputs' int32 sums add up in double (exact), and W8A16's totals go to float once,
// as dot_rows_w8_i16's do, scaled as tiles_i16 scales them: every row has the bits it gets alone.
constexpr int64_t kLaneOutputs = 16;  // outputs a tile holds
constexpr int64_t kLanePass = 128;    // pairs a pass covers: a chunk's X 8 KB, the tile's weights 8 KB

// Wp [kLaneOutputs][kLanePass pairs] dwords: outputs [0, on) of the int8 rows w (k inputs each),
// inputs [i0, i0 + 2 * kLanePass) widened to int16, zero past k and past on. The same inputs of
// the next tile's first next_on rows are requested ahead: read a pass at a time, a tile's rows
// defeat the hardware prefetchers (an int8 output projection at 16 rows waited on them a quarter
// of its time, Zen 3)
inline void lanes_w8_weights(const int8_t* w, int64_t k, int64_t on, int64_t i0, int16_t* Wp, int64_t next_on) {
  constexpr int64_t width = 2 * kLanePass;
  std::fill(Wp + on * width, Wp + kLaneOutputs * width, int16_t{0});
  const int64_t i1 = std::min(k, i0 + width);
  for (int64_t o = 0; o < on; ++o) {
    const int8_t* wr = w + o * k;
    if (o < next_on) prefetch_bytes(wr + kLaneOutputs * k + i0, i1 - i0);
    int16_t* dst = Wp + o * width - i0;
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i))));
    for (; i < i1; ++i) dst[i] = wr[i];
    for (; i < i0 + width; ++i) dst[i] = 0;
  }
}

// One pass (count pairs from the chunks' pair p0) of every chunk of rows against a tile's
// widened weights Wp (outputs [0, on)): each (chunk, output, row)'s sums added into flush
// [chunk][output][row]
inline void lanes_w8_pass(const int32_t* X, int64_t pairs, int64_t chunks, int64_t p0, int64_t count,
                          const int16_t* Wp, int64_t on, int32_t* flush) {
  alignas(32) int32_t sums[4 * kLaneRows];
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t q = 0; q < on; q += 4) {
      lanes_four_outputs<kLanePass, 1>(X + (c * pairs + p0) * kLaneRows,
                                       reinterpret_cast<const int32_t*>(Wp) + q * kLanePass, count, sums);
      int32_t* f = flush + (c * kLaneOutputs + q) * kLaneRows;
      for (int64_t j = 0; j < 4 * kLaneRows; j += 8)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(f + j),
                            _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + j)),
                                             _mm256_load_si256(reinterpret_cast<const __m256i*>(sums + j))));
    }
}

// exact[i] += flush[i] (exactly: doubles holding integers below 2^53), flush[i] = 0
inline void lanes_w8_flush(int32_t* flush, double* exact, int64_t count) {
  for (int64_t j = 0; j < count; j += 4) {
    __m128i* f = reinterpret_cast<__m128i*>(flush + j);
    _mm256_storeu_pd(exact + j, _mm256_add_pd(_mm256_loadu_pd(exact + j), _mm256_cvtepi32_pd(_mm_loadu_si128(f))));
    _mm_storeu_si128(f, _mm_setzero_si128());
  }
}

// store(exact, o0, on): a tile's exact dot products, exact [chunk][kLaneOutputs][kLaneRows]
// (doubles holding integers) for outputs [o0, o0 + on) and the rows of int16 inputs xq
// [rows][kp] against the int8 weights w [n][k]
template <typename Store>
void lanes_w8(const int16_t* xq, int64_t kp, const int8_t* w, int64_t rows, int64_t k, int64_t n, Store store) {
  static_assert(kFlush % (2 * kLanePass) == 0, "a pass within one flush");
  const int64_t pairs = kp / 2, chunks = (rows + kLaneRows - 1) / kLaneRows, tile = kLaneOutputs * kLaneRows;
  const LineBuffer<int32_t> X(chunks * pairs * kLaneRows);
  lanes_inputs_i16(xq, rows, kp, X.data);
  parallel_for(0, (n + kLaneOutputs - 1) / kLaneOutputs, 1, [&](int64_t begin, int64_t end) {
    alignas(32) int16_t Wp[kLaneOutputs * 2 * kLanePass];
    // [chunk][output][row]: the current kFlush inputs' sums (zero between tiles: a tile's last pass flushes)
    std::vector<int32_t> flush(chunks * tile);
    std::vector<double> exact(chunks * tile);  // [chunk][output][row]: the sums so far
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = kLaneOutputs * t, on = std::min(kLaneOutputs, n - o0);
      std::fill(exact.begin(), exact.end(), 0.0);
      for (int64_t p0 = 0; p0 < pairs; p0 += kLanePass) {
        const int64_t count = std::min(kLanePass, pairs - p0);
        lanes_w8_weights(w + o0 * k, k, on, 2 * p0, Wp, t + 1 < end ? std::min(kLaneOutputs, n - o0 - on) : 0);
        lanes_w8_pass(X.data, pairs, chunks, p0, count, Wp, on, flush.data());
        if ((p0 + count) % (kFlush / 2) == 0 || p0 + count == pairs)
          lanes_w8_flush(flush.data(), exact.data(), chunks * tile);
      }
      store(static_cast<const double*>(exact.data()), o0, on);
    }
  });
}

// The outputs of one lanes tile (W8A16's, and W8A8's: store_w8a8 computes the same):
// out [m, o0 + o] = float(exact) * xs[m] * scale[o] + bias for rows [0, rows), as store_as rounds
// it (the bits of the scalar expression), 8 outputs of a row a store (an 8 x 8 transposition)
// and the tile's last on % 8 outputs one by one
template <typename T>
void lanes_w8_store(const double* exact, const float* xs, const float* scale, const T* bias, T* out, int64_t rows,
                    int64_t n, int64_t o0, int64_t on) {
  const int64_t tile = kLaneOutputs * kLaneRows;
  for (int64_t m0 = 0; m0 < rows; m0 += 8) {  // 8 rows of one chunk at a time
    const double* e = exact + (m0 / kLaneRows) * tile + m0 % kLaneRows;
    const int64_t mr = std::min<int64_t>(8, rows - m0);
    int64_t o = 0;
    for (; o + 8 <= on; o += 8) {
      __m256 r[8];
      for (int q = 0; q < 8; ++q) {  // output o + q of the 8 rows, each total rounded to float once
        const double* eq = e + (o + q) * kLaneRows;
        r[q] = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(eq + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(eq)));
      }
      transpose8x8(r);  // r[j]: row m0 + j's 8 outputs
      const __m256 sc = _mm256_loadu_ps(scale + o0 + o);
      const __m256 b = bias ? vload(bias + o0 + o) : _mm256_setzero_ps();
      for (int64_t j = 0; j < mr; ++j)
        vstore_as(out + (m0 + j) * n + o0 + o,
                  _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(r[j], _mm256_set1_ps(xs[m0 + j])), sc), b));
    }
    for (; o < on; ++o) {
      const float b = bias ? to_f32(bias[o0 + o]) : 0.f;
      for (int64_t j = 0; j < mr; ++j)
        store_as(out + (m0 + j) * n + o0 + o,
                 static_cast<float>(e[o * kLaneRows + j]) * xs[m0 + j] * scale[o0 + o] + b);
    }
  }
}

template <typename T>
void linear_w8_i16(const T* x, const int8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                   int64_t k, int64_t n) {
  const int64_t kp = (k + 15) / 16 * 16;
  std::vector<int16_t> xq(rows * kp);
  std::vector<float> xs(rows);
  quantize_rows_i16(x, rows, k, kp, 0, kExactQmax, xq.data(), xs.data());
  const int64_t first = lane_rows(rows);  // the rows from `first` on go to the row kernel
  if (first > 0) {
    lanes_w8(xq.data(), kp, w, first, k, n, [&](const double* exact, int64_t o0, int64_t on) {
      lanes_w8_store(exact, xs.data(), scale, bias, out, first, n, o0, on);
    });
    if (first == rows) return;
  }
  const WeightRows stream{w, k};
  const int16_t* xr = xq.data() + first * kp;
  tiles_i16(bias, out + first * n, xs.data() + first, rows - first, n,
            [&](auto R, int64_t m0, int64_t o0, int64_t o1, float* sums) {
              constexpr int r = decltype(R)::value;
              for (int64_t o = o0; o < o1; ++o) {
                if (m0 == 0) stream.ahead(o);
                dot_rows_w8_i16<r>(xr + m0 * kp, kp, w + o * k, k, sums + (o - o0) * r);
              }
            },
            [&](int64_t o) { return scale[o]; });
}
#endif

#if defined(KILN_ISA_AVX512)
constexpr int64_t kFlush = 1024;  // int32 partial sums go to float this often (no overflow)

// O weight rows (int8) x R input rows (int16): each weight chunk is loaded once for R rows,
// each input chunk once for O weight rows
template <int R, int O>
inline void tile_w8(const int16_t* xq, int64_t kp, const int8_t* w, int64_t k, float* sums) {
  static_assert(O == 1, "one weight row at a time");
  // four independent accumulator chains per row: vpdpwssd's latency, not its throughput,
  // bounds a single chain
  constexpr int C = 4;
  __m512 facc[R];
  for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
  const int64_t full = k / 32 * 32;
  for (int64_t b0 = 0; b0 < kp; b0 += kFlush) {
    const int64_t b1 = std::min(kp, b0 + kFlush);
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
    int64_t i = b0;
    for (; i + 32 * C <= b1 && i + 32 * C <= full; i += 32 * C) {
      for (int c = 0; c < C; ++c) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 32 * c)));
        for (int r = 0; r < R; ++r) acc[r][c] = dp16(acc[r][c], _mm512_loadu_si512(xq + r * kp + i + 32 * c), wv);
      }
    }
    for (; i < b1; i += 32) {
      const __m256i raw = i < full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i))
                                   : _mm256_maskz_loadu_epi8((1u << (k - i)) - 1, w + i);
      const __m512i wv = _mm512_cvtepi8_epi16(raw);
      for (int r = 0; r < R; ++r) acc[r][0] = dp16(acc[r][0], _mm512_loadu_si512(xq + r * kp + i), wv);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i total = _mm512_add_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]),
                                             _mm512_add_epi32(acc[r][2], acc[r][3]));
      facc[r] = _mm512_add_ps(facc[r], _mm512_cvtepi32_ps(total));
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(facc[r]);
}

// one weight row after the other (see rows_w4); sums[(o - o0) * R + r]
template <int R>
inline void rows_w8(const int16_t* xq, int64_t kp, const int8_t* w, int64_t k, int64_t o0, int64_t o1,
                    float* sums) {
  for (int64_t o = o0; o < o1; ++o) tile_w8<R, 1>(xq, kp, w + o * k, k, sums + (o - o0) * R);
}

template <typename T>
void linear_w8_i16(const T* x, const int8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                   int64_t k, int64_t n) {
  const int64_t kp = (k + 31) / 32 * 32;
  std::vector<int16_t> xq(rows * kp);
  std::vector<float> xs(rows);
  quantize_rows_i16(x, rows, k, kp, 0, 32767.f, xq.data(), xs.data());
  tiles_i16(bias, out, xs.data(), rows, n, [&](auto R, int64_t m0, int64_t o0, int64_t o1, float* sums) {
    rows_w8<decltype(R)::value>(xq.data() + m0 * kp, kp, w, k, o0, o1, sums);
  }, [&](int64_t o) { return scale[o]; });
}

#if defined(KILN_ISA_VNNI)
// W8A16 with VNNI bytes: each input row split into two int8 planes (split_rows_i8); the int8 weights, offset
// to u8 by + 128 (one XOR), meet each plane with vpdpbusd: 64 multiply-adds per instruction and
// no widening, half the instructions of the int16 path, so the GEMV keeps up with memory. The
// offset is taken off exactly in the integer domain (128 * sum of the plane). Rows shorter than
// kVnniBytesMinK take the int16 path (select.h): their per-row reductions (two planes) cost more than the
// instructions saved (measured one thread: k 576 / 1536 int16 1.2x faster; k 2048 - 8192 this
// path 1.15-1.5x faster, at memory bandwidth for 8192 x 8192; benchmarks/ablations/gemv_shapes.py).
constexpr int64_t kVnniBytesMinK = 2048;

// R input rows (two planes each) against one int8 weight row; sums[r] = the exact integer dot
// product of the row with the 15-bit input row r, as float
template <int R>
inline void dot_rows_w8_vnni(const int8_t* hi, const int8_t* lo, int64_t kp, const int32_t* hsum,
                             const int32_t* lsum, const int8_t* w, int64_t k, float* sums) {
  constexpr int C = R == 1 ? 2 : 1;  // independent chains per plane: vpdpbusd's latency
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i ah[R][C], al[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) ah[r][c] = al[r][c] = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 * C <= k; i += 64 * C) {
    for (int c = 0; c < C; ++c) {
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(w + i + 64 * c), flip);
      for (int r = 0; r < R; ++r) {
        ah[r][c] = _mm512_dpbusd_epi32(ah[r][c], wv, _mm512_loadu_si512(hi + r * kp + i + 64 * c));
        al[r][c] = _mm512_dpbusd_epi32(al[r][c], wv, _mm512_loadu_si512(lo + r * kp + i + 64 * c));
      }
    }
  }
  for (; i < k; i += 64) {  // the tail: weights past k read as 0 (x planes are zero there)
    const __mmask64 mask = k - i >= 64 ? ~0ull : (1ull << (k - i)) - 1;
    const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + i), flip);
    for (int r = 0; r < R; ++r) {
      ah[r][0] = _mm512_dpbusd_epi32(ah[r][0], wv, _mm512_loadu_si512(hi + r * kp + i));
      al[r][0] = _mm512_dpbusd_epi32(al[r][0], wv, _mm512_loadu_si512(lo + r * kp + i));
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512i h = ah[r][0], l = al[r][0];
    for (int c = 1; c < C; ++c) {
      h = _mm512_add_epi32(h, ah[r][c]);
      l = _mm512_add_epi32(l, al[r][c]);
    }
    const int32_t th = _mm512_reduce_add_epi32(h) - 128 * hsum[r];
    const int32_t tl = _mm512_reduce_add_epi32(l) - 128 * lsum[r];
    sums[r] = static_cast<float>(th) * 256.f + static_cast<float>(tl);
  }
}

template <typename T>
void linear_w8_vnni(const T* x, const int8_t* w, const float* scale, const T* bias, T* out, int64_t rows,
                    int64_t k, int64_t n) {
  const int64_t kp = (k + 63) / 64 * 64;
  std::vector<int8_t> hi(rows * kp), lo(rows * kp);
  std::vector<float> xs(rows);
  std::vector<int32_t> hsum(rows), lsum(rows);
  split_rows_i8(x, rows, k, kp, kp, hi.data(), lo.data(), xs.data(), hsum.data(), lsum.data());
  const WeightRows stream{w, k};
  tiles_i16(bias, out, xs.data(), rows, n, [&](auto R, int64_t m0, int64_t o0, int64_t o1, float* sums) {
    constexpr int r = decltype(R)::value;
    for (int64_t o = o0; o < o1; ++o) {
      if (m0 == 0) stream.ahead(o);
      dot_rows_w8_vnni<r>(hi.data() + m0 * kp, lo.data() + m0 * kp, kp, hsum.data() + m0, lsum.data() + m0,
                          w + o * k, k, sums + (o - o0) * r);
    }
  }, [&](int64_t o) { return scale[o]; });
}
#endif
#endif
