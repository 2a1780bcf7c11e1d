// Capture's gradient blocks (capture.cpp): ``loss.backward()`` without the autograd engine.
// Internal to capture.cpp, the only file that includes it (hence the anonymous namespace).
//
// On CPU the engine runs a backward in the calling thread, the skeleton's: per node a
// thread-local state set and restored, an input buffer, validation, the ready queue, the
// node's formula, then its ops through the dispatcher to the kernel (docs/coexec.md, *Gradient
// blocks*, has the figures). Yet on a path the capture knows, the backward makes the same ops
// every step. So the first step at a path runs
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
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <typeinfo>
#include <unordered_map>
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

  // The refs of argument `i` (begin, end) in `refs`.
  std::pair<uint32_t, uint32_t> refs_of(size_t i) const {
    return {ref_begin[i], i + 1 < ref_begin.size() ? ref_begin[i + 1] : static_cast<uint32_t>(refs.size())};
  }
};

// A leaf's ``.grad`` bound to a value the block made (AccumulateGrad stole or cloned it), or, for
// ``torch.autograd.grad``, the gradient it returns for an input.
struct Binding {
  uint32_t leaf;  // the leaf of the graph walk (backward), the input's number (grad)
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
  // per leaf of the graph: its ``.grad`` when the block was made (undefined: none); backward only
  std::vector<TensorMeta> grads;
  // ``torch.autograd.grad``: per input, its leaf in the graph walk (-1: not reached); the
  // gradients it returns are `results` (an input without one gets None). Empty for backward().
  std::vector<int32_t> inputs;
  std::vector<Binding> results;
};

// The autograd graph a backward from `root` runs, as the engine would find it.
struct GraphWalk {
  uint64_t digest = 0;  // the nodes' kinds and edges, in the walk's order
  std::vector<torch::autograd::Node*> nodes;
  std::vector<at::Tensor> leaves;  // the AccumulateGrad nodes' variables, in the walk's order
  std::vector<uint32_t> leaf_nodes;  // per leaf, its AccumulateGrad's number in `nodes`
  std::vector<uint32_t> edge_begin;  // per node: where its edges begin in `edges`
  std::vector<torch::autograd::Node*> edges;  // the nodes each node's next edges lead to
  std::string why_not;              // not empty: Python runs in this backward, or a hook does
};

// Where a step's autograd nodes begin: the nodes the step's thread makes from its start on carry
// this thread's id and a sequence number from `first` on (torch's own numbering of nodes, which
// the engine orders by). A node outside that range was made before the step, or in another thread.
struct StepNodes {
  uint64_t first = 0;
  uint64_t thread = 0;

  static StepNodes from_now() { return {at::sequence_number::peek(), at::RecordFunction::currentThreadId()}; }
  bool made_in_step(const torch::autograd::Node& n) const {
    return n.sequence_nr() >= first && n.thread_id() == thread;
  }
};

// Walks the autograd graph a backward from a root runs, as the engine would find it; its buffers
// are reused, and what kind each node type is is remembered (a walk runs every backward()).
// A graph with a node the step did not make (`step`: a forward run before the step, outside the
// tape, or a graph kept from an earlier step) is no block's: its nodes' formulas hold numbers and
// tensors of a forward the capture did not see, which the step's path does not vouch for.
class GraphWalker {
 public:
  const GraphWalk& walk(torch::autograd::Node* root, const StepNodes& step) {
    using torch::autograd::AccumulateGrad;
    w_.digest = 0;
    w_.nodes.clear();
    w_.leaves.clear();
    w_.leaf_nodes.clear();
    w_.edge_begin.clear();
    w_.edges.clear();
    w_.why_not.clear();
    seen_.assign(std::max<size_t>(64, seen_.size()), nullptr);
    count_ = 0;
    todo_.assign(1, root);
    uint64_t h = 0;
    while (!todo_.empty()) {
      torch::autograd::Node* n = todo_.back();
      todo_.pop_back();
      if (!insert(n)) continue;
      w_.nodes.push_back(n);
      const std::type_info* type = &typeid(*n);
      const Kind kind = kind_of(type, n);
      if (kind == kPython) {
        w_.why_not = "the graph has a Python node (a custom autograd.Function, a module's backward hook)";
        return w_;
      }
      if (!n->pre_hooks().empty() || !n->tensor_pre_hooks().empty() || !n->retains_grad_hooks().empty() ||
          !n->post_hooks().empty()) {
        w_.why_not = "a node of the graph has hooks (register_hook, retain_grad, a module's hook)";
        return w_;
      }
      if (kind == kPlain && !step.made_in_step(*n)) {
        w_.why_not = "the graph has a node made before the step (a forward outside the tape, a graph kept from an earlier step)";
        return w_;
      }
      h = mix(h, reinterpret_cast<uintptr_t>(type));  // (one type_info per type in a process)
      if (kind == kAccumulate) {
        const at::Tensor& leaf = static_cast<AccumulateGrad*>(n)->variable;
        if (torch::autograd::impl::post_acc_grad_hooks(leaf)) {
          w_.why_not = "a leaf has a post-accumulate-grad hook";
          return w_;
        }
        h = mix(h, 0xACC + w_.leaves.size());
        w_.leaves.push_back(leaf);
        w_.leaf_nodes.push_back(static_cast<uint32_t>(w_.nodes.size() - 1));
      }
      const auto& edges = n->next_edges();
      h = mix(h, edges.size());
      w_.edge_begin.push_back(static_cast<uint32_t>(w_.edges.size()));
      for (const auto& e : edges) {
        h = mix(h, e.function ? e.input_nr + 1 : 0);
        if (e.function) {
          todo_.push_back(e.function.get());
          w_.edges.push_back(e.function.get());
        }
      }
    }
    w_.digest = h;
    return w_;
  }

  // The nodes of the last walk a ``torch.autograd.grad`` for its leaves `inputs` (-1: one not
  // reached) executes, as the engine finds them (GraphTask::init_to_execute): those with a path
  // to an input's AccumulateGrad, which itself only hands its gradient back.
  std::vector<torch::autograd::Node*> needed(const std::vector<int32_t>& inputs) const {
    const size_t n = w_.nodes.size();
    std::unordered_map<const torch::autograd::Node*, uint32_t> index;
    index.reserve(n);
    for (size_t i = 0; i < n; ++i) index.emplace(w_.nodes[i], static_cast<uint32_t>(i));
    std::vector<std::vector<uint32_t>> into(n);  // the edges reversed
    for (size_t i = 0; i < n; ++i) {
      const size_t end = i + 1 < n ? w_.edge_begin[i + 1] : w_.edges.size();
      for (size_t k = w_.edge_begin[i]; k < end; ++k) into[index.at(w_.edges[k])].push_back(static_cast<uint32_t>(i));
    }
    std::vector<char> reached(n, 0);
    std::vector<uint32_t> todo;
    for (int32_t leaf : inputs)
      if (leaf >= 0 && !reached[w_.leaf_nodes[leaf]]) {
        reached[w_.leaf_nodes[leaf]] = 1;
        todo.push_back(w_.leaf_nodes[leaf]);
      }
    std::vector<torch::autograd::Node*> out;
    while (!todo.empty()) {
      const uint32_t i = todo.back();
      todo.pop_back();
      for (uint32_t j : into[i])
        if (!reached[j]) {
          reached[j] = 1;
          todo.push_back(j);
          out.push_back(w_.nodes[j]);
        }
    }
    return out;
  }

  // Let go of the last walk's leaves (a model deleted after its last step is not kept alive).
  void forget() {
    w_.leaves.clear();
    w_.nodes.clear();
    w_.edges.clear();
  }

 private:
  enum Kind : uint8_t { kPlain, kPython, kAccumulate };
  GraphWalk w_;
  std::vector<torch::autograd::Node*> todo_;
  std::vector<torch::autograd::Node*> seen_;  // open addressing, a power of two long
  size_t count_ = 0;
  std::array<std::pair<const std::type_info*, Kind>, 64> kinds_{};  // direct-mapped, by type

  Kind kind_of(const std::type_info* type, torch::autograd::Node* n) {
    auto& k = kinds_[(reinterpret_cast<uintptr_t>(type) >> 4) & 63];
    if (k.first != type) {
      // (PyNode, a Python backward: torch_python does not export its type, so it is told by name)
      k = {type, std::strcmp(type->name(), "N5torch8autograd6PyNodeE") == 0           ? kPython
                 : dynamic_cast<torch::autograd::AccumulateGrad*>(n) != nullptr ? kAccumulate
                                                                                 : kPlain};
    }
    return k.second;
  }

  // Add `n` to the nodes seen; false if it was there.
  bool insert(torch::autograd::Node* n) {
    if (2 * (count_ + 1) > seen_.size()) {  // (grown: the walk's nodes so far go in again)
      seen_.assign(seen_.size() * 2, nullptr);
      count_ = 0;
      for (torch::autograd::Node* m : w_.nodes) place(m);
    }
    return place(n);
  }

  bool place(torch::autograd::Node* n) {
    const size_t mask = seen_.size() - 1;
    for (size_t i = (reinterpret_cast<uintptr_t>(n) >> 4) & mask;; i = (i + 1) & mask) {
      if (seen_[i] == n) return false;
      if (seen_[i] == nullptr) {
        seen_[i] = n;
        ++count_;
        return true;
      }
    }
  }
};

}  // namespace
}  // namespace coexec
