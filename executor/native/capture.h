// Capture (capture.cpp): a training step's ATen ops answered by one C++ kernel while a worker
// thread computes them. Its Python side is executor/capture.py.
#pragma once

#include <pybind11/pybind11.h>

namespace coexec {

// Add the ``Capture`` class and ``is_placeholder`` to the native module.
void bind_capture(pybind11::module_& m);

}  // namespace coexec
