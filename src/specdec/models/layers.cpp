// The decoder's layer loop in one native call (`native.LayerLoop`): for a forward of a few rows, the time
// the Python loop spends between the kernels (module calls, argument checks, ~8 ATen dispatches per layer)
// is a fifth of the step; here the same kernels run back to back, so the bits are the Python loop's:
//   x, h = add_rms_norm(x, o, attn_norm)          attend.c
//   qkv  = int4_mm(h, wqkv)                        torch's CPU int4 kernel (at::cpu, no dispatcher), attend.c's
//                                                  4-bit or 8-bit kernel (8-bit activations) over torch's
//                                                  threads, or a oneDNN-prepacked linear (other formats)
//   a    = attend(qkv, ...)                        attend.c (q/k norms, rope, cache writes; then attention,
//                                                  its query heads split over torch's threads on long contexts)
//   o    = int4_mm(a, wo)          [o = post_attn_norm(o): attend.c, nothing added]
//   x, h = add_rms_norm(x, o, ffn_norm)
//   g, u = int4_mm(h, w13).chunk(2)
//   o    = int4_mm(act(g) * u, w2) [o = post_ffn_norm(o)]    act: SiLU or tanh-GELU (at::cpu, torch's bits)
// Activations bfloat16 or float32 (cast to bfloat16 for each int4 call and back, as `kernels.linear` does).
// Weights stay owned by Python (tensors made with from_blob).
// Built by `native.LayerLoop` against the running torch's headers and libraries; C ABI, called by ctypes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/empty.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorImpl.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

// One layer's attention call, as attend.c declares it.
extern "C" struct attend_call {
    const void *qkv; int qkv_bf16; int64_t qkv_stride;
    const float *cos, *ssin, *q_norm, *k_norm; float eps;
    float *kc, *vc; const int64_t *row_off, *at; int64_t head_stride;
    const uint8_t *mask; int64_t S, B, T, nh, nkv, hd; float scale;
    void *out; int out_bf16;
    const int64_t *pos; int64_t pos_limit;
};
typedef int (*rope_fn)(const attend_call *a, float *rows);
typedef int (*heads_fn)(const attend_call *a, const float *rows, int64_t w0, int64_t w1);
typedef int (*norm_fn)(const void *x, const void *o, int bf16, int64_t N, int64_t D, const float *w, float eps,
                       void *xo, void *h);
typedef int (*quantize_fn)(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *dx, float *sx,
                           int32_t *xs8);
typedef int (*q4_fn)(const int8_t *xq, const float *dx, const float *sx, const int32_t *xs8, int64_t M, int64_t K,
                     const uint8_t *codes, const float *scale, const float *zero, int64_t N, void *out, int out_bf16,
                     int64_t g0, int64_t g1, int isa);
typedef void (*top_fn)(const float *x, int64_t M, int64_t N, int64_t *top);

// One forward's attention plan (what `native.Attend` checks once per forward), as a C struct.
extern "C" struct specdec_plan {
    const float *cos, *ssin;        // [B*T, hd] float32, or with pos the whole tables [pos_limit, hd]
    char *k, *v;                    // layer 0's cache [R, nkv, Smax, hd] float32; layer i at + i * layer_bytes
    int64_t layer_bytes;
    const int64_t *row_off, *at;    // per sequence: the cache row's offset (floats), its first scratch slot
    int64_t head_stride;            // Smax * hd
    const uint8_t *mask;            // [B, T, S], or nullptr: a causal chain (attend.c)
    int64_t S, B, T, nh, nkv, hd;
    float scale;
    const int64_t *pos;             // [B*T] the tokens' positions in the rope tables, or nullptr
    int64_t pos_limit;
};

namespace {

enum { WQKV, WO, W13, W2, N_LINEARS };
enum { ATTN_NORM, FFN_NORM, Q_NORM, K_NORM, POST_ATTN_NORM, POST_FFN_NORM, N_NORMS };

enum { TORCH_INT4, NATIVE_ROWS, ONEDNN };

struct Linear {
    int kind = TORCH_INT4;
    at::Tensor packed;              // torch's: [N, K / 2] uint8 in its int4 layout
    at::Tensor scale_zero;          //          [K / 32, N, 2] bfloat16
    q4_fn matmul = nullptr;         // native: attend.c's 4-bit kernel (codes [N / 16, K / 32, 256], native.q4_layout)
    const uint8_t *codes = nullptr; //         or 8-bit one (codes [N / 16, K / 32, 512], native.q8_rows_layout)
    const float *scale = nullptr, *zero = nullptr;  // [N / 16, K / 32, 16] (8-bit: scale d, zero unused)
    int isa = 0;                    //         its instructions at most (the same bits at every level)
    int threads = 1;                //         split over torch's threads (else on the calling one)
    at::Tensor weight;              // oneDNN: the prepacked weight (`kernels.PackedLinear`)
    at::ScalarType dtype = at::kFloat;  //     its inputs' and outputs' dtype
    int pair = 1;                   //         a lone row computed as two copies of it (`kernels.linear`)
    int64_t n_out = 0, n_in = 0;
    int64_t max_rows = 0;           // the rows one call may take (its checked limit)
};

struct Layer {
    Linear lin[N_LINEARS];
    const float *norm[N_NORMS] = {};  // float32 weights, nullptr: none
    int local = 0;                  // attends through the local (sliding-window) plan
};

struct Loop {
    std::vector<Layer> layers;
    int64_t dim = 0;
    double eps = 0;                 // as Python gives it (the C kernels take it as float)
    int gelu = 0;
    int bf16 = 1;                   // activations bfloat16, else float32
    at::TensorOptions act;          // of the activations
    rope_fn rope = nullptr;         // attend.c's two steps of attention (specdec_attend_rope, specdec_attend_heads)
    heads_fn heads = nullptr;
    norm_fn norm = nullptr;
    quantize_fn quantize = nullptr;
};

const at::TensorOptions BF16 = at::TensorOptions().dtype(at::kBFloat16);

// Attention's (token, query head) pairs split over torch's threads where they hold more than this much work
// (pairs times visible slots times head width): below it, waking the other threads costs more than it saves.
const int64_t ATTEND_GRAIN = 65536;

// A new CPU tensor without a trip through the dispatcher (at::empty's): a forward makes about ten per layer.
at::Tensor fresh(at::IntArrayRef sizes, const at::TensorOptions &options) {
    return at::detail::empty_cpu(sizes, options);
}

// From this many rows a native linear computes its outputs over torch's threads whatever its shape's choice for one
// row, and from QUANTIZE_SPLIT_ROWS it quantizes its inputs over them too (a prefill's forwards).
const int64_t SPLIT_ROWS = 8, QUANTIZE_SPLIT_ROWS = 32;

// A native kernel (4-bit or 8-bit codes), with `threads` over torch's threads (groups of 16 outputs split between
// them), else on the calling thread (whichever its first start timed faster for the shape: `gguf_loader.split_or_not`):
// x [M, K] quantized once, then out [M, N] (out_bf16: bfloat16, else float32) and, with `top` (float32 out only),
// each row's first largest output's index (attend.c's specdec_row_top) into top_out [M]: an LM head's greedy tokens
// while its logits are still in the caches. Returns 0, or -3 on a torch error.
int q4_threads(quantize_fn quantize, q4_fn q4, const void *x, int x_bf16, int64_t M, int64_t K,
               const uint8_t *codes, const float *scale, const float *zero, int64_t N, void *out, int out_bf16,
               int isa, int threads, top_fn top = nullptr, int64_t *top_out = nullptr) {
    const int64_t nb = K / 32;
    // the quantized rows in this thread's scratch (no tensor: a call costs no allocation once it has grown)
    thread_local std::vector<float> scratch;
    const int64_t words = (M * K + 3) / 4 + 3 * M * nb;
    if ((int64_t)scratch.size() < words) scratch.resize(words);
    int8_t *xq = (int8_t *)scratch.data();
    float *dx = scratch.data() + (M * K + 3) / 4, *sx = dx + M * nb;
    int32_t *xs8 = (int32_t *)(sx + M * nb);
    // many rows (a prefill's) split over the threads whatever the shape's choice for few: rows and groups are
    // independent, so the bits are the same
    const bool split = threads || M >= SPLIT_ROWS;
    if (M >= QUANTIZE_SPLIT_ROWS) {
        const int64_t width = (x_bf16 ? 2 : 4) * K;                            // bytes of an input row
        at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
            quantize((const char *)x + m0 * width, x_bf16, m1 - m0, K, xq + m0 * K, dx + m0 * nb, sx + m0 * nb,
                     xs8 + m0 * nb);
        });
    } else {
        quantize(x, x_bf16, M, K, xq, dx, sx, xs8);
    }
    const int64_t groups = N / 16, grain = split ? 4 : groups;
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
        q4(xq, dx, sx, xs8, M, K, codes, scale, zero, N, out, out_bf16, g0, g1, isa);
    });
    if (top && top_out && !out_bf16) top((const float *)out, M, N, top_out);
    return 0;
}

// x [N, K] in the activations' dtype (contiguous) -> [N, N_out] in it. torch's kernel takes and gives bfloat16
// (cast around it as `kernels.linear` does); the native one reads either and rounds its float32 sums to the
// activations' dtype, as the cast after `native.Q4Linear` does.
at::Tensor onednn_mm(const Loop &m, const Linear &l, const at::Tensor &x) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &, c10::string_view,
                          c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
    const bool lone = x.size(0) == 1 && l.pair;
    at::Tensor rows = lone ? x.expand({2, x.size(1)}) : x;
    if (rows.scalar_type() != l.dtype) rows = rows.to(l.dtype);
    at::Tensor y = op.call(rows, l.weight, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                           c10::string_view(""));
    if (y.scalar_type() != m.act.dtype().toScalarType()) y = y.to(m.act.dtype().toScalarType());
    return lone ? y.select(0, 0).view({1, -1}) : y;
}

at::Tensor int4_mm(const Loop &m, const Linear &l, const at::Tensor &x) {
    if (l.kind == ONEDNN) return onednn_mm(m, l, x);
    if (l.kind == TORCH_INT4) {
        at::Tensor y = at::cpu::_weight_int4pack_mm_for_cpu(m.bf16 ? x : x.to(at::kBFloat16), l.packed, 32,
                                                            l.scale_zero);
        return m.bf16 ? y : y.to(at::kFloat);
    }
    at::Tensor y = fresh({x.size(0), l.n_out}, m.act);
    q4_threads(m.quantize, l.matmul, x.data_ptr(), m.bf16, x.size(0), l.n_in, l.codes, l.scale, l.zero, l.n_out,
               y.data_ptr(), m.bf16, l.isa, l.threads);
    return y;
}

// (x + o, norm(x + o) * w); o undefined: (x, norm(x) * w)
int add_norm(const Loop &m, at::Tensor &x, const at::Tensor &o, const float *w, at::Tensor &h) {
    int64_t N = x.size(0);
    at::Tensor xo = o.defined() ? fresh({N, m.dim}, m.act) : x;
    h = fresh({N, m.dim}, m.act);
    int rc = m.norm(x.data_ptr(), o.defined() ? o.data_ptr() : nullptr, m.bf16, N, m.dim, w, (float)m.eps, xo.data_ptr(),
                    h.data_ptr());
    x = xo;
    return rc;
}

// a sandwich norm of a layer's output (decoder.Block._post_norm): attend.c's norm, nothing added
int post_norm(const Loop &m, at::Tensor &o, const float *w) {
    at::Tensor h = fresh({o.size(0), m.dim}, m.act);
    int rc = m.norm(o.data_ptr(), nullptr, m.bf16, o.size(0), m.dim, w, (float)m.eps, o.data_ptr(), h.data_ptr());
    o = h;
    return rc;
}

int run_layer(const Loop &m, int i, const specdec_plan &p, at::Tensor &x, at::Tensor &o) {
    const Layer &l = m.layers[i];
    at::Tensor h;
    int rc = add_norm(m, x, o, l.norm[ATTN_NORM], h);
    if (rc) return rc;
    at::Tensor qkv = int4_mm(m, l.lin[WQKV], h);                               // [N, (nh + 2 nkv) hd]
    int64_t N = x.size(0);
    at::Tensor a = fresh({N, p.nh * p.hd}, m.act);
    at::Tensor rows = fresh({N, p.nh * p.hd}, at::TensorOptions().dtype(at::kFloat));   // roped queries
    int64_t off = i * p.layer_bytes;
    const attend_call c = {qkv.data_ptr(), m.bf16, qkv.stride(0), p.cos, p.ssin, l.norm[Q_NORM], l.norm[K_NORM],
                           (float)m.eps, (float *)(p.k + off), (float *)(p.v + off), p.row_off, p.at, p.head_stride,
                           p.mask, p.S, p.B, p.T, p.nh, p.nkv, p.hd, p.scale, a.data_ptr(), m.bf16, p.pos,
                           p.pos_limit};
    if ((rc = m.rope(&c, (float *)rows.data_ptr()))) return rc == -1 ? -1 : rc == -3 ? -6 : -2;
    std::atomic<int> failed{0};
    at::parallel_for(0, N * p.nh, std::max<int64_t>(1, ATTEND_GRAIN / std::max<int64_t>(1, p.S * p.hd)),
                     [&](int64_t w0, int64_t w1) {
        if (m.heads(&c, (const float *)rows.data_ptr(), w0, w1)) failed = -1;
    });
    if (failed) return -1;
    o = int4_mm(m, l.lin[WO], a);                                              // [N, D]
    if (l.norm[POST_ATTN_NORM] && (rc = post_norm(m, o, l.norm[POST_ATTN_NORM]))) return rc;
    if ((rc = add_norm(m, x, o, l.norm[FFN_NORM], h))) return rc;
    at::Tensor gu = int4_mm(m, l.lin[W13], h);                                 // [N, 2F]
    int64_t F = gu.size(1) / 2;
    at::Tensor gate = gu.narrow(1, 0, F), up = gu.narrow(1, F, F);
    at::Tensor act = m.gelu ? at::cpu::gelu(gate, "tanh") : at::cpu::silu(gate);
    o = int4_mm(m, l.lin[W2], at::cpu::mul(act, up));                          // [N, D]
    if (l.norm[POST_FFN_NORM] && (rc = post_norm(m, o, l.norm[POST_FFN_NORM]))) return rc;
    return 0;
}

// Layer i's linear `which` made anew as `kind`, its own fields set by fill. 0, or -3 (a bad index, a torch error).
template <class Fill>
int set_linear(void *m, int64_t i, int which, int kind, int64_t n_out, int64_t n_in, int64_t max_rows, Fill fill) {
    try {
        Linear &l = ((Loop *)m)->layers.at(i).lin[which];
        l = Linear();
        l.kind = kind;
        l.n_out = n_out;
        l.n_in = n_in;
        l.max_rows = max_rows;
        fill(l);
        return 0;
    } catch (...) {
        return -3;
    }
}

}  // namespace

extern "C" {

// One native linear over torch's threads (`native.Q4Linear` and `native.Q8Rows` call it where the loop is built),
// with each row's argmax where `top` and top_out are given (see q4_threads).
int specdec_q4_threads(quantize_fn quantize, q4_fn q4, const void *x, int x_bf16, int64_t M, int64_t K,
                       const uint8_t *codes, const float *scale, const float *zero, int64_t N, void *out,
                       int out_bf16, int isa, int threads, top_fn top, int64_t *top_out) {
    try {
        return q4_threads(quantize, q4, x, x_bf16, M, K, codes, scale, zero, N, out, out_bf16, isa, threads, top,
                          top_out);
    } catch (...) {
        return -3;
    }
}

void *specdec_loop_new(int64_t n_layers, int64_t dim, double eps, int gelu, int bf16, rope_fn rope, heads_fn heads,
                       norm_fn norm, quantize_fn quantize) {
    try {
        Loop *m = new Loop();
        m->layers.resize(n_layers);
        m->dim = dim;
        m->eps = eps;
        m->gelu = gelu;
        m->bf16 = bf16;
        m->act = at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat);
        m->rope = rope;
        m->heads = heads;
        m->norm = norm;
        m->quantize = quantize;
        return m;
    } catch (...) {
        return nullptr;
    }
}

void specdec_loop_free(void *m) { delete (Loop *)m; }

// Layer i's linear `which` (0 wqkv, 1 wo, 2 w13, 3 w2) through torch's int4 kernel: packed [N, K / 2] uint8,
// scale_zero [K / 32, N, 2] bfloat16.
int specdec_loop_linear(void *m, int64_t i, int which, void *packed, int64_t N, int64_t K, void *scale_zero,
                        int64_t max_rows) {
    return set_linear(m, i, which, TORCH_INT4, N, K, max_rows, [&](Linear &l) {
        l.packed = at::from_blob(packed, {N, K / 2}, at::TensorOptions().dtype(at::kByte));
        l.scale_zero = at::from_blob(scale_zero, {K / 32, N, 2}, BF16);
    });
}

// ... through a native kernel `matmul` (attend.c's specdec_q4_q8_matmul: codes, scale, zero in native.q4_layout's
// layout; specdec_q8r_q8_matmul: codes and scale d in native.q8_rows_layout's, zero unused), over torch's threads
// or not (`threads`, see q4_threads).
int specdec_loop_rows(void *m, int64_t i, int which, q4_fn matmul, int threads, const uint8_t *codes,
                      const float *scale, const float *zero, int64_t N, int64_t K, int isa, int64_t max_rows) {
    return set_linear(m, i, which, NATIVE_ROWS, N, K, max_rows, [&](Linear &l) {
        l.matmul = matmul;
        l.threads = threads;
        l.codes = codes;
        l.scale = scale;
        l.zero = zero;
        l.isa = isa;
    });
}

// ... through a oneDNN-prepacked weight: `impl` the c10::TensorImpl of the Python tensor (its `_cdata`; a
// reference is kept), inputs and outputs bfloat16 (bf16) or float32.
int specdec_loop_onednn(void *m, int64_t i, int which, void *impl, int bf16, int pair, int64_t max_rows) {
    return set_linear(m, i, which, ONEDNN, 0, 0, max_rows, [&](Linear &l) {
        l.weight = at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(
            (c10::TensorImpl *)impl));
        l.dtype = bf16 ? at::kBFloat16 : at::kFloat;
        l.pair = pair;
    });
}

// Layer i's norm weights (float32 [D] or [hd]; nullptr: none) and whether it attends locally.
int specdec_loop_norms(void *m, int64_t i, const float *attn, const float *ffn, const float *q, const float *k,
                       const float *post_attn, const float *post_ffn, int local) {
    try {
        Layer &l = ((Loop *)m)->layers.at(i);
        const float *w[N_NORMS] = {attn, ffn, q, k, post_attn, post_ffn};
        std::memcpy(l.norm, w, sizeof w);
        l.local = local;
        return 0;
    } catch (...) {
        return -3;
    }
}

// Layers [first, last) (first < last) over N rows: x [N, D] (the activations' dtype) the residual stream before o [N, D] (nullptr: nothing
// to add) is added. Writes the last layer's (x, o) to x_out, o_out; with final_w (the final norm's float32 [D]
// weight), x + o to x_out and its norm to o_out instead (decoder.Transformer.final_norm's bits). Returns 0, -1 out
// of memory, -2 too many query heads per kv head, -3 a torch error, -4 more rows than a linear's checked limit, -5
// no such layers, -6 a position outside the rope tables.
int specdec_loop_run(void *mp, int64_t first, int64_t last, const void *x, const void *o, int64_t N,
                     const specdec_plan *global, const specdec_plan *local, const float *final_w, void *x_out,
                     void *o_out) {
    const Loop &m = *(Loop *)mp;
    try {
        if (first < 0 || first >= last || last > (int64_t)m.layers.size()) return -5;
        int64_t bytes = N * m.dim * (m.bf16 ? 2 : 4);
        at::Tensor xs = fresh({N, m.dim}, m.act), os;
        std::memcpy(xs.data_ptr(), x, bytes);
        if (o) {
            os = fresh({N, m.dim}, m.act);
            std::memcpy(os.data_ptr(), o, bytes);
        }
        for (int64_t i = first; i < last; i++) {
            const Layer &l = m.layers[i];
            for (const Linear &lin : l.lin)
                if (N > lin.max_rows) return -4;
            int rc = run_layer(m, (int)i, l.local ? *local : *global, xs, os);
            if (rc) return rc;
        }
        if (final_w) {
            at::Tensor h;
            if (int rc = add_norm(m, xs, os, final_w, h)) return rc;
            os = h;
        }
        std::memcpy(x_out, xs.data_ptr(), bytes);
        std::memcpy(o_out, os.data_ptr(), bytes);
        return 0;
    } catch (...) {
        return -3;
    }
}

}  // extern "C"
