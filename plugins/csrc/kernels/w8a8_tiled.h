// SmoothQuant W8A8 on the tiled int8 layout (formats.h: pack_int8_tiled at load, each weight + 128
// as uint8), which W8A8 weights take where select.h says (kTiledW8A8). Included per
// ISA inside kiln::<isa> after int8_tiled.h and w8a8.h.
//
// The input rows are quantized as linear_w8a8_rows quantizes them (quantize_row_u8: the same int8
// values and row scales), kept signed here: q = u8 - 128. Against the stored weights + 128 a row's
// dot product is w . q + 128 * sum(q), so 128 * sum(q) comes off each row's exact int32 sums; they
// are then linear_w8a8_rows's integers, and store_w8a8's arithmetic (float(sum) * row scale *
// output scale + bias) makes linear_w8a8's bits from them, at every row count and on every path
// (the tests compare the two ops).
//
//   linear_w8a8_tiled_ref   plain loops on the tiled bytes (the levels without VNNI)
//   linear_w8a8_tiled_vnni  tiled_gemv with VNNI (tiles_w8a8t: one vpdpbusd multiplies 16
//                           outputs by 4 inputs of a row); with AMX from kAmxRowsFrom rows
//                           tiled_w8a8_amx: tdpbsud, 16 rows x 64 inputs x 16 outputs, the
//                           layout's vectors a B tile as they lie (as tiled_w8_amx), a tile
//                           group's four tiles a step (one stream), each tile's int32 sums
//                           stored once per chunk of 16 rows

// Row m quantized into q (signed) and its scale; qsum128 = 128 * sum(q), what the weights' + 128
// adds to the row's dot products
template <typename T>
float quantize_row_s8(const T* x, int8_t* q, int64_t k, float static_scale, int32_t* qsum128) {
  uint8_t* u = reinterpret_cast<uint8_t*>(q);
  const float s = quantize_row_u8(x, u, k, static_scale);
  int32_t sum = 0;
  for (int64_t i = 0; i < k; ++i) {
    q[i] = static_cast<int8_t>(static_cast<int>(u[i]) - 128);
    sum += q[i];
  }
  *qsum128 = 128 * sum;
  return s;
}

template <typename T>
void linear_w8a8_tiled_ref(const T* x, const uint8_t* w, const float* scale, float static_scale, const T* bias,
                           T* out, int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  std::vector<int8_t> q(rows * k);
  std::vector<float> xs(rows);
  std::vector<int32_t> qsum128(rows);
  for (int64_t m = 0; m < rows; ++m) xs[m] = quantize_row_s8(x + m * k, q.data() + m * k, k, static_scale, &qsum128[m]);
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t m = 0; m < rows; ++m) {
        int32_t acc = 0;
        for (int64_t i = 0; i < k; ++i) acc += static_cast<int32_t>(q[m * k + i]) * tiled_int8_at(w, L, o, i);
        store_w8a8(out, n, xs.data(), scale, bias, m, o, acc);
      }
  });
}

#if defined(KILN_ISA_VNNI)
// V tiles (u0.. of a tile group of width U; w at the group's start) x R rows of q (row stride k):
// acc[v * R + r] = the row's exact sums for the tile's 16 outputs (the + 128 taken off), as float
template <int R, int V>
__attribute__((noinline)) void tiles_w8a8t(const int8_t* q, const int32_t* qsum128, const uint8_t* w,
                                           const TiledLayout& L, int64_t U, int64_t u0, int64_t k, __m512* acc) {
  constexpr int C = V * R;
  static_assert(C <= 4, "at most four (tile, row) pairs");
  __m512i a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_setzero_si512();
  for (int64_t b = 0; b < L.kb; ++b) {
    tiles_ahead(w, b, U, u0, V);
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = broadcast4(q + r * k + 4 * b);
    for (int v = 0; v < V; ++v) {
      const __m512i wv = _mm512_loadu_si512(w + (b * U + u0 + v) * 64);
      for (int r = 0; r < R; ++r) a[v * R + r] = _mm512_dpbusd_epi32(a[v * R + r], wv, xv[r]);
    }
  }
  for (int v = 0; v < V; ++v)
    for (int r = 0; r < R; ++r)
      acc[v * R + r] = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[v * R + r], _mm512_set1_epi32(qsum128[r])));
}

// The rows quantized (quantize_row_s8) against the tiled layout with VNNI (tiled_gemv: one row in
// one pass of the share's tiles of a group, several rows tile by tile, four rows at a time)
template <typename T>
void tiled_w8a8_vnni(const int8_t* q, const int32_t* qsum128, const float* xs, const uint8_t* w, const float* scale,
                     const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  tiled_gemv(L, bias, out, rows, n,
             [&](auto R, auto V, int64_t t0, int64_t U, int64_t u0, int64_t m0, __m512* acc) {
               tiles_w8a8t<decltype(R)::value, decltype(V)::value>(q + m0 * k, qsum128 + m0, w + t0 * L.kb * 64, L,
                                                                   U, u0, k, acc);
             },
             [&](int64_t m, int64_t o0, __m512 acc, float* sums) {  // store_w8a8's products, in its order
               _mm512_storeu_ps(sums, _mm512_mul_ps(_mm512_mul_ps(acc, _mm512_set1_ps(xs[m])),
                                                    _mm512_loadu_ps(scale + o0)));
             });
}
#endif

#if defined(KILN_ISA_AMX)
// One step of 64 inputs (blocks b .. b + 15) against A tile `a`: the rows' inputs into a, then
// each tile's vectors into B tile 6 or 7 and one tdpbsud into its C tile. (GCC's tile intrinsics
// take tile numbers as literals: macros, not functions of them.)
#define KILN_W8A8_TILE(a, c, bt, b, v)                         \
  _tile_loadd(bt, wt + 64 * (v) + (b) * stride, stride);       \
  _tile_dpbsud(c, a, bt);
// P (1 or 2) tiles: C tiles c0 (the first) and c1 (the second)
#define KILN_W8A8_PAIR_STEP(a, c0, c1, b)                      \
  {                                                            \
    _tile_loadd(a, qc + 4 * (b), k);                           \
    KILN_W8A8_TILE(a, c0, 6, b, 0)                             \
    if (P == 2) {                                              \
      KILN_W8A8_TILE(a, c1, 7, b, 1)                           \
    }                                                          \
  }
// a whole tile group: tile v into C tile v, B tiles 6 and 7 on alternate tiles
#define KILN_W8A8_GROUP_STEP(a, b)                             \
  {                                                            \
    _tile_loadd(a, qc + 4 * (b), k);                           \
    KILN_W8A8_TILE(a, 0, 6, b, 0)                              \
    KILN_W8A8_TILE(a, 1, 7, b, 1)                              \
    KILN_W8A8_TILE(a, 2, 6, b, 2)                              \
    KILN_W8A8_TILE(a, 3, 7, b, 3)                              \
  }

// P (1 or 2) tiles from t's vectors wt (block b at wt + b * stride) against 16 rows qc: each tile's
// sums in two C tiles, the even and the odd steps of 64 inputs (tile 0: C 0, 1; tile 1: C 2, 3;
// four independent sums in flight, as tiled_w8_amx), stored to C[2p], C[2p + 1]; ahead: prefetch
// the weights (the first chunk of rows)
template <int P>
inline void amx_w8a8_tiles(const int8_t* qc, const uint8_t* wt, int64_t stride, const TiledLayout& L, int64_t k,
                           bool ahead, int32_t (*C)[kTileRows * kTileRows]) {
  constexpr int64_t step = kAmxK / 4;  // blocks of 4 inputs a tile multiplies
  for (int c = 0; c < 2 * P; ++c) amx_zero(c);
  for (int64_t b = 0; b < L.kb; b += 2 * step) {
    if (ahead)
      for (int64_t j = b; j < std::min(L.kb, b + 2 * step); ++j) tiles_ahead(wt, j, stride / 64, 0, P);
    KILN_W8A8_PAIR_STEP(4, 0, 2, b)
    if (b + step < L.kb) KILN_W8A8_PAIR_STEP(5, 1, 3, b + step)
  }
  for (int c = 0; c < 2 * P; ++c) amx_store(c, C[c]);
}

// Four tiles (a whole tile group) from t's vectors wt against 16 rows qc, a step of 64 inputs reading
// the group's vectors as one stream: tile v's sums in C tile v (one chain each), A 4 and 5 on
// alternate steps, B 6 and 7 on alternate tiles; stored to C[v]
inline void amx_w8a8_group(const int8_t* qc, const uint8_t* wt, const TiledLayout& L, int64_t k, bool ahead,
                           int32_t (*C)[kTileRows * kTileRows]) {
  constexpr int64_t step = kAmxK / 4, stride = kTileGroup * 64;
  for (int c = 0; c < 4; ++c) amx_zero(c);
  for (int64_t b = 0; b < L.kb; b += 2 * step) {
    if (ahead)
      for (int64_t j = b; j < std::min(L.kb, b + 2 * step); ++j) tiles_ahead(wt, j, kTileGroup, 0, kTileGroup);
    KILN_W8A8_GROUP_STEP(4, b)
    if (b + step < L.kb) KILN_W8A8_GROUP_STEP(5, b + step)
  }
  for (int c = 0; c < 4; ++c) amx_store(c, C[c]);
}
#undef KILN_W8A8_GROUP_STEP
#undef KILN_W8A8_PAIR_STEP
#undef KILN_W8A8_TILE

// out [rows, n] from the quantized rows q [rows, k] (k a multiple of kAmxK), rows 16 at a time (the
// last chunk padded with zero rows): a whole tile group at a time (amx_w8a8_group: 1.08-1.10x the
// pairs of tiles at 16 rows, one thread, SmolLM2's shapes), else two tiles or one
template <typename T>
void tiled_w8a8_amx(const int8_t* q, const int32_t* qsum128, const float* xs, const uint8_t* w, const float* scale,
                    const T* bias, T* out, int64_t rows, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  const int64_t chunks = (rows + kTileRows - 1) / kTileRows, padded = chunks * kTileRows;
  std::vector<int8_t> q_padded;
  q = amx_pad_rows(q, rows, padded, k, q_padded);
  parallel_for(0, L.tiles, 1, [&](int64_t begin, int64_t end) {
    amx_configure(8);  // C 0-3; A 4 (even steps), 5 (odd); B 6, 7
    // [slot][row][output]: two tiles' even and odd steps at 2p, 2p + 1, or a whole group's tile v at v
    alignas(64) int32_t C[4][kTileRows * kTileRows];
    for (int64_t t = begin; t < end;) {
      const int64_t t0 = t / kTileGroup * kTileGroup, U = L.width(t0), u = t - t0;
      // tiles t .. t + P - 1 of one group: all four where the share has them, else two or one
      const bool whole = u == 0 && U == kTileGroup && t + kTileGroup <= end;
      const int64_t P = whole ? kTileGroup : (t + 1 < end && u + 1 < U) ? 2 : 1;
      const uint8_t* wt = w + (t0 * L.kb + u) * 64;  // block b at wt + b * U * 64
      for (int64_t c = 0; c < chunks; ++c) {
        const int8_t* qc = q + c * kTileRows * k;
        if (P == 4) amx_w8a8_group(qc, wt, L, k, c == 0, C);
        else if (P == 2) amx_w8a8_tiles<2>(qc, wt, U * 64, L, k, c == 0, C);  // later chunks: in cache
        else amx_w8a8_tiles<1>(qc, wt, U * 64, L, k, c == 0, C);
        // the sums to outputs from registers and locals: through the closure every store to out
        // made the compiler load its pointers again
        const int32_t* const row_sums = qsum128 + c * kTileRows;
        const float* const row_scales = xs + c * kTileRows;
        T* const out_rows = out + c * kTileRows * n;
        const int64_t chunk_rows = std::min<int64_t>(kTileRows, rows - c * kTileRows);
        for (int64_t p = 0; p < P; ++p) {
          const int64_t o0 = (t + p) * kTileRows;
          const __m512 s16 = _mm512_loadu_ps(scale + o0), b16 = bias16_of(bias, o0);
          for (int64_t r = 0; r < chunk_rows; ++r) {
            const __m512i sum = P == 4 ? _mm512_load_si512(C[p] + r * kTileRows) :
                                _mm512_add_epi32(_mm512_load_si512(C[2 * p] + r * kTileRows),
                                                 _mm512_load_si512(C[2 * p + 1] + r * kTileRows));
            const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(row_sums[r])));
            const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(exact, _mm512_set1_ps(row_scales[r])), s16);
            store_row16(out_rows + r * n + o0, scaled, b16);
          }
        }
      }
      t += P;
    }
    _tile_release();
  });
}
#endif

#if defined(KILN_ISA_VNNI)
template <typename T>
void linear_w8a8_tiled_vnni(const T* x, const uint8_t* w, const float* scale, float static_scale, const T* bias,
                            T* out, int64_t rows, int64_t k, int64_t n) {
  std::vector<int8_t> q(rows * k);
  std::vector<float> xs(rows);
  std::vector<int32_t> qsum128(rows);
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      xs[m] = quantize_row_s8(x + m * k, q.data() + m * k, k, static_scale, &qsum128[m]);
  });
#if defined(KILN_ISA_AMX)
  if (rows >= kAmxRowsFrom && k % kAmxK == 0)
    return tiled_w8a8_amx(q.data(), qsum128.data(), xs.data(), w, scale, bias, out, rows, k, n);
#endif
  tiled_w8a8_vnni(q.data(), qsum128.data(), xs.data(), w, scale, bias, out, rows, k, n);
}
#endif
