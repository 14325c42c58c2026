// The formats kiln's kernels and ops agree on, outside the per-ISA namespaces: the shape of a
// paged-attention batch and the weight layouts (the stored int4 rows, the tiled int4, int8 and
// bf16 layouts made at load, with their packers). The Python side's copies of these layouts are the
// references in plugins/reference.py and plugins/formats.py.

struct fp8e4m3 {  // FP8 E4M3 bits (1 sign, 4 exponent bits biased by 7, 3 mantissa bits)
  uint8_t bits;
};

struct PagedShape {
  int64_t tokens, seqs, heads, kv_heads, head_dim, block_size, max_blocks;
  int64_t key_hadamard = 0;  // 0, or the block size of the Walsh-Hadamard transform of q and k after RoPE
  int64_t window = 0;        // 0, or a sliding window: a token at position p attends to (p - window, p]
  int64_t rotary_dim = 0;    // how many of each head's values rotary embedding rotates (the tables' width)
};

// --- int4, rows (as the engine stores them) ---------------------------------------------------
// [out, in / 2] bytes, two values per byte along `in` (low nibble = even input), stored + 8
// (0..15 = -8..7); scales [out, ceil(in / group_size)].
inline int stored_nibble(const uint8_t* row, int64_t i) { return (i & 1) ? row[i >> 1] >> 4 : row[i >> 1] & 0x0F; }
inline int int4_at(const uint8_t* row, int64_t i) { return stored_nibble(row, i) - 8; }  // the signed value

// --- int4, tiled ---------------------------------------------------------------------------
// linear_w4_tiled streams the int4 weights in a layout made for it when an engine loads
// (pack_int4_tiled, from the stored [out, in / 2] rows): output rows in tiles of 16, tiles in
// groups of up to kTileGroup (the last group may hold fewer), each group's bytes contiguous.
// For every block b of 8 inputs a group holds one 64-byte vector per tile: 16 rows x 4 bytes,
// byte j of row r = q[r][8b + j] | q[r][8b + 4 + j] << 4 (q the stored nibbles, value + 8).
// One vpdpbusd multiplies the 16 rows by four inputs broadcast to every lane, so nothing is
// reduced across lanes, a group's int32 sums go to float once per 16 rows, and the weights are
// read as one sequential stream. The scales follow the same order: per group of inputs, 16
// floats per tile. (One thread, weights in cache: 2.3-2.6x the row-layout kernel on SmolLM2's
// and 7B shapes, benchmarks/ablations/gemv_shapes.py; docs/benchmarks.md has the in-model steps.)
constexpr int64_t kTileRows = 16, kTileGroup = 4;
constexpr int64_t kTiledMaxGroup = 8192;  // 15 * 16383 * group stays within int32

struct TiledLayout {  // where row o's bytes and scales sit: kb blocks of inputs, one 64-byte vector each per tile
  int64_t kb, groups, tiles;
  int64_t width(int64_t t0) const { return std::min(kTileGroup, tiles - t0); }  // tiles in the group from t0
  int64_t byte(int64_t o, int64_t b, int64_t j) const {  // row o, block b, byte j
    const int64_t t = o / kTileRows, t0 = t / kTileGroup * kTileGroup;
    return ((t0 * kb + b * width(t0) + t - t0) * kTileRows + o % kTileRows) * 4 + j;
  }
  int64_t scale(int64_t o, int64_t g) const {  // row o, group g
    const int64_t t = o / kTileRows, t0 = t / kTileGroup * kTileGroup;
    return (t0 * groups + g * width(t0) + t - t0) * kTileRows + o % kTileRows;
  }
};

inline TiledLayout tiled_int4_layout(int64_t k, int64_t n, int64_t group) {  // blocks of 8 inputs
  return {k / 8, (k + group - 1) / group, n / kTileRows};
}

inline int tiled_nibble(const uint8_t* w, const TiledLayout& L, int64_t o, int64_t i) {
  const uint8_t byte = w[L.byte(o, i / 8, i % 4)];
  return (i % 8) < 4 ? byte & 0x0F : byte >> 4;
}

inline void pack_int4_tiled_bytes(const uint8_t* w, const float* s, int64_t group, uint8_t* pw, float* ps, int64_t k,
                            int64_t n) {
  const TiledLayout L = tiled_int4_layout(k, n, group);
  parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* row = w + o * (k / 2);
      for (int64_t b = 0; b < L.kb; ++b)
        for (int64_t j = 0; j < 4; ++j)
          pw[L.byte(o, b, j)] = static_cast<uint8_t>(stored_nibble(row, 8 * b + j) | stored_nibble(row, 8 * b + 4 + j) << 4);
      for (int64_t g = 0; g < L.groups; ++g) ps[L.scale(o, g)] = s[o * L.groups + g];
    }
  });
}

// --- int8, tiled ---------------------------------------------------------------------------
// The int4 tiling for int8 weights (pack_int8_tiled at load): blocks of 4 inputs, one 64-byte
// vector per tile (16 rows x 4 bytes, stored + 128 so that vpdpbusd reads them as unsigned),
// tiles in groups of four, the per-row scales as stored (kernels/int8_tiled.h).

// W8A8 on this layout (kernels/w8a8_tiled.h) sums products of at most 255 * 128 in int32
constexpr int64_t kW8A8TiledMaxIn = 65536;

inline TiledLayout tiled_int8_layout(int64_t k, int64_t n) {  // blocks of 4 inputs, one group (per-row scales)
  return {k / 4, 1, n / kTileRows};
}

inline void pack_int8_tiled_bytes(const int8_t* w, uint8_t* pw, int64_t k, int64_t n) {
  const TiledLayout L = tiled_int8_layout(k, n);
  parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t b = 0; b < L.kb; ++b)
        for (int64_t j = 0; j < 4; ++j) pw[L.byte(o, b, j)] = static_cast<uint8_t>(w[o * k + 4 * b + j] + 128);
  });
}

inline int tiled_int8_at(const uint8_t* w, const TiledLayout& L, int64_t o, int64_t i) {
  return static_cast<int>(w[L.byte(o, i / 4, i % 4)]) - 128;
}

// --- bf16, tiled ---------------------------------------------------------------------------
// The layout of AMX's B tiles for bf16 weights (pack_bf16_tiled at load, on the avx512amx level;
// kernels/dense_tiled.h): outputs in groups of 16, each group's inputs in pairs, the pair's two
// values side by side for each of the 16 outputs: element (o, i) at ((o / 16) * (k / 2) + i / 2) *
// 32 + (o % 16) * 2 + i % 2. Inputs [32c, 32c + 32) of a group are then one 1 KB tile (16 rows
// of pairs x 16 outputs), a group's tiles one after the other. Needs n % 16 == 0, k % 32 == 0.
inline bool bf16_tiles_fit(int64_t k, int64_t n) { return k > 0 && n > 0 && k % 32 == 0 && n % kTileRows == 0; }

inline int64_t tiled_bf16_index(int64_t o, int64_t i, int64_t k) {
  return ((o / kTileRows) * (k / 2) + i / 2) * (2 * kTileRows) + (o % kTileRows) * 2 + i % 2;
}

template <typename V>
inline void pack_bf16_tiled_values(const V* w, V* pw, int64_t k, int64_t n) {
  parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t i = 0; i < k; ++i) pw[tiled_bf16_index(o, i, k)] = w[o * k + i];
  });
}

