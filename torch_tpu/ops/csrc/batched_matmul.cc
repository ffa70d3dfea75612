// Batched small matrix products for XLA:CPU (an XLA FFI custom call, torch_tpu/ops/batched_matmul.py).
//
// out[b] = op(a[b]) @ op(b[b]) for every batch element b, op transposing when its flag is set;
// float32 or bfloat16 operands, float32 accumulation, the output in the operands' dtype. XLA:CPU
// runs such products (DLRM's interaction: 27x64 @ 64x27 over a batch of thousands) as a loop of
// tiny Eigen calls at ~12 GFLOP/s; here each batch element is packed into float32 panels held in
// L1 (A as rows, B as K x 32-column panels, zero padded) and multiplied by a register-blocked
// micro-kernel (4 rows x 32 columns of accumulators), the batch split over XLA's intra-op pool.
//
// Summation order over K is plain ascending k with one accumulator per output (as a naive loop),
// and fused multiply-adds where the CPU has them, so results equal torch's CPU bmm to rounding.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRows = 8;   // micro-kernel rows of A (at most)
constexpr int64_t kCols = 32;  // micro-kernel columns of B (two AVX-512 registers)

inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even; NaN stays NaN
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }

struct Shape {
  int64_t batch, m, n, k;
  bool trans_a, trans_b;
};

// GCC vector extensions (16 floats): one AVX-512 register, two AVX2 ones, four SSE ones.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef int32_t v16i __attribute__((vector_size(64)));

// One stage of a 16 x 16 transpose in registers: swaps bit `S` of the row index with the same bit
// of the lane index, for the row pair (i, i | S); four stages (S = 1, 2, 4, 8) transpose.
template <int S>
__attribute__((always_inline)) inline void transpose_stage(v16* rows) {
  constexpr v16i low = {(0 & S) ? 16 + (0 ^ S) : 0,    (1 & S) ? 16 + (1 ^ S) : 1,    (2 & S) ? 16 + (2 ^ S) : 2,
                        (3 & S) ? 16 + (3 ^ S) : 3,    (4 & S) ? 16 + (4 ^ S) : 4,    (5 & S) ? 16 + (5 ^ S) : 5,
                        (6 & S) ? 16 + (6 ^ S) : 6,    (7 & S) ? 16 + (7 ^ S) : 7,    (8 & S) ? 16 + (8 ^ S) : 8,
                        (9 & S) ? 16 + (9 ^ S) : 9,    (10 & S) ? 16 + (10 ^ S) : 10, (11 & S) ? 16 + (11 ^ S) : 11,
                        (12 & S) ? 16 + (12 ^ S) : 12, (13 & S) ? 16 + (13 ^ S) : 13, (14 & S) ? 16 + (14 ^ S) : 14,
                        (15 & S) ? 16 + (15 ^ S) : 15};
  constexpr v16i high = {(0 & S) ? 16 : 0 ^ S,        (1 & S) ? 17 : 1 ^ S,   (2 & S) ? 18 : 2 ^ S,
                         (3 & S) ? 19 : 3 ^ S,        (4 & S) ? 20 : 4 ^ S,   (5 & S) ? 21 : 5 ^ S,
                         (6 & S) ? 22 : 6 ^ S,        (7 & S) ? 23 : 7 ^ S,   (8 & S) ? 24 : 8 ^ S,
                         (9 & S) ? 25 : 9 ^ S,        (10 & S) ? 26 : 10 ^ S, (11 & S) ? 27 : 11 ^ S,
                         (12 & S) ? 28 : 12 ^ S,      (13 & S) ? 29 : 13 ^ S, (14 & S) ? 30 : 14 ^ S,
                         (15 & S) ? 31 : 15 ^ S};
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i & S) continue;
    const v16 a = rows[i], b = rows[i | S];
    rows[i] = __builtin_shuffle(a, b, low);
    rows[i | S] = __builtin_shuffle(a, b, high);
  }
}

// bp[kk][0..32) = b[n0 + c][k0 + kk] (rows past n zero) for kk < 16: B's rows transposed into the
// panel 16 x 16 at a time.
__attribute__((always_inline)) inline void pack_transposed(const float* b, int64_t n, int64_t k, int64_t n0,
                                                           int64_t k0, float* bp) {
  for (int64_t half = 0; half < kCols; half += 16) {
    v16 rows[16];
    for (int64_t c = 0; c < 16; ++c)
      rows[c] = n0 + half + c < n ? load16(b + (n0 + half + c) * k + k0) : v16{};
    transpose_stage<1>(rows), transpose_stage<2>(rows), transpose_stage<4>(rows), transpose_stage<8>(rows);
    for (int64_t kk = 0; kk < 16; ++kk) std::memcpy(bp + (k0 + kk) * kCols + half, &rows[kk], sizeof(v16));
  }
}

// acc[r][c] = sum_k ap[r * lda + k] * bp[k * ldb + c] for r < R, c < kCols: R x 2 vector accumulators in
// registers, one broadcast of A and two vector loads of B per multiply-add pair.
template <int R>
__attribute__((always_inline)) inline void block(const float* ap, int64_t lda, int64_t k, const float* bp,
                                                 int64_t ldb, float* acc) {
  v16 sums[R][2] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    const v16 b0 = load16(bp + kk * ldb), b1 = load16(bp + kk * ldb + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float a = ap[r * lda + kk];
      sums[r][0] += a * b0;
      sums[r][1] += a * b1;
    }
  }
  std::memcpy(acc, sums, sizeof(sums));
}

__attribute__((always_inline)) inline void micro_kernel(const float* ap, int64_t lda, int64_t k, const float* bp,
                                                        int64_t ldb, int64_t rows, float* acc) {
  switch (rows) {
    case 1: return block<1>(ap, lda, k, bp, ldb, acc);
    case 2: return block<2>(ap, lda, k, bp, ldb, acc);
    case 3: return block<3>(ap, lda, k, bp, ldb, acc);
    case 4: return block<4>(ap, lda, k, bp, ldb, acc);
    case 5: return block<5>(ap, lda, k, bp, ldb, acc);
    case 6: return block<6>(ap, lda, k, bp, ldb, acc);
    case 7: return block<7>(ap, lda, k, bp, ldb, acc);
    default: return block<8>(ap, lda, k, bp, ldb, acc);
  }
}

// Scratch for one thread: A packed as m x k float32 rows, B as one k x kCols panel.
struct Scratch {
  std::vector<float> a, b;
};

// Columns [n0, n0 + cols) of op(B) as float32 rows of stride kCols (zero padded) in `panel`, or
// B itself (rows of stride n) when it is float32, untransposed and the panel is whole.
template <typename T>
__attribute__((always_inline)) inline const float* pack_panel(const Shape& s, const T* b, int64_t n0, int64_t cols,
                                                              float* panel) {
  if constexpr (std::is_same_v<T, float>) {
    if (!s.trans_b && cols == kCols) return b + n0;
    if (s.trans_b && s.k % 16 == 0) {
      for (int64_t k0 = 0; k0 < s.k; k0 += 16) pack_transposed(b, s.n, s.k, n0, k0, panel);
      return panel;
    }
  }
  std::fill(panel, panel + s.k * kCols, 0.0f);
  if (s.trans_b) {
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t kk = 0; kk < s.k; ++kk) panel[kk * kCols + c] = load(b, (n0 + c) * s.k + kk);
  } else {
    for (int64_t kk = 0; kk < s.k; ++kk)
      for (int64_t c = 0; c < cols; ++c) panel[kk * kCols + c] = load(b, kk * s.n + n0 + c);
  }
  return panel;
}

// One batch element: A is read in place when it is float32 rows already, else packed (converted,
// transposed) into scratch; for each kCols-column panel of B the micro-kernel runs over blocks of
// up to kRows rows and the accumulators are written out in T.
template <typename T>
__attribute__((always_inline)) inline void one_product(const Shape& s, const T* a, const T* b, T* out,
                                                       Scratch& scratch) {
  const float* ap = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    if (!s.trans_a) ap = a;
  }
  if (ap == nullptr) {
    scratch.a.resize(s.m * s.k);
    if (s.trans_a) {
      for (int64_t kk = 0; kk < s.k; ++kk)
        for (int64_t i = 0; i < s.m; ++i) scratch.a[i * s.k + kk] = load(a, kk * s.m + i);
    } else {
      for (int64_t i = 0; i < s.m * s.k; ++i) scratch.a[i] = load(a, i);
    }
    ap = scratch.a.data();
  }
  scratch.b.resize(s.k * kCols);
  alignas(64) float acc[kRows * kCols];
  for (int64_t n0 = 0; n0 < s.n; n0 += kCols) {
    const int64_t cols = std::min(kCols, s.n - n0);
    const float* bp = pack_panel(s, b, n0, cols, scratch.b.data());
    const int64_t ldb = bp == scratch.b.data() ? kCols : s.n;
    for (int64_t m0 = 0; m0 < s.m; m0 += kRows) {
      const int64_t rows = std::min(kRows, s.m - m0);
      micro_kernel(ap + m0 * s.k, s.k, s.k, bp, ldb, rows, acc);
      for (int64_t r = 0; r < rows; ++r) {
        T* row = out + (m0 + r) * s.n + n0;
        if constexpr (std::is_same_v<T, float>) {
          // A whole panel row at once where it fits: in the row, or (one panel) spilling its
          // padding into the product's next rows, which this loop writes afterwards.
          if (cols == kCols || (s.n <= kCols && (m0 + r) * s.n + kCols <= s.m * s.n)) {
            std::memcpy(row, acc + r * kCols, sizeof(float) * kCols);
            continue;
          }
        }
        for (int64_t c = 0; c < cols; ++c) store(row, c, acc[r * kCols + c]);
      }
    }
  }
}

// Batch elements [first, last), compiled for AVX-512, AVX2 and the baseline (chosen at load).
template <typename T>
__attribute__((always_inline)) inline void products(const Shape& s, const T* a, const T* b, T* out, int64_t first,
                                                    int64_t last, Scratch& scratch) {
  for (int64_t i = first; i < last; ++i)
    one_product(s, a + i * s.m * s.k, b + i * s.k * s.n, out + i * s.m * s.n, scratch);
}

__attribute__((target_clones("avx512f", "avx2,fma", "default"))) void products_of(
    const Shape& s, const float* a, const float* b, float* out, int64_t first, int64_t last, Scratch& scratch) {
  products(s, a, b, out, first, last, scratch);
}

__attribute__((target_clones("avx512f", "avx2,fma", "default"))) void products_of(
    const Shape& s, const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t first, int64_t last,
    Scratch& scratch) {
  products(s, a, b, out, first, last, scratch);
}

// Chunks of the batch handed out by an atomic counter to the caller and the pool's workers. The
// caller waits only for chunks taken, never for a worker to start (it may itself hold the pool's
// only thread); the state outlives the call in workers that start late and find nothing left.
struct Work {
  std::atomic<int64_t> next{0};
  int64_t chunks = 0, chunk = 0;
  std::mutex mutex;
  std::condition_variable finished;
  int64_t done = 0;
};

template <typename T>
void drain(const std::shared_ptr<Work>& work, const Shape& s, const T* a, const T* b, T* out) {
  Scratch scratch;
  for (int64_t c; (c = work->next.fetch_add(1)) < work->chunks;) {
    const int64_t first = c * work->chunk;
    products_of(s, a, b, out, first, std::min(s.batch, first + work->chunk), scratch);
    std::lock_guard<std::mutex> lock(work->mutex);
    if (++work->done == work->chunks) work->finished.notify_all();
  }
}

template <typename T>
void run(ffi::ThreadPool pool, const Shape& s, const T* a, const T* b, T* out) {
  const int64_t flops_per = s.m * s.n * s.k;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Below ~1 MFLOP a chunk, scheduling costs more than it saves.
  const int64_t min_chunk = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, flops_per));
  const int64_t chunk = std::max(min_chunk, (s.batch + 4 * threads - 1) / (4 * threads));
  auto work = std::make_shared<Work>();
  work->chunk = chunk;
  work->chunks = (s.batch + chunk - 1) / chunk;
  const int64_t helpers = std::min(threads, work->chunks - 1);
  for (int64_t h = 0; h < helpers; ++h)
    pool.Schedule([work, s, a, b, out] { drain(work, s, a, b, out); });
  drain(work, s, a, b, out);
  std::unique_lock<std::mutex> lock(work->mutex);
  work->finished.wait(lock, [&] { return work->done == work->chunks; });
}

ffi::Error check(const Shape& s, ffi::Span<const int64_t> a, ffi::Span<const int64_t> b,
                 ffi::Span<const int64_t> out) {
  if (a.size() != 3 || b.size() != 3 || out.size() != 3)
    return ffi::Error::InvalidArgument("batched_matmul: operands must be 3-D");
  const int64_t am = s.trans_a ? a[2] : a[1], ak = s.trans_a ? a[1] : a[2];
  const int64_t bk = s.trans_b ? b[2] : b[1], bn = s.trans_b ? b[1] : b[2];
  if (a[0] != s.batch || b[0] != s.batch || out[0] != s.batch || ak != bk || am != out[1] || bn != out[2])
    return ffi::Error::InvalidArgument("batched_matmul: operand shapes do not match");
  return ffi::Error::Success();
}

template <ffi::DataType D, typename T>
ffi::Error impl(ffi::ThreadPool pool, ffi::Buffer<D> a, ffi::Buffer<D> b, ffi::ResultBuffer<D> out,
                bool trans_a, bool trans_b) {
  const auto od = out->dimensions();
  if (od.size() != 3) return ffi::Error::InvalidArgument("batched_matmul: the output must be 3-D");
  const Shape s{od[0], od[1], od[2], trans_a ? a.dimensions()[1] : a.dimensions()[2], trans_a, trans_b};
  if (ffi::Error error = check(s, a.dimensions(), b.dimensions(), od); error.failure()) return error;
  if (s.batch == 0 || s.m == 0 || s.n == 0) return ffi::Error::Success();
  run(pool, s, reinterpret_cast<const T*>(a.typed_data()), reinterpret_cast<const T*>(b.typed_data()),
      reinterpret_cast<T*>(out->typed_data()));
  return ffi::Error::Success();
}

}  // namespace

// The handlers are looked up by name (ctypes); the rest of the library stays hidden.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* TorchTpuBatchedMatmulF32(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* TorchTpuBatchedMatmulBF16(XLA_FFI_CallFrame*);

#define BATCHED_MATMUL_HANDLER(name, D, T)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (impl<D, T>),                                          \
                                ffi::Ffi::Bind()                                             \
                                    .Ctx<ffi::ThreadPool>()                                  \
                                    .Arg<ffi::Buffer<D>>()                                   \
                                    .Arg<ffi::Buffer<D>>()                                   \
                                    .Ret<ffi::Buffer<D>>()                                   \
                                    .Attr<bool>("trans_a")                                   \
                                    .Attr<bool>("trans_b"));

BATCHED_MATMUL_HANDLER(TorchTpuBatchedMatmulF32, ffi::F32, float)
BATCHED_MATMUL_HANDLER(TorchTpuBatchedMatmulBF16, ffi::BF16, uint16_t)
