// A Llama-family decoder stack in one call. On the CPU the per-op form of a layer is a dozen Python and pybind
// calls (module calls, views, the kernels' argument conversion): at one sequence that dispatch cost about as
// much as the layer's arithmetic (docs/performance.md). Here the same kernels run from C++, in the same order,
// on tensors of the same shapes and strides, so the output is the per-op form's bit for bit
// (tests/layers/test_decoder_stack.py); heron/model/decoder_stack.py decides when a model and a step can use it.
#include <ATen/core/dispatch/Dispatcher.h>
// pybind11 and ATen's type casters, not all of torch/extension.h (see float_rows.h)
#include <torch/csrc/utils/pybind.h>
#include <ATen/ops/linear.h>

#include <cmath>
#include <tuple>
#include <vector>

at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                      at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor gemv_bf16(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slots, double k_scale,
              double v_scale);
at::Tensor paged_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table,
                           at::Tensor seq_lens, at::Tensor query_begin, at::Tensor query_end,
                           double scale, int64_t window, double k_scale, double v_scale);
at::Tensor int_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins,
                      int64_t bits, int64_t group, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor tile_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias, int64_t n);

namespace {

// oneDNN's linear on a weight packed into its blocked layout (torch.ops.mkldnn._linear_pointwise), found once.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            c10::string_view, c10::List<c10::optional<at::Scalar>>,
                            c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

// One linear layer as its quantization method computes it: a packed integer weight through int_linear
// (heron/quantization/packed_int.py's ``linear``), or a dense weight as ``dense_linear`` does (heron's bfloat16
// kernel for a few contiguous rows where ``gemv`` says the CPU has native bfloat16, then the weight's copy for
// many bfloat16 rows where it has one: tile_linear's layout (AMX or AVX-512 BF16) or oneDNN's; else at::linear).
struct StackLinear {
  at::Tensor qweight, scales, mins, dense;
  c10::optional<at::Tensor> batch;
  int64_t bits = 0, group = 0, n = 0;
  c10::optional<at::Tensor> bias;
  bool gemv = false;

  static StackLinear packed(at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t bits,
                            int64_t group, int64_t n, c10::optional<at::Tensor> bias) {
    StackLinear linear;
    linear.qweight = qweight, linear.scales = scales, linear.mins = mins;
    linear.bits = bits, linear.group = group, linear.n = n, linear.bias = bias;
    return linear;
  }

  static StackLinear dense_weight(at::Tensor weight, c10::optional<at::Tensor> batch,
                                  c10::optional<at::Tensor> bias, bool gemv) {
    StackLinear linear;
    linear.dense = weight, linear.batch = batch, linear.bias = bias, linear.gemv = gemv;
    return linear;
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (qweight.defined()) return int_linear(x.contiguous(), qweight, scales, mins, bits, group, n, bias);
    if (gemv && x.size(0) <= 4 && x.scalar_type() == at::kBFloat16 && x.is_contiguous())
      return gemv_bf16(x, dense, bias);
    if (batch.has_value() && x.scalar_type() == at::kBFloat16) {
      if (batch->is_mkldnn()) return onednn_linear(x.contiguous(), *batch, bias);
      return tile_linear(x, *batch, bias, dense.size(0));
    }
    return at::linear(x, dense, bias);
  }
};

// One decoder layer's weights: pre-norms, the fused q/k/v and gate/up projections, and its attention window
// (0: none).
struct StackLayer {
  at::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  StackLinear qkv, o_proj, gate_up, down;
  int64_t window;
};

// The step's attention inputs, as the CPU paged backend passes them to its kernels.
struct StackStep {
  at::Tensor positions, block_table, seq_lens, query_begin, query_end, slots;
};

class DecoderStack {
 public:
  DecoderStack(std::vector<StackLayer> layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               at::Tensor cos, at::Tensor sin)
      : layers_(std::move(layers)), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        cos_(std::move(cos)), sin_(std::move(sin)) {}

  // Runs layers ``layer_ids`` over ``hidden`` [T, H] (the embeddings); returns (hidden, residual) before the
  // final norm, of rows ``keep`` only where given (dropped after the last layer's attention, as the per-op
  // layers drop them). ``kv_caches`` and the scales are per layer of the whole stack.
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor hidden, at::Tensor positions, const std::vector<at::Tensor>& kv_caches,
      const std::vector<double>& k_scales, const std::vector<double>& v_scales, at::Tensor block_table,
      at::Tensor seq_lens, at::Tensor query_begin, at::Tensor query_end, at::Tensor slots,
      const std::vector<int64_t>& layer_ids, const c10::optional<at::Tensor>& keep) const {
    const int64_t count = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == count && static_cast<int64_t>(k_scales.size()) == count &&
                static_cast<int64_t>(v_scales.size()) == count, "DecoderStack: one KV cache and scale pair a layer");
    const StackStep step{positions, block_table, seq_lens, query_begin, query_end, slots};
    at::Tensor residual;
    for (const int64_t i : layer_ids) {
      TORCH_CHECK(i >= 0 && i < count, "DecoderStack: no layer ", i);
      const StackLayer& layer = layers_[i];
      if (residual.defined()) {
        hidden = rms_norm(hidden, residual, layer.input_norm, layer.input_eps);
      } else {
        residual = hidden;
        hidden = rms_norm(hidden, c10::nullopt, layer.input_norm, layer.input_eps);
      }
      hidden = layer.o_proj(attend(layer, hidden, step, kv_caches[i], k_scales[i], v_scales[i]));
      if (keep.has_value() && i == layer_ids.back()) {
        hidden = hidden.index_select(0, *keep);
        residual = residual.index_select(0, *keep);
      }
      hidden = rms_norm(hidden, residual, layer.post_norm, layer.post_eps);
      hidden = layer.down(silu_and_mul(layer.gate_up(hidden)));
    }
    return {hidden, residual};
  }

 private:
  // heron/model/llama.py's Attention with heron/attention/cpu_paged.py's forward, every query through the kernel.
  at::Tensor attend(const StackLayer& layer, const at::Tensor& x, const StackStep& step,
                    const at::Tensor& kv_cache, double k_scale, double v_scale) const {
    const at::Tensor qkv = layer.qkv(x);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads_, head_dim_});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({-1, num_kv_heads_, head_dim_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, num_kv_heads_, head_dim_});
    rotary_embedding(step.positions, q, k, cos_, sin_);
    store_kv(k, v, kv_cache, step.slots, k_scale, v_scale);
    const double scale = std::pow(static_cast<double>(head_dim_), -0.5);
    return paged_attention(q, kv_cache, step.block_table, step.seq_lens, step.query_begin, step.query_end, scale,
                           layer.window, k_scale, v_scale)
        .flatten(1);
  }

  std::vector<StackLayer> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  at::Tensor cos_, sin_;
};

}  // namespace

void bind_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StackLinear>(m, "StackLinear", "one linear layer of a DecoderStack")
      .def_static("packed", &StackLinear::packed, "a packed integer weight (int_linear's arguments)",
                  py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("group"),
                  py::arg("n"), py::arg("bias"))
      .def_static("dense", &StackLinear::dense_weight, "a dense weight [N, K] and its copy for many rows, if any "
                  "(dense_linear: gemv_bf16 for a few bfloat16 rows where gemv, the copy for more, else F.linear)",
                  py::arg("weight"), py::arg("batch"), py::arg("bias"), py::arg("gemv"));
  py::class_<StackLayer>(m, "StackLayer", "one decoder layer of a DecoderStack")
      .def(py::init([](at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                       StackLinear qkv, StackLinear o_proj, StackLinear gate_up, StackLinear down, int64_t window) {
             return StackLayer{input_norm, post_norm, input_eps, post_eps, qkv, o_proj, gate_up, down, window};
           }),
           py::arg("input_norm"), py::arg("input_eps"), py::arg("post_norm"), py::arg("post_eps"), py::arg("qkv"),
           py::arg("o_proj"), py::arg("gate_up"), py::arg("down"), py::arg("window"));
  py::class_<DecoderStack>(m, "DecoderStack", "a Llama-family decoder stack run in one call")
      .def(py::init<std::vector<StackLayer>, int64_t, int64_t, int64_t, at::Tensor, at::Tensor>(),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("cos"),
           py::arg("sin"))
      .def("forward", &DecoderStack::forward, py::arg("hidden"), py::arg("positions"), py::arg("kv_caches"),
           py::arg("k_scales"), py::arg("v_scales"), py::arg("block_table"), py::arg("seq_lens"),
           py::arg("query_begin"), py::arg("query_end"), py::arg("slots"), py::arg("layer_ids"), py::arg("keep"),
           py::call_guard<py::gil_scoped_release>());  // the engine core's other threads run meanwhile
}
