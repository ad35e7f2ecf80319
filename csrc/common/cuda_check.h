// The error policy of the kernel families' host code for the CUDA runtime: every call's cudaError_t is
// looked at, and a failure reaches Python as a RuntimeError naming the family, the operation and the CUDA
// error. Two kinds of host code, two compilers, one convention:
//
//   - Launchers: the nvcc-compiled host functions of the .cu/.cuh files, which set kernel attributes and
//     launch. They include no torch header, throw nothing and print nothing: each returns a cudaError_t,
//     cudaSuccess or the first failure among the CUDA calls it makes (MLA_CUDA_TRY; after a <<<...>>>
//     launch, cudaGetLastError()). A precondition that a launcher finds unmet (the host layer checks each
//     one before it calls, so that is a bug) is returned as the nearest CUDA code: cudaErrorInvalidValue
//     (an argument), cudaErrorInvalidConfiguration (a grid or cluster shape), cudaErrorNotSupported (a
//     variant that is not compiled, or that CUTLASS cannot implement).
//   - Host layers: the g++-compiled *_api.cpp files (torch). Every cudaError_t, from their own CUDA calls
//     and from each launcher, goes through MLA_CUDA_CHECK(expr, what...), which raises a c10::Error through
//     MLA_CHECK (common/checks.h: numbers in `what` are formatted by std::to_string) with the message
//     "<what...>: <cudaGetErrorName>: <cudaGetErrorString>"; `what` starts with the family's name and says
//     which operation failed. Before raising it reads the error off the runtime's last-error slot, so that
//     the next, unrelated launch check (PyTorch's own included) does not report it a second time. In an
//     nvcc-compiled file MLA_CUDA_CHECK does not compile: a launcher returns the error instead.
//
// Launches stay on the caller's stream and nothing here synchronises: a launch reports what the launch
// itself returns; a fault inside a kernel surfaces at the next synchronising call, as anywhere in CUDA.
//
// Also for launchers: opt_in_dynamic_smem<kernel>(bytes) sets cudaFuncAttributeMaxDynamicSharedMemorySize
// once per (kernel, device) instead of before every launch.
#pragma once

#include <array>
#include <atomic>
#include <mutex>

#include <cuda_runtime_api.h>

#include "common/device_info.h"

// In a launcher: return the cudaError_t of `expr` from the enclosing function unless it is cudaSuccess.
#define MLA_CUDA_TRY(expr)                                          \
  do {                                                              \
    const cudaError_t mla_cuda_try_err_ = (expr);                   \
    if (mla_cuda_try_err_ != cudaSuccess) return mla_cuda_try_err_; \
  } while (0)

#if defined(__CUDACC__)
#define MLA_CUDA_CHECK(expr, ...)                                                                        \
  static_assert(false, "MLA_CUDA_CHECK raises, so it belongs to the host layers (*_api.cpp); a launcher " \
                       "returns its cudaError_t (common/cuda_check.h)")
#else
#include "common/checks.h"

#define MLA_CUDA_CHECK(expr, ...)                                                                \
  do {                                                                                           \
    const cudaError_t mla_cuda_err_ = (expr);                                                    \
    if (mla_cuda_err_ != cudaSuccess) {                                                          \
      ::mla::clear_last_cuda_error();                                                            \
      MLA_CHECK(false, __VA_ARGS__, ": ", cudaGetErrorName(mla_cuda_err_), ": ",                 \
                cudaGetErrorString(mla_cuda_err_));                                              \
    }                                                                                            \
  } while (0)

namespace mla {

// Resets the runtime's last-error slot once its error is being raised (what cudaGetLastError() returns
// then is that same error, or cudaSuccess, or a sticky error that every later call reports anyway).
inline void clear_last_cuda_error() { static_cast<void>(cudaGetLastError()); }

}  // namespace mla
#endif

namespace mla {

// Dynamic shared memory a kernel may use without opting in.
inline constexpr int kDefaultDynamicSmemBytes = 48 * 1024;

namespace detail {
// How much dynamic shared memory one kernel is opted in to on each device (0: none).
struct SmemOptIn {
  std::mutex mu;
  std::array<std::atomic<int>, kMaxDevices> bytes{};
};

inline cudaError_t opt_in_dynamic_smem(SmemOptIn& state, const void* kernel, int bytes) {
  if (bytes <= kDefaultDynamicSmemBytes) return cudaSuccess;
  int device = 0;
  MLA_CUDA_TRY(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::atomic<int>& done = state.bytes[device];
  if (bytes <= done.load(std::memory_order_acquire)) return cudaSuccess;
  std::lock_guard<std::mutex> lock(state.mu);
  if (bytes <= done.load(std::memory_order_relaxed)) return cudaSuccess;
  MLA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.store(bytes, std::memory_order_release);
  return cudaSuccess;
}
}  // namespace detail

// Lets kernel `kKernel` launch with `bytes` of dynamic shared memory on the current device (the launchers
// run under the caller's device guard). cudaFuncAttributeMaxDynamicSharedMemorySize belongs to a kernel on
// one device, and a node may mix GPUs, so it is set once per (kernel, device), and set again only when a
// launch asks for more than before (a kernel whose size depends on run-time values, such as the decode
// kernels' stage count, keeps the largest). Thread-safe; a failure is returned, and the next launch tries
// again.
template <auto kKernel>
inline cudaError_t opt_in_dynamic_smem(int bytes) {
  static detail::SmemOptIn state;
  return detail::opt_in_dynamic_smem(state, reinterpret_cast<const void*>(kKernel), bytes);
}

}  // namespace mla
