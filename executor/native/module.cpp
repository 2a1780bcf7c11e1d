// The executor's native module (executor/native.py builds and loads it): the engine
// (engine.h), which runs the executor's instructions on a thread of its own without the GIL;
// LiveBytes (live_bytes.h), its count of live memory; the skeleton's Tracker (tracker.h),
// which finds the tensors of a step that died; and Capture (capture.cpp, its own translation
// unit so that the two build in parallel), a step's ATen ops answered in C++.

#include <torch/extension.h>

#include "capture.h"
#include "engine.h"
#include "tracker.h"

namespace py = pybind11;
using coexec::Engine;
using coexec::Instr;

namespace {

Instr of(Instr::Kind kind) {
  Instr ins;
  ins.kind = kind;
  return ins;
}

// The engine as Python holds it: pushing converts while the GIL is held; waiting releases it.
// Each call first lets go of the tensors Python holds that the engine laid aside (grave.h).
class EngineHandle {
 public:
  explicit EngineHandle(int threads) : e_(std::make_shared<Engine>(threads)) { e_->start(); }

  // Convert a Run and push it; False (nothing pushed) if the engine cannot call it.
  bool run(const py::handle& run, bool deferred, const py::set& not_in_place) {
    e_->exhume();
    auto step = std::make_unique<coexec::Step>();
    try {
      if (!coexec::convert(run, not_in_place, *step)) return false;
    } catch (const std::exception&) {
      return false;  // (a Run the Python path reports on, if it is wrong)
    }
    Instr ins = of(Instr::kRun);
    ins.deferred = deferred;
    ins.step = std::move(step);
    e_->push(std::move(ins));
    return true;
  }

  void put(const std::vector<int64_t>& vids, const std::vector<at::Tensor>& tensors,
           const std::vector<std::pair<int64_t, int64_t>>& moves, const py::iterable& inputs) {
    e_->exhume();
    Instr ins = of(Instr::kPut);
    ins.vids = vids;
    ins.tensors = tensors;
    ins.moves = moves;
    for (const auto& a : inputs) {
      if (THPVariable_Check(a.ptr())) {
        ins.keys.push_back(coexec::storage_key(THPVariable_Unpack(a.ptr())));
      } else if (py::isinstance<py::list>(a) || py::isinstance<py::tuple>(a)) {
        for (const auto& y : a)
          if (THPVariable_Check(y.ptr())) ins.keys.push_back(coexec::storage_key(THPVariable_Unpack(y.ptr())));
      }
    }
    e_->push(std::move(ins));
  }

  void free(std::vector<int64_t> vids) {
    e_->exhume();
    Instr ins = of(Instr::kFree);
    ins.vids = std::move(vids);
    e_->push(std::move(ins));
  }

  void free_range(int64_t lo, int64_t hi) {
    e_->exhume();
    Instr ins = of(Instr::kFreeRange);
    ins.lo = lo;
    ins.hi = hi;
    e_->push(std::move(ins));
  }

  // Launch (plan null: as issued) or Follow (with its bound) a planned block.
  void block(bool follow, std::shared_ptr<const coexec::Plan> plan, int64_t bound) {
    e_->exhume();
    Instr ins = of(follow ? Instr::kFollow : Instr::kLaunch);
    ins.plan = std::move(plan);
    ins.bound = bound;
    e_->push(std::move(ins));
  }

  void reset_peak(std::optional<at::Tensor> arena) {
    Instr ins = of(Instr::kResetPeak);
    ins.arena = std::move(arena);
    e_->push(std::move(ins));
  }

  // The instructions without data: "fail" (Python ran an op and it raised), "stop", and the
  // test faults "raise", "hang" and "die".
  void signal(const std::string& what) {
    static const std::unordered_map<std::string, Instr::Kind> kinds{
        {"fail", Instr::kFail}, {"raise", Instr::kInject}, {"hang", Instr::kHang},
        {"die", Instr::kDie}, {"stop", Instr::kStop}};
    e_->push(of(kinds.at(what)));
  }

  int wait(int64_t position, double timeout) {
    int status;
    {
      py::gil_scoped_release no_gil;
      status = e_->wait(position, timeout);
    }
    e_->exhume();
    return status;
  }

  void join(double timeout) {
    {
      py::gil_scoped_release no_gil;
      e_->join(timeout);
    }
    e_->exhume();
  }

  py::object value(int64_t vid) {
    auto t = e_->value(vid);
    if (!t.has_value()) return py::none();
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(*t));
  }

  py::object take_result(int64_t op_index) {
    auto s = e_->take_result(op_index);
    if (!s.has_value()) throw py::key_error(std::to_string(op_index));
    return torch::jit::createPyObjectForStack(std::move(*s));
  }

  py::object error_func() const {
    auto op = e_->error_op_;
    return op ? op->func : py::none();
  }

  std::shared_ptr<Engine> e_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  coexec::bind_capture(m);
  using coexec::LiveBytes;
  py::class_<LiveBytes>(m, "LiveBytes")
      .def(py::init<>())
      .def_readwrite("live", &LiveBytes::live)
      .def_readwrite("peak", &LiveBytes::peak)
      .def_property_readonly("arena", &LiveBytes::arena)
      .def("attach", &LiveBytes::attach)
      .def("region", &LiveBytes::region)
      .def("free", &LiveBytes::free)
      .def(
          "add",
          [](LiveBytes& self, const at::Tensor& t, const py::iterable& inputs) {
            int64_t key = coexec::storage_key(t);
            if (!key || self.counted(key)) return;
            std::vector<int64_t> keys;
            for (const auto& a : inputs)
              if (THPVariable_Check(a.ptr())) keys.push_back(coexec::storage_key(THPVariable_Unpack(a.ptr())));
            self.add_new(t, key, keys);
          },
          py::arg("t"), py::arg("inputs") = py::tuple())
      .def("remove", &LiveBytes::remove)
      .def("reset_peak", &LiveBytes::reset_peak)
      .def("clear", &LiveBytes::clear);

  py::class_<coexec::Tracker>(m, "Tracker")
      .def(py::init<>())
      .def("add", &coexec::Tracker::add)
      .def("retarget", &coexec::Tracker::retarget)
      .def("expired", &coexec::Tracker::expired)
      .def("sweep", &coexec::Tracker::sweep);

  py::class_<coexec::Plan, std::shared_ptr<coexec::Plan>>(m, "Plan")
      .def(py::init([](std::vector<int64_t> order, std::vector<int64_t> new_bytes) {
        return std::make_shared<coexec::Plan>(coexec::Plan{std::move(order), std::move(new_bytes)});
      }));

  py::class_<EngineHandle>(m, "Engine")
      .def(py::init<int>())
      .def("run", &EngineHandle::run)
      .def("put", &EngineHandle::put)
      .def("free", &EngineHandle::free)
      .def("free_range", &EngineHandle::free_range)
      .def("launch", [](EngineHandle& h, std::shared_ptr<const coexec::Plan> p) { h.block(false, std::move(p), 0); })
      .def("follow", [](EngineHandle& h, std::shared_ptr<const coexec::Plan> p, int64_t bound) { h.block(true, std::move(p), bound); })
      .def("reset_peak", &EngineHandle::reset_peak)
      .def("signal", &EngineHandle::signal)
      .def("wait", &EngineHandle::wait)
      .def("exhume", [](EngineHandle& h) { h.e_->exhume(); })
      .def("join", &EngineHandle::join)
      .def("value", &EngineHandle::value)
      .def("take_result", &EngineHandle::take_result)
      .def("raise_failure", [](EngineHandle& h) { h.e_->raise_failure(); })
      .def("clear_error", [](EngineHandle& h) { h.e_->clear_error(); })
      .def("clear", [](EngineHandle& h) { h.e_->clear(); })
      .def("release_hang", [](EngineHandle& h) { h.e_->release_hang(); })
      .def("record_order", [](EngineHandle& h, bool on) { h.e_->record_order(on); })
      .def("ran_order", [](EngineHandle& h) { return h.e_->ran_order(); })
      .def("ran_times", [](EngineHandle& h) { return h.e_->ran_times(); })
      .def("take_out_reports", [](EngineHandle& h) { return h.e_->take_out_reports(); })
      .def_property_readonly("error_func", &EngineHandle::error_func)
      .def_property_readonly("error_kind", [](EngineHandle& h) { return h.e_->error_.load(); })
      .def_property_readonly("error_op_index", [](EngineHandle& h) { return h.e_->error_op_index_.load(); })
      .def_property_readonly("alive", [](EngineHandle& h) { return h.e_->alive_.load(); })
      .def_property_readonly("done", [](EngineHandle& h) { return h.e_->done_.load(); })
      .def_property_readonly("live", [](EngineHandle& h) { return h.e_->live_.load(); })
      // ExecutorStats' counters, in one call: done, busy seconds, peak bytes, arena hits and
      // misses, blocks run in a planned order, ops run, and RunAhead's five
      .def_property_readonly("counters", [](EngineHandle& h) {
        const Engine& e = *h.e_;
        const auto& a = e.ahead_;
        return py::make_tuple(
            e.done_.load(), e.busy_ns_.load() * 1e-9, e.peak_.load(), e.arena_hits_.load(),
            e.arena_misses_.load(), e.blocks_.load(), e.ops_run_.load(),
            py::make_tuple(a[0].load(), a[1].load(), a[2].load(), a[3].load(), a[4].load()));
      });
}
