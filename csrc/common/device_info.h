// The attributes of a CUDA device that the host layers and launchers plan with, read once per device and
// process: a node may mix GPUs, so nothing here is a process-wide value. Plain C++ and the CUDA runtime only
// (no torch headers), so that the nvcc-compiled launchers include it as the g++-compiled host layers do.
#pragma once

#include <array>
#include <mutex>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

namespace mla {

struct DeviceInfo {
  int major = 0, minor = 0;  // compute capability
  int sm_count = 0;          // multiprocessors
  int smem_optin = 0;        // shared memory per block with the opt-in (bytes)
  int smem_per_sm = 0;       // shared memory per multiprocessor (bytes)
  int l2_bytes = 0;          // L2 cache size (bytes)
};

inline constexpr int kMaxDevices = 64;

// Attributes of CUDA device `device` (an index as torch numbers them). Thread-safe; a failed query throws
// std::runtime_error (a Python RuntimeError) and is retried by the next call.
inline const DeviceInfo& device_info(int device) {
  static std::array<DeviceInfo, kMaxDevices> infos;
  static std::array<std::once_flag, kMaxDevices> read;
  if (device < 0 || device >= kMaxDevices) {
    throw std::runtime_error("mla_autograd: CUDA device index " + std::to_string(device) + " out of range [0, " +
                             std::to_string(kMaxDevices) + ")");
  }
  std::call_once(read[device], [device] {
    DeviceInfo d;
    const std::pair<int*, cudaDeviceAttr> attrs[] = {
        {&d.major, cudaDevAttrComputeCapabilityMajor},
        {&d.minor, cudaDevAttrComputeCapabilityMinor},
        {&d.sm_count, cudaDevAttrMultiProcessorCount},
        {&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
        {&d.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor},
        {&d.l2_bytes, cudaDevAttrL2CacheSize},
    };
    for (const auto& [field, attr] : attrs) {
      const cudaError_t err = cudaDeviceGetAttribute(field, attr, device);
      if (err != cudaSuccess) {
        throw std::runtime_error("mla_autograd: cudaDeviceGetAttribute(" + std::to_string(int(attr)) + ") on device " +
                                 std::to_string(device) + ": " + cudaGetErrorString(err));
      }
    }
    infos[device] = d;
  });
  return infos[device];
}

// device_info of the current device (the launchers run under the caller's device guard).
inline const DeviceInfo& current_device_info() {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) throw std::runtime_error(std::string("mla_autograd: cudaGetDevice: ") + cudaGetErrorString(err));
  return device_info(device);
}

}  // namespace mla
