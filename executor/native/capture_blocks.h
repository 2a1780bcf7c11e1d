// Capture's gradient blocks (capture.cpp): ``loss.backward()`` without the autograd engine.
// Internal to capture.cpp, the only file that includes it (hence the anonymous namespace).
//
// On CPU the engine runs a backward in the calling thread: per node a thread-local state set
// and restored, an input buffer, validation, the ready queue, the node's formula, and then its
// ops through the dispatcher to the kernel: about 30000 instructions a node on a small MLP,
// a third of a captured step (callgrind), all on the skeleton's thread. Yet on a path the
// capture knows, the backward makes the same ops every step. So the first step at a path runs
// the engine and keeps the ops it made as a Block (a Recording while it runs); a later step
// whose ops before the call were the same (Capture's path: each op's cache entry, the values of
// its numbers where autograd may save them, and where each tensor argument came from) and whose
// autograd graph has the same shape hands the block's ops to the worker directly, binds each
// leaf's ``.grad`` as the engine did, and lets go of the graph's saved tensors.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <typeinfo>
#include <unordered_set>
#include <utility>
#include <vector>

#include "capture_cache.h"
#include "capture_placeholders.h"

namespace coexec {
namespace {

// Mix `v` into the hash `h` (splitmix64's finaliser over the sum).
inline uint64_t mix(uint64_t h, uint64_t v) {
  uint64_t z = h + 0x9E3779B97F4A7C15ull + v;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Where a tensor argument of a block's op comes from, in the step that replays it.
struct Ref {
  enum Kind : uint8_t {
    kNone,   // an undefined tensor
    kStep,   // the value of the step's placeholder number `a` (made by an op before, or in the block)
    kOuter,  // the step's real tensor number `a` (a parameter, a batch: first seen at an op before)
    kGrad,   // the ``.grad`` leaf `a` of the graph had when backward() was called
    kConst,  // the block's tensor `a`: made by a formula outside the dispatcher from numbers
             // and sizes (a wrapped number, ``scalar_tensor``), so the same at every replay
    kFresh,  // a new tensor with the block's metadata `a`, which an op of the block fills
  };
  Kind kind = kNone;
  uint32_t a = 0;
};

struct BlockOp {
  const c10::OperatorHandle* op = nullptr;
  bool grad_mode = false;
  std::vector<c10::IValue> args;  // its tensors undefined: `refs` says what goes there
  std::vector<uint32_t> ref_begin;  // per argument: where its tensors' refs begin in `refs`
  std::vector<Ref> refs;            // one per tensor of the arguments (each_tensor's order)
  std::vector<int> written;         // per return: the argument it writes, or -1
  std::vector<OutMeta> outputs;     // per return not written: the placeholders it makes
};

// A leaf's ``.grad`` bound to a value the block made (AccumulateGrad stole or cloned it).
struct Binding {
  uint32_t leaf;
  uint32_t value;  // the step's placeholder number (kStep)
  TensorMeta meta;
};

struct Block {
  std::vector<uint64_t> path;  // the step's path before the call
  uint64_t graph = 0;          // the autograd graph's shape (GraphWalk::digest)
  std::string why_not;         // not empty: no block here (and why); the engine runs
  uint64_t id = 0;
  Where site{nullptr, -1};  // the backward() line it was made at
  int64_t replays = 0;
  uint32_t first_value = 0;  // the step's placeholder count when the call came
  uint32_t values = 0;       // placeholders its ops make
  std::vector<BlockOp> ops;
  std::vector<at::Tensor> consts;
  std::vector<TensorMeta> fresh;
  std::vector<Binding> bindings;
  // per leaf of the graph: its ``.grad`` when the block was made (undefined: none)
  std::vector<TensorMeta> grads;
};

// The autograd graph a backward from `root` runs, as the engine would find it.
struct GraphWalk {
  uint64_t digest = 0;  // the nodes' kinds and edges, in the walk's order
  std::vector<torch::autograd::Node*> nodes;
  std::vector<at::Tensor> leaves;  // the AccumulateGrad nodes' variables, in the walk's order
  std::string why_not;              // not empty: Python runs in this backward, or a hook does
};

GraphWalk walk_graph(torch::autograd::Node* root) {
  using torch::autograd::AccumulateGrad;
  GraphWalk w;
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{root};
  uint64_t h = 0;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (!seen.insert(n).second) continue;
    w.nodes.push_back(n);
    // (PyNode, a Python backward: torch_python does not export its type, so it is told by name)
    if (std::strcmp(typeid(*n).name(), "N5torch8autograd6PyNodeE") == 0) {
      w.why_not = "the graph has a Python node (a custom autograd.Function, a module's backward hook)";
      return w;
    }
    if (!n->pre_hooks().empty() || !n->tensor_pre_hooks().empty() || !n->retains_grad_hooks().empty() ||
        !n->post_hooks().empty()) {
      w.why_not = "a node of the graph has hooks (register_hook, retain_grad, a module's hook)";
      return w;
    }
    h = mix(h, typeid(*n).hash_code());
    if (auto* acc = dynamic_cast<AccumulateGrad*>(n)) {
      if (torch::autograd::impl::post_acc_grad_hooks(acc->variable)) {
        w.why_not = "a leaf has a post-accumulate-grad hook";
        return w;
      }
      h = mix(h, 0xACC + w.leaves.size());
      w.leaves.push_back(acc->variable);
    }
    const auto& edges = n->next_edges();
    h = mix(h, edges.size());
    for (const auto& e : edges) {
      h = mix(h, e.function ? e.input_nr + 1 : 0);
      if (e.function) todo.push_back(e.function.get());
    }
  }
  w.digest = h;
  return w;
}

// A placeholder with the given metadata whose value `slot` receives.
at::Tensor placeholder_of(const TensorMeta& m, std::shared_ptr<Slot> slot) {
  auto impl = c10::make_intrusive<PlaceholderImpl>(c10::scalarTypeToTypeMeta(m.dtype), std::move(slot));
  impl->take_metadata(m.sizes, m.strides, m.offset);
  made(impl.get());
  return at::Tensor(std::move(impl));
}

}  // namespace
}  // namespace coexec
