// Compiled host preprocessing: the same outputs as sparsecore/preprocess.py, byte for byte.
//
// One call builds every stacked table of a batch. Work is split into one task per (stack, source
// SparseCore) and, for the row-ordered output, one per (stack, destination SparseCore); tasks run
// on a few threads with the GIL released and read the callers' arrays in place.
//
// Per source SparseCore (chunk) k of a stack: every id of the chunk's samples becomes the element
// (physical row << 32 | input position); a stable LSD radix sort by physical row (= destination
// SparseCore, shard row) keeps input order inside a row, which is sample order, so equal
// (row, sample) pairs are adjacent and their gains are summed in input order (float32 adds, as
// jax-tpu-embedding's C++ and the numpy path). The partition limits are applied while merging;
// the CSR buffers (or the kept entries, for the row-ordered output) are written in that pass.
//
// Built with -ffp-contract=off: float32 rounding must follow the numpy reference exactly.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

constexpr int32_t kPaddingId = 0x7fffffff;
constexpr int64_t kAlign = 8;
enum Combiner { kSum = 0, kMean = 1, kSqrtn = 2 };

int64_t RoundUp(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

int BitWidth(uint64_t v) {
  int bits = 0;
  while (v) {
    ++bits;
    v >>= 1;
  }
  return bits;
}

struct Feature {
  const void* ids = nullptr;
  bool ids64 = true;
  Py_ssize_t num_ids = 0;
  const void* lengths = nullptr;
  bool lengths64 = true;
  Py_ssize_t num_lengths = 0;
  const float* weights = nullptr;
  int64_t batch = 0;
  int64_t sample_base = 0;  // the feature's first chunk-local sample id
  int64_t col_offset = 0;
  int64_t col_shift = 0;
  std::vector<int64_t> chunk_start;  // first value of each chunk, [chunks + 1]

  int64_t Length(int64_t i) const {
    return lengths64 ? static_cast<const int64_t*>(lengths)[i] : static_cast<const int32_t*>(lengths)[i];
  }
};

// The kept, merged entries of one chunk in (physical row, sample) order (row-ordered output only).
struct ChunkEntries {
  std::vector<uint32_t> phys;
  std::vector<int32_t> sample;
  std::vector<float> gain;
  std::vector<int64_t> dest_start;  // [n + 1]
};

struct Stack {
  std::vector<Feature> features;
  int64_t n = 0, chunks = 0, shard_rows = 0, max_ids = 0, max_unique = 0, region = 0, width = 0;
  int64_t samples_per_chunk = 0;
  int combiner = kSum;
  bool row_ordered = false;
  // CSR outputs [chunks * width] and [chunks * region]
  int32_t* pointers = nullptr;
  int32_t* embedding_ids = nullptr;
  int32_t* sample_ids = nullptr;
  float* gains = nullptr;
  // row-ordered outputs [capacity]
  int64_t* out_phys = nullptr;
  int64_t* out_sample = nullptr;
  float* out_gain = nullptr;
  int64_t capacity = 0;
  // stats [chunks * n], before dropping
  int64_t* counts = nullptr;
  int64_t* unique_counts = nullptr;

  std::vector<int64_t> dropped;  // per chunk: input ids dropped
  std::vector<ChunkEntries> kept;
  int64_t total_kept = 0;
  std::mutex error_mutex;
  std::string error;

  void Fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (error.empty()) error = message;
  }
};

// Stable LSD radix sort of elements by their bits [32, 32 + key_bits); returns the sorted buffer
// (a or tmp). The low 32 bits (input position, increasing) ride along, so the result is also in
// plain ascending uint64 order.
uint64_t* RadixSortHigh(uint64_t* a, uint64_t* tmp, size_t m, int key_bits) {
  if (m < 2 || key_bits <= 0) return a;
  if (m <= 48) {  // insertion sort: elements are unique, so plain order is the stable order
    for (size_t i = 1; i < m; ++i) {
      uint64_t v = a[i];
      size_t j = i;
      while (j > 0 && a[j - 1] > v) {
        a[j] = a[j - 1];
        --j;
      }
      a[j] = v;
    }
    return a;
  }
  const int max_digit = m > (size_t{1} << 12) ? 12 : 8;  // measured: 12-bit digits beat 8 and 11 from 4k up
  const int passes = (key_bits + max_digit - 1) / max_digit;
  const int digit = (key_bits + passes - 1) / passes;
  const size_t buckets = size_t{1} << digit;
  const uint64_t mask = buckets - 1;
  std::vector<size_t> hist(static_cast<size_t>(passes) * buckets, 0);
  for (size_t i = 0; i < m; ++i) {
    uint64_t key = a[i] >> 32;
    for (int p = 0; p < passes; ++p) ++hist[p * buckets + ((key >> (p * digit)) & mask)];
  }
  uint64_t* src = a;
  uint64_t* dst = tmp;
  for (int p = 0; p < passes; ++p) {
    size_t* h = &hist[p * buckets];
    const int shift = 32 + p * digit;
    if (h[(src[0] >> shift) & mask] == m) continue;  // one digit value: nothing moves
    size_t sum = 0;
    for (size_t b = 0; b < buckets; ++b) {
      size_t c = h[b];
      h[b] = sum;
      sum += c;
    }
    for (size_t i = 0; i < m; ++i) {
      uint64_t v = src[i];
      dst[h[(v >> shift) & mask]++] = v;
    }
    std::swap(src, dst);
  }
  return src;
}

struct Scratch {
  std::vector<uint64_t> a, b;
  std::vector<int32_t> sample;
  std::vector<float> gain;
};

// Gains of one sample's ids with the combiner folded in, rounded as the numpy reference.
inline void SampleGains(const Feature& f, int combiner, int64_t v, int64_t len, float* out) {
  const float* w = f.weights + v;
  if (combiner == kSum) {
    for (int64_t j = 0; j < len; ++j) out[j] = w[j];
    return;
  }
  float total;
  if (combiner == kMean) {
    total = w[0];
    for (int64_t j = 1; j < len; ++j) total += w[j];
  } else {
    total = w[0] * w[0];
    for (int64_t j = 1; j < len; ++j) total = std::fma(w[j], w[j], total);
    total = std::sqrt(total);
  }
  for (int64_t j = 0; j < len; ++j) out[j] = w[j] / total;
}

// Appends the elements of feature f's samples in chunk k at s[pos...]; returns the new pos.
template <typename IdT, typename LenT>
int64_t GenerateFeature(const Stack& st, const Feature& f, int64_t k, int64_t pos, Scratch& s, uint64_t* max_phys,
                        bool* bad) {
  const int64_t n = st.n, shard_rows = st.shard_rows, col_shift = f.col_shift, col_offset = f.col_offset;
  int log2n = 0;
  while ((int64_t{1} << log2n) < n) ++log2n;
  const IdT* ids = static_cast<const IdT*>(f.ids);
  const LenT* lengths = static_cast<const LenT*>(f.lengths);
  const int64_t per_chunk = f.batch / st.chunks;
  uint64_t* elements = s.a.data();
  int32_t* samples = s.sample.data();
  uint64_t high = *max_phys;
  bool out_of_range = false;
  int64_t v = f.chunk_start[k];
  for (int64_t i = k * per_chunk, local = f.sample_base; i < (k + 1) * per_chunk; ++i, ++local) {
    const int64_t len = lengths[i];
    SampleGains(f, st.combiner, v, len, &s.gain[pos]);
    for (int64_t j = 0; j < len; ++j, ++pos) {
      const int64_t id = ids[v + j];
      // n is a power of two; two's complement shift/mask have numpy's floor semantics
      const int64_t dest = ((id & (n - 1)) + col_shift) & (n - 1);
      const int64_t row = (id + col_offset) >> log2n;
      out_of_range |= static_cast<uint64_t>(row) >= static_cast<uint64_t>(shard_rows);
      const uint64_t phys = static_cast<uint64_t>(dest * shard_rows + row);
      high = std::max(high, phys);
      elements[pos] = phys << 32 | static_cast<uint64_t>(pos);
      samples[pos] = static_cast<int32_t>(local);
    }
    v += len;
  }
  *max_phys = high;
  *bad |= out_of_range;
  return pos;
}

// Fills [p, p + count) with `value`; large runs with streaming stores (the buffers are mostly
// padding and are not read back here).
template <typename T>
void Fill(T* p, int64_t count, T value) {
  static_assert(sizeof(T) == 4, "32-bit values");
#ifdef __SSE2__
  while (count > 0 && (reinterpret_cast<uintptr_t>(p) & 15)) {
    *p++ = value;
    --count;
  }
  if (count >= 1024) {
    int32_t bits;
    std::memcpy(&bits, &value, 4);
    const __m128i v = _mm_set1_epi32(bits);
    for (; count >= 4; count -= 4, p += 4) _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);
    _mm_sfence();
  }
#endif
  for (; count > 0; --count) *p++ = value;
}

void ProcessChunk(Stack& st, int64_t k, Scratch& s) {
  const int64_t n = st.n;
  int64_t m = 0;
  for (const Feature& f : st.features) m += f.chunk_start[k + 1] - f.chunk_start[k];
  if (m >= (int64_t{1} << 32)) {
    st.Fail("more than 2^32 ids in one chunk");
    return;
  }
  s.a.resize(m);
  s.b.resize(m);
  s.sample.resize(m);
  s.gain.resize(m);
  uint64_t max_phys = 0;
  bool bad = false;
  int64_t pos = 0;
  for (const Feature& f : st.features) {
    if (f.ids64) {
      pos = f.lengths64 ? GenerateFeature<int64_t, int64_t>(st, f, k, pos, s, &max_phys, &bad)
                        : GenerateFeature<int64_t, int32_t>(st, f, k, pos, s, &max_phys, &bad);
    } else {
      pos = f.lengths64 ? GenerateFeature<int32_t, int64_t>(st, f, k, pos, s, &max_phys, &bad)
                        : GenerateFeature<int32_t, int32_t>(st, f, k, pos, s, &max_phys, &bad);
    }
  }
  if (bad) {
    st.Fail("an id maps outside the stacked table (ids must be validated: 0 <= id < vocab)");
    return;
  }
  const uint64_t* sorted = RadixSortHigh(s.a.data(), s.b.data(), m, BitWidth(max_phys));

  int64_t* counts = st.counts + k * n;
  int64_t* unique_counts = st.unique_counts + k * n;
  std::fill(counts, counts + n, 0);
  std::fill(unique_counts, unique_counts + n, 0);
  int32_t* pointers = st.row_ordered ? nullptr : st.pointers + k * st.width;
  int32_t* ids_out = st.row_ordered ? nullptr : st.embedding_ids + k * st.region;
  int32_t* samples_out = st.row_ordered ? nullptr : st.sample_ids + k * st.region;
  float* gains_out = st.row_ordered ? nullptr : st.gains + k * st.region;
  ChunkEntries* kept = st.row_ordered ? &st.kept[k] : nullptr;
  if (kept) {
    kept->phys.clear();
    kept->sample.clear();
    kept->gain.clear();
    kept->phys.reserve(m);
    kept->sample.reserve(m);
    kept->gain.reserve(m);
    kept->dest_start.assign(n + 1, 0);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto pad = [&](int64_t from, int64_t to) {
    Fill(ids_out + from, to - from, kPaddingId);
    Fill(samples_out + from, to - from, kPaddingId);
    Fill(gains_out + from, to - from, nan);
  };

  int64_t dest = -1, boundary = 0, start = 0, rank = 0, unique = 0, kept_in = 0, dropped = 0;
  uint64_t prev_phys = ~uint64_t{0};
  int32_t prev_sample = -1;
  bool prev_kept = false;
  auto close_partition = [&]() {  // ends partition `dest`: pointer, padding, next start
    if (dest < 0) return;
    counts[dest] = rank;
    unique_counts[dest] = unique;
    if (kept) {
      kept->dest_start[dest + 1] = static_cast<int64_t>(kept->phys.size());
    } else {
      pointers[dest] = static_cast<int32_t>(start + kept_in);
      const int64_t end = start + RoundUp(kept_in);
      pad(start + kept_in, end);
      start = end;
    }
  };
  auto open_partition = [&](int64_t d) {  // partitions between `dest` and d stay empty
    for (int64_t e = dest + 1; e < d; ++e) {
      if (kept) kept->dest_start[e + 1] = static_cast<int64_t>(kept->phys.size());
      else pointers[e] = static_cast<int32_t>(start);
    }
    dest = d;
    boundary = (d + 1) * st.shard_rows;
    rank = unique = kept_in = 0;
    prev_phys = ~uint64_t{0};
    prev_sample = -1;
  };
  for (int64_t i = 0; i < m; ++i) {
    const uint64_t e = sorted[i];
    const uint64_t phys = e >> 32;
    const uint32_t p = static_cast<uint32_t>(e);
    const int32_t sample = s.sample[p];
    const float gain = s.gain[p];
    if (static_cast<int64_t>(phys) >= boundary) {
      close_partition();
      open_partition(static_cast<int64_t>(phys) / st.shard_rows);
    }
    if (phys == prev_phys && sample == prev_sample) {  // same (row, sample): merge
      if (prev_kept) {
        if (kept) kept->gain.back() += gain;
        else gains_out[start + kept_in - 1] += gain;
      } else {
        ++dropped;
      }
      continue;
    }
    const bool new_row = phys != prev_phys;
    const int64_t unique_rank = new_row ? unique : unique - 1;
    if (new_row) ++unique;
    prev_kept = rank < st.max_ids && unique_rank < st.max_unique;
    ++rank;
    prev_phys = phys;
    prev_sample = sample;
    if (!prev_kept) {
      ++dropped;
      continue;
    }
    if (kept) {
      kept->phys.push_back(static_cast<uint32_t>(phys));
      kept->sample.push_back(sample);
      kept->gain.push_back(gain);
    } else {
      const int64_t at = start + kept_in;
      ids_out[at] = static_cast<int32_t>(static_cast<int64_t>(phys) - dest * st.shard_rows);
      samples_out[at] = sample;
      gains_out[at] = gain;
    }
    ++kept_in;
  }
  close_partition();
  open_partition(n);
  if (!kept) {
    for (int64_t e = n; e < st.width; ++e) pointers[e] = static_cast<int32_t>(start);
    pad(start, st.region);
  }
  st.dropped[k] = dropped;
}

// Row-ordered output of destination SparseCore d: the kept entries of every chunk for d, by
// (physical row, chunk, sample); written at the offset of d in the dest-major output.
void ProcessDest(Stack& st, int64_t d, int64_t out_offset, Scratch& s) {
  int64_t m = 0;
  for (const ChunkEntries& c : st.kept) m += c.dest_start[d + 1] - c.dest_start[d];
  s.a.resize(m);
  s.b.resize(m);
  s.sample.resize(m);
  s.gain.resize(m);
  const uint64_t first_row = static_cast<uint64_t>(d * st.shard_rows);
  int64_t pos = 0;
  for (int64_t k = 0; k < st.chunks; ++k) {
    const ChunkEntries& c = st.kept[k];
    for (int64_t i = c.dest_start[d]; i < c.dest_start[d + 1]; ++i, ++pos) {
      s.a[pos] = (static_cast<uint64_t>(c.phys[i]) - first_row) << 32 | static_cast<uint64_t>(pos);
      s.sample[pos] = static_cast<int32_t>(k * st.samples_per_chunk + c.sample[i]);
      s.gain[pos] = c.gain[i];
    }
  }
  const uint64_t* sorted = st.chunks == 1 ? s.a.data()
                                          : RadixSortHigh(s.a.data(), s.b.data(), m, BitWidth(st.shard_rows - 1));
  for (int64_t i = 0; i < m; ++i) {
    const uint64_t e = sorted[i];
    const uint32_t p = static_cast<uint32_t>(e);
    st.out_phys[out_offset + i] = static_cast<int64_t>((e >> 32) + first_row);
    st.out_sample[out_offset + i] = s.sample[p];
    st.out_gain[out_offset + i] = s.gain[p];
  }
}

// First value of every chunk of a feature; checks lengths against the ids.
void ChunkStarts(Stack& st, Feature& f) {
  f.chunk_start.assign(st.chunks + 1, 0);
  const int64_t per_chunk = f.batch / st.chunks;
  int64_t total = 0;
  bool negative = false;
  for (int64_t k = 0; k < st.chunks; ++k) {
    f.chunk_start[k] = total;
    for (int64_t i = k * per_chunk; i < (k + 1) * per_chunk; ++i) {
      const int64_t len = f.Length(i);
      negative |= len < 0;
      total += len;
    }
  }
  f.chunk_start[st.chunks] = total;
  if (negative) st.Fail("negative lengths");
  else if (total != f.num_ids) st.Fail("lengths sum to " + std::to_string(total) + " but there are " +
                                       std::to_string(f.num_ids) + " ids");
}

// Runs fn(task, scratch) for task in [0, count) on up to `threads` threads (the caller is one).
template <typename Fn>
void ParallelFor(int64_t count, int threads, Fn fn) {
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Scratch scratch;
    for (int64_t t; (t = next.fetch_add(1)) < count;) fn(t, scratch);
  };
  const int extra = static_cast<int>(std::min<int64_t>(threads, count)) - 1;
  std::vector<std::thread> pool;
  for (int i = 0; i < extra; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
}

// HighwayHash-64 of a 4-byte input (the hash jax-tpu-embedding buckets column ids with for
// minibatching); the same steps as sparsecore/highway_hash.py, which is the reference.
constexpr uint64_t kMul0[4] = {0xdbe6d5d5fe4cce2fULL, 0xa4093822299f31d0ULL, 0x13198a2e03707344ULL,
                               0x243f6a8885a308d3ULL};
constexpr uint64_t kMul1[4] = {0x3bd39e10cb0ef593ULL, 0xc0acf169b5f18a8cULL, 0xbe5466cf34e90c6cULL,
                               0x452821e638d01377ULL};

struct HighwayState {
  uint64_t v0[4], v1[4], mul0[4], mul1[4];
};

uint64_t SwapHalves(uint64_t x) { return (x >> 32) | (x << 32); }

void ZipperMergeAndAdd(uint64_t v1, uint64_t v0, uint64_t* add1, uint64_t* add0) {
  *add0 += (((v0 & 0xff000000ULL) | (v1 & 0xff00000000ULL)) >> 24) |
           (((v0 & 0xff0000000000ULL) | (v1 & 0xff000000000000ULL)) >> 16) | (v0 & 0xff0000ULL) |
           ((v0 & 0xff00ULL) << 32) | ((v1 & 0xff00000000000000ULL) >> 8) | (v0 << 56);
  *add1 += (((v1 & 0xff000000ULL) | (v0 & 0xff00000000ULL)) >> 24) | (v1 & 0xff0000ULL) |
           ((v1 & 0xff0000000000ULL) >> 16) | ((v1 & 0xff00ULL) << 24) | ((v0 & 0xff000000000000ULL) >> 8) |
           ((v1 & 0xffULL) << 48) | (v0 & 0xff00000000000000ULL);
}

void HighwayUpdate(HighwayState& s, const uint64_t lanes[4]) {
  for (int i = 0; i < 4; ++i) {
    s.v1[i] += s.mul0[i] + lanes[i];
    s.mul0[i] ^= (s.v1[i] & 0xffffffffULL) * (s.v0[i] >> 32);
    s.v0[i] += s.mul1[i];
    s.mul1[i] ^= (s.v0[i] & 0xffffffffULL) * (s.v1[i] >> 32);
  }
  ZipperMergeAndAdd(s.v1[1], s.v1[0], &s.v0[1], &s.v0[0]);
  ZipperMergeAndAdd(s.v1[3], s.v1[2], &s.v0[3], &s.v0[2]);
  ZipperMergeAndAdd(s.v0[1], s.v0[0], &s.v1[1], &s.v1[0]);
  ZipperMergeAndAdd(s.v0[3], s.v0[2], &s.v1[3], &s.v1[2]);
}

uint64_t HighwayHash4(uint32_t word, const uint64_t key[4]) {
  HighwayState s;
  for (int i = 0; i < 4; ++i) {
    s.v0[i] = kMul0[i] ^ key[i];
    s.v1[i] = kMul1[i] ^ SwapHalves(key[i]);
    s.mul0[i] = kMul0[i];
    s.mul1[i] = kMul1[i];
  }
  for (int i = 0; i < 4; ++i) {  // the remainder packet of a 4-byte input
    s.v0[i] += (uint64_t{4} << 32) + 4;
    const uint64_t lo = s.v1[i] & 0xffffffffULL, hi = s.v1[i] >> 32;
    s.v1[i] = (((lo << 4) | (lo >> 28)) & 0xffffffffULL) | ((((hi << 4) | (hi >> 28)) & 0xffffffffULL) << 32);
  }
  const uint64_t packet[4] = {word, 0, 0, 0};
  HighwayUpdate(s, packet);
  for (int round = 0; round < 4; ++round) {
    const uint64_t permuted[4] = {SwapHalves(s.v0[2]), SwapHalves(s.v0[3]), SwapHalves(s.v0[0]), SwapHalves(s.v0[1])};
    HighwayUpdate(s, permuted);
  }
  return s.v0[0] + s.v1[0] + s.mul0[0] + s.mul1[0];
}

// ---- Python glue ----

// Holds the buffer views of one call; every array is C-contiguous and 1-D.
struct Buffers {
  std::vector<Py_buffer> views;
  ~Buffers() {
    for (Py_buffer& v : views) PyBuffer_Release(&v);
  }
  // The data of an array of struct format in `formats` and item size 4 or 8 (`itemsize`, 0 = either),
  // with `expected` entries (-1 = any); nullptr with a Python error set otherwise.
  void* Get(PyObject* obj, const char* what, const char* formats, int itemsize, bool writable,
            Py_ssize_t expected, Py_ssize_t* size = nullptr, bool* wide = nullptr) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0)
      return nullptr;
    views.push_back(view);
    const char* fmt = view.format ? view.format : "B";
    if (*fmt == '=' || *fmt == '<' || *fmt == '@') ++fmt;
    const bool size_ok = itemsize ? view.itemsize == itemsize : (view.itemsize == 4 || view.itemsize == 8);
    if (view.ndim != 1 || std::strlen(fmt) != 1 || !std::strchr(formats, *fmt) || !size_ok) {
      PyErr_Format(PyExc_TypeError, "%s: expected a contiguous 1-D array of format %s, got format %s, itemsize %zd, "
                   "%d dims", what, formats, fmt, view.itemsize, view.ndim);
      return nullptr;
    }
    if (expected >= 0 && view.shape[0] != expected) {
      PyErr_Format(PyExc_ValueError, "%s: %zd entries, expected %zd", what, view.shape[0], expected);
      return nullptr;
    }
    if (size) *size = view.shape[0];
    if (wide) *wide = view.itemsize == 8;
    return view.buf;
  }
};

bool CheckTuple(PyObject* obj, Py_ssize_t size, const char* what) {
  if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) == size) return true;
  PyErr_Format(PyExc_TypeError, "%s must be a tuple of %zd items", what, size);
  return false;
}

// Reads tuple items from `first` on as integers.
bool Ints(PyObject* tuple, Py_ssize_t first, std::initializer_list<int64_t*> out) {
  Py_ssize_t i = first;
  for (int64_t* target : out) {
    *target = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i++));
    if (*target == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// feature = (ids, lengths, weights, batch, sample_base, col_offset, col_shift)
bool ParseFeature(PyObject* obj, Buffers& buffers, Feature* f) {
  if (!CheckTuple(obj, 7, "feature")) return false;
  f->ids = buffers.Get(PyTuple_GET_ITEM(obj, 0), "ids", "ilq", 0, false, -1, &f->num_ids, &f->ids64);
  if (!f->ids || !Ints(obj, 3, {&f->batch, &f->sample_base, &f->col_offset, &f->col_shift}))
    return false;
  f->lengths = buffers.Get(PyTuple_GET_ITEM(obj, 1), "lengths", "ilq", 0, false, f->batch, nullptr, &f->lengths64);
  f->weights = static_cast<const float*>(buffers.Get(PyTuple_GET_ITEM(obj, 2), "weights", "f", 4, false, f->num_ids));
  return f->lengths && f->weights;
}

// stack = (features, (n, chunks, shard_rows, max_ids, max_unique, region, width, combiner,
//          row_ordered), outputs); outputs = (row_pointers, embedding_ids, sample_ids, gains,
//          counts, unique_counts) for CSR, (phys, sample, gain, counts, unique_counts) for row order.
bool ParseStack(PyObject* obj, Buffers& buffers, Stack* st) {
  if (!CheckTuple(obj, 3, "stack")) return false;
  PyObject* features = PyTuple_GET_ITEM(obj, 0);
  PyObject* params = PyTuple_GET_ITEM(obj, 1);
  PyObject* outputs = PyTuple_GET_ITEM(obj, 2);
  if (!PyList_Check(features)) return PyErr_SetString(PyExc_TypeError, "features must be a list"), false;
  int64_t combiner, row_ordered;
  if (!CheckTuple(params, 9, "stack parameters") ||
      !Ints(params, 0, {&st->n, &st->chunks, &st->shard_rows, &st->max_ids, &st->max_unique, &st->region, &st->width,
                     &combiner, &row_ordered}))
    return false;
  if (st->n < 1 || (st->n & (st->n - 1)) || st->chunks < 1 || st->shard_rows < 1 || st->width < st->n || combiner < kSum ||
      combiner > kSqrtn || st->shard_rows * st->n > (int64_t{1} << 32))
    return PyErr_SetString(PyExc_ValueError, "bad stack parameters"), false;
  st->combiner = static_cast<int>(combiner);
  st->row_ordered = row_ordered != 0;
  st->features.resize(PyList_GET_SIZE(features));
  int64_t total_samples = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(features); ++i) {
    Feature& f = st->features[i];
    if (!ParseFeature(PyList_GET_ITEM(features, i), buffers, &f)) return false;
    if (f.batch % st->chunks)
      return PyErr_SetString(PyExc_ValueError, "a batch size is not divisible by the chunks"), false;
    total_samples += f.batch;
  }
  st->samples_per_chunk = total_samples / st->chunks;
  const Py_ssize_t stats = st->chunks * st->n, region = st->chunks * st->region;
  auto get = [&](Py_ssize_t i, const char* what, const char* fmt, Py_ssize_t expected, Py_ssize_t* size = nullptr) {
    return buffers.Get(PyTuple_GET_ITEM(outputs, i), what, fmt, fmt[0] == 'f' || fmt[0] == 'i' ? 4 : 8, true,
                       expected, size);
  };
  Py_ssize_t first_stat;
  if (st->row_ordered) {
    if (!CheckTuple(outputs, 5, "row-ordered outputs")) return false;
    if (!(st->out_phys = static_cast<int64_t*>(get(0, "phys", "lq", -1, &st->capacity))) ||
        !(st->out_sample = static_cast<int64_t*>(get(1, "sample", "lq", st->capacity))) ||
        !(st->out_gain = static_cast<float*>(get(2, "gain", "f", st->capacity))))
      return false;
    first_stat = 3;
  } else {
    if (!CheckTuple(outputs, 6, "CSR outputs")) return false;
    if (!(st->pointers = static_cast<int32_t*>(get(0, "row_pointers", "i", st->chunks * st->width))) ||
        !(st->embedding_ids = static_cast<int32_t*>(get(1, "embedding_ids", "i", region))) ||
        !(st->sample_ids = static_cast<int32_t*>(get(2, "sample_ids", "i", region))) ||
        !(st->gains = static_cast<float*>(get(3, "gains", "f", region))))
      return false;
    first_stat = 4;
  }
  if (!(st->counts = static_cast<int64_t*>(get(first_stat, "counts", "lq", stats))) ||
      !(st->unique_counts = static_cast<int64_t*>(get(first_stat + 1, "unique_counts", "lq", stats))))
    return false;
  st->dropped.assign(st->chunks, 0);
  if (st->row_ordered) st->kept.resize(st->chunks);
  return true;
}

// preprocess(stacks: list, threads: int) -> list of (dropped ids, kept entries) per stack
PyObject* Preprocess(PyObject*, PyObject* args) {
  PyObject* stacks_obj;
  int threads;
  if (!PyArg_ParseTuple(args, "O!i", &PyList_Type, &stacks_obj, &threads)) return nullptr;
  Buffers buffers;
  const Py_ssize_t count = PyList_GET_SIZE(stacks_obj);
  std::vector<Stack> stacks(count);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!ParseStack(PyList_GET_ITEM(stacks_obj, i), buffers, &stacks[i])) return nullptr;
  }
  threads = std::max(threads, 1);
  Py_BEGIN_ALLOW_THREADS
  std::vector<std::pair<Stack*, Feature*>> features;
  for (Stack& st : stacks)
    for (Feature& f : st.features) features.emplace_back(&st, &f);
  ParallelFor(static_cast<int64_t>(features.size()), threads,
              [&](int64_t t, Scratch&) { ChunkStarts(*features[t].first, *features[t].second); });
  std::vector<std::pair<Stack*, int64_t>> chunk_tasks;
  for (Stack& st : stacks)
    if (st.error.empty())
      for (int64_t k = 0; k < st.chunks; ++k) chunk_tasks.emplace_back(&st, k);
  ParallelFor(static_cast<int64_t>(chunk_tasks.size()), threads,
              [&](int64_t t, Scratch& s) { ProcessChunk(*chunk_tasks[t].first, chunk_tasks[t].second, s); });
  std::vector<std::tuple<Stack*, int64_t, int64_t>> dest_tasks;
  for (Stack& st : stacks) {
    if (!st.row_ordered || !st.error.empty()) continue;
    int64_t offset = 0;
    for (int64_t d = 0; d < st.n; ++d) {
      dest_tasks.emplace_back(&st, d, offset);
      for (const ChunkEntries& c : st.kept) offset += c.dest_start[d + 1] - c.dest_start[d];
    }
    st.total_kept = offset;
    if (offset > st.capacity) st.Fail("row-ordered output too small");
  }
  ParallelFor(static_cast<int64_t>(dest_tasks.size()), threads, [&](int64_t t, Scratch& s) {
    Stack& st = *std::get<0>(dest_tasks[t]);
    if (st.error.empty()) ProcessDest(st, std::get<1>(dest_tasks[t]), std::get<2>(dest_tasks[t]), s);
  });
  Py_END_ALLOW_THREADS
  for (Stack& st : stacks) {
    if (!st.error.empty()) {
      PyErr_SetString(PyExc_ValueError, st.error.c_str());
      return nullptr;
    }
  }
  PyObject* result = PyList_New(count);
  if (!result) return nullptr;
  for (Py_ssize_t i = 0; i < count; ++i) {
    int64_t dropped = 0;
    for (int64_t d : stacks[i].dropped) dropped += d;
    PyList_SET_ITEM(result, i, Py_BuildValue("(LL)", static_cast<long long>(dropped),
                                             static_cast<long long>(stacks[i].total_kept)));
  }
  return result;
}

// fill_slots(sample, phys, gain, slots, slot_rows, slot_gains): slot k of activation row r gets
// r's k-th entry in entry order (the xla backend's gather form of the forward); slot_rows and
// slot_gains are [slots, rows] flattened, pre-filled with the empty slot's values.
PyObject* FillSlots(PyObject*, PyObject* args) {
  PyObject *sample_obj, *phys_obj, *gain_obj, *rows_obj, *gains_obj;
  Py_ssize_t slots;
  if (!PyArg_ParseTuple(args, "OOOnOO", &sample_obj, &phys_obj, &gain_obj, &slots, &rows_obj, &gains_obj))
    return nullptr;
  Buffers buffers;
  Py_ssize_t entries = 0, cells = 0;
  const int64_t* sample = nullptr;
  const int64_t* phys = nullptr;
  const float* gain = nullptr;
  int32_t* slot_rows = nullptr;
  float* slot_gains = nullptr;
  if (!(sample = static_cast<const int64_t*>(buffers.Get(sample_obj, "sample", "lq", 8, false, -1, &entries))) ||
      !(phys = static_cast<const int64_t*>(buffers.Get(phys_obj, "phys", "lq", 8, false, entries))) ||
      !(gain = static_cast<const float*>(buffers.Get(gain_obj, "gain", "f", 4, false, entries))) ||
      !(slot_rows = static_cast<int32_t*>(buffers.Get(rows_obj, "slot_rows", "i", 4, true, -1, &cells))) ||
      !(slot_gains = static_cast<float*>(buffers.Get(gains_obj, "slot_gains", "f", 4, true, cells))))
    return nullptr;
  if (slots < 1 || cells % slots) return PyErr_SetString(PyExc_ValueError, "slot arrays must hold slots x rows"), nullptr;
  const Py_ssize_t width = cells / slots;
  bool outside = false;
  Py_BEGIN_ALLOW_THREADS
  std::vector<int32_t> used(width, 0);
  for (Py_ssize_t i = 0; i < entries; ++i) {
    const int64_t r = sample[i];
    if (r < 0 || r >= width || used[r] >= slots) {
      outside = true;
      break;
    }
    const Py_ssize_t at = static_cast<Py_ssize_t>(used[r]++) * width + r;
    slot_rows[at] = static_cast<int32_t>(phys[i]);
    slot_gains[at] = gain[i];
  }
  Py_END_ALLOW_THREADS
  if (outside) return PyErr_SetString(PyExc_ValueError, "an entry's sample is outside the rows or the slots"), nullptr;
  Py_RETURN_NONE;
}

// highway_hash(values, key, out): out[i] = HighwayHash-64 of int32 values[i]'s 4 bytes under
// key (4 unsigned 64-bit ints).
PyObject* HighwayHash(PyObject*, PyObject* args) {
  PyObject *values_obj, *key_obj, *out_obj;
  if (!PyArg_ParseTuple(args, "OOO", &values_obj, &key_obj, &out_obj)) return nullptr;
  if (!CheckTuple(key_obj, 4, "key")) return nullptr;
  uint64_t key[4];
  for (int i = 0; i < 4; ++i) {
    key[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(key_obj, i));
    if (PyErr_Occurred()) return nullptr;
  }
  Buffers buffers;
  Py_ssize_t size = 0;
  const uint32_t* values = static_cast<const uint32_t*>(buffers.Get(values_obj, "values", "i", 4, false, -1, &size));
  if (!values) return nullptr;
  uint64_t* out = static_cast<uint64_t*>(buffers.Get(out_obj, "out", "LQ", 8, true, size));
  if (!out) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  for (Py_ssize_t i = 0; i < size; ++i) out[i] = HighwayHash4(values[i], key);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"preprocess", Preprocess, METH_VARARGS, "Build the CSR (or row-ordered) inputs of every stack."},
    {"fill_slots", FillSlots, METH_VARARGS, "Lay entries out as [slots, rows] by activation row."},
    {"highway_hash", HighwayHash, METH_VARARGS, "HighwayHash-64 of each int32 under a key."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_sparsecore_native", "Compiled SparseCore host preprocessing.",
                       -1, kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__sparsecore_native() { return PyModule_Create(&kModule); }
