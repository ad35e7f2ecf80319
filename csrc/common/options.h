// The launch-option dicts of the test-only *_with_options entry points: typed reads with errors that name
// the entry point and the key, one rule for every family.
#pragma once

#include <cstdint>
#include <string>

#include <pybind11/pybind11.h>

#include "common/checks.h"

namespace mla {

// The key of one options entry (a str).
inline std::string option_key(const pybind11::handle& key, const char* fn) {
  MLA_CHECK(pybind11::isinstance<pybind11::str>(key), fn, ": options keys must be strings");
  return key.cast<std::string>();
}

// A count in [0, 2^31): an int, not a bool.
inline int option_count(const pybind11::handle& value, const char* fn, const std::string& key) {
  MLA_CHECK(pybind11::isinstance<pybind11::int_>(value) && !pybind11::isinstance<pybind11::bool_>(value), fn,
            ": options['", key, "'] must be an int");
  const int64_t v = value.cast<int64_t>();
  MLA_CHECK(v >= 0 && v < (int64_t(1) << 31), fn, ": options['", key, "'] must be in [0, 2^31), got ", v);
  return int(v);
}

inline bool option_bool(const pybind11::handle& value, const char* fn, const std::string& key) {
  MLA_CHECK(pybind11::isinstance<pybind11::bool_>(value), fn, ": options['", key, "'] must be a bool");
  return value.cast<bool>();
}

}  // namespace mla
