// AMX tiles (the avx512amx level: Sapphire Rapids and later Xeons): what the kernels that use
// them share. Included per ISA inside kiln::<isa>; empty below that level. Every tile these
// kernels use is 16 rows of 64 bytes: A 16 input rows x 64 int8 (or 32 bf16) inputs, B 16 rows
// of 4 int8 (2 bf16) inputs x 16 outputs (the tiled layouts' vectors, formats.h), C 16 rows x 16
// int32 (float) sums.
//
//   kAmxRowsFrom        the row count from which the int4 and int8 tiled kernels take AMX (bf16
//                       takes it at every row count: dense_tiled.h)
//   amx_configure(n)    tiles 0 .. n - 1 as 16 x 64 bytes, on the calling thread (ldtilecfg;
//                       the kernels release them with _tile_release at the end of their share)
//   amx_zero, amx_store C tiles 0-3 by number
//   amx_pad_rows        a [rows, width] array copied out to whole chunks of 16 rows (zeros)

#if defined(KILN_ISA_AMX)
constexpr int64_t kAmxRowsFrom = 16;  // below, the row kernels (docs/benchmarks.md)
constexpr int64_t kAmxK = 64;         // inputs a tile multiplies: 64 bytes a row

struct AmxTileConfig {  // ldtilecfg's 64-byte operand (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure(int tiles) {
  AmxTileConfig config;
  for (int t = 0; t < tiles; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  // every byte stored before ldtilecfg reads them: inlined into a larger kernel (a version of
  // attention_amx.h's items), GCC 12 dropped the colsb stores as dead (16 rows of 0 bytes:
  // ldtilecfg faulted)
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// C tile c (0-3) zeroed, or stored to 16 rows of 64 bytes at p (the intrinsics take literals)
inline void amx_zero(int c) {
  switch (c) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3);
  }
}
inline void amx_store(int c, void* p) {
  switch (c) {
    case 0: _tile_stored(0, p, 64); break;
    case 1: _tile_stored(1, p, 64); break;
    case 2: _tile_stored(2, p, 64); break;
    default: _tile_stored(3, p, 64);
  }
}

// p [rows, width] -> padded rows (a multiple of 16): p itself if it has them, else a copy in
// storage with zero rows after (tileloadd reads 16 rows; the int4 sums go to float 16 at a time)
template <typename V>
const V* amx_pad_rows(const V* p, int64_t rows, int64_t padded, int64_t width, std::vector<V>& storage) {
  if (padded == rows) return p;
  storage.assign(padded * width, V{});
  std::copy(p, p + rows * width, storage.begin());
  return storage.data();
}
#endif
