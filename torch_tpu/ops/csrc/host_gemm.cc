// 2-D matrix products for XLA:CPU on the BLAS CPU torch runs (an XLA FFI custom call,
// torch_tpu/ops/host_gemm.py).
//
// out = op(a) @ op(b), op transposing when its flag is set. XLA:CPU's own dot runs fp32 GEMMs at
// ~0.8x of MKL's sgemm on one core, and bf16 ones below MKL's bf16 GEMM where the CPU has no AMX;
// a step whose towers are these GEMMs (DLRM's MLPs) is then slower as one program than in CPU
// torch. The GEMM routines are MKL's, taken from the libtorch_cpu already loaded in the process
// (their addresses are handed over by torch_tpu_host_gemm_bind, so this library links to nothing):
// sgemm_ for float32, cblas_gemm_bf16bf16f32 for bfloat16 operands (float32 result, which the
// caller rounds once), on one thread: the kernel is used where a process has one core (a rank of
// several on this host), see host_gemm.py.

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Sgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
// cblas_gemm_bf16bf16f32(layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
using GemmBf16 = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                          float*, int);
using SetLocalThreads = int (*)(int);

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // MKL's CBLAS enum values

Sgemm sgemm = nullptr;
GemmBf16 gemm_bf16 = nullptr;
SetLocalThreads set_local_threads = nullptr;

struct Dims {
  int64_t m, n, k;
};

ffi::ErrorOr<Dims> dims_of(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b, ffi::Span<const int64_t> out,
                           bool trans_a, bool trans_b) {
  if (a.size() != 2 || b.size() != 2 || out.size() != 2)
    return ffi::Unexpected(ffi::Error::InvalidArgument("host_gemm: operands must be 2-D"));
  const Dims d{trans_a ? a[1] : a[0], trans_b ? b[0] : b[1], trans_a ? a[0] : a[1]};
  if ((trans_b ? b[1] : b[0]) != d.k || out[0] != d.m || out[1] != d.n)
    return ffi::Unexpected(ffi::Error::InvalidArgument("host_gemm: operand shapes do not match"));
  if (std::max({d.m, d.n, d.k}) > INT32_MAX)
    return ffi::Unexpected(ffi::Error::InvalidArgument("host_gemm: a dim exceeds the BLAS's int32"));
  return d;
}

// Row-major out = op(a) op(b) is column-major out^T = op(b)^T op(a)^T: the operands swap places.
ffi::Error gemm_f32(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                    ffi::ResultBuffer<ffi::F32> out, bool trans_a, bool trans_b) {
  auto d = dims_of(a.dimensions(), b.dimensions(), out->dimensions(), trans_a, trans_b);
  if (d.has_error()) return d.error();
  const int m = d->m, n = d->n, k = d->k;
  if (m == 0 || n == 0) return ffi::Error::Success();
  const int lda = trans_a ? m : k, ldb = trans_b ? k : n;
  const float one = 1.0f, zero = 0.0f;
  set_local_threads(1);
  sgemm(trans_b ? "T" : "N", trans_a ? "T" : "N", &n, &m, &k, &one, b.typed_data(), &ldb, a.typed_data(), &lda,
        &zero, out->typed_data(), &n);
  return ffi::Error::Success();
}

ffi::Error gemm_bf16_f32(ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                         ffi::ResultBuffer<ffi::F32> out, bool trans_a, bool trans_b) {
  auto d = dims_of(a.dimensions(), b.dimensions(), out->dimensions(), trans_a, trans_b);
  if (d.has_error()) return d.error();
  const int m = d->m, n = d->n, k = d->k;
  if (m == 0 || n == 0) return ffi::Error::Success();
  set_local_threads(1);
  gemm_bf16(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, m, n, k, 1.0f,
            reinterpret_cast<const uint16_t*>(a.typed_data()), trans_a ? m : k,
            reinterpret_cast<const uint16_t*>(b.typed_data()), trans_b ? k : n, 0.0f, out->typed_data(), n);
  return ffi::Error::Success();
}

}  // namespace

// Hands over MKL's routines (addresses in the loaded libtorch_cpu); the handlers need all three.
extern "C" __attribute__((visibility("default"))) void torch_tpu_host_gemm_bind(void* sgemm_fn, void* gemm_bf16_fn,
                                                                               void* set_threads_fn) {
  sgemm = reinterpret_cast<Sgemm>(sgemm_fn);
  gemm_bf16 = reinterpret_cast<GemmBf16>(gemm_bf16_fn);
  set_local_threads = reinterpret_cast<SetLocalThreads>(set_threads_fn);
}

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* TorchTpuHostGemmF32(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* TorchTpuHostGemmBF16(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchTpuHostGemmF32, gemm_f32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchTpuHostGemmBF16, gemm_bf16_f32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
