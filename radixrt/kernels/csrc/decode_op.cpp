// The compiled decode step's attention as a registered torch operator (radixrt/kernels/decode_op.py): per
// layer it stores the new token's K/V rows in the pool and runs the C paged decode kernel (paged_decode.c,
// reached through function pointers that Python takes from the ctypes-loaded library), with the cascade over
// a shared prefix (SDPA with log-sum-exp, then paged_decode_prefixed) when the step planned one. Called from
// the inductor graphs without Python: the Python op it replaces spent ~25 us a layer in wrappers.
//
// State (one forward in flight per thread): `bind` sets the pool's per-layer buffers and
// kernels once, `begin` the step's tables, `decode` runs one layer (layers in order: each consumes the
// previous layer's output), `finish` returns how many layers ran and the seconds spent in them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// paged_decode_bf16 / _f32 (q, q_stride, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
// seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads) -> status
using DecodeFn = int (*)(const void*, int64_t, const void*, const void*, int64_t, const int64_t*, int64_t, int64_t,
                         const int64_t*, int64_t, int64_t, int64_t, int64_t, float, int64_t, void*, int);
// paged_decode_prefixed: the same, then q_bf16, prefix_out, prefix_lse
using PrefixedFn = int (*)(const void*, int64_t, const void*, const void*, int64_t, const int64_t*, int64_t,
                           int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, float, int64_t, void*, int,
                           int, const void*, const float*);

// The pool's buffers by address, not owned: Python binds them again before any step of another pool (and
// keeps them alive meanwhile), so a freed engine's pool is never held here.
struct Bound {
    std::vector<void*> k, v;
    int64_t num_slots = 0, kvh = 0, dim = 0;
    at::ScalarType dtype = at::kFloat;
    DecodeFn decode = nullptr;
    PrefixedFn prefixed = nullptr;
    double scale = 1.0;
    int64_t window = 0;
};

struct Step {
    at::Tensor table, lens, loc;
    int64_t prefix_start = 0, prefix_len = 0;  // prefix_len 0: no cascade
    at::Tensor not_sharing;                     // [B] bool, or undefined when every request shares the prefix
    int64_t threads = 1, layer = 0;
    double seconds = 0.0;
    bool active = false;
};

// Per thread: each engine runs its steps on its own scheduler thread (several engines may share a process).
thread_local Bound g_bound;
thread_local Step g_step;

at::Tensor pool_view(void* data) {
    return at::from_blob(data, {g_bound.num_slots, g_bound.kvh, g_bound.dim}, at::TensorOptions().dtype(g_bound.dtype));
}

void bind(std::vector<at::Tensor> k_bufs, std::vector<at::Tensor> v_bufs, int64_t decode_fn, int64_t prefixed_fn,
          double scale, int64_t window) {
    TORCH_CHECK(k_bufs.size() == v_bufs.size() && !k_bufs.empty(), "radixrt_attn.bind: one K and V buffer a layer");
    for (size_t i = 0; i < k_bufs.size(); i++) {
        const auto& k = k_bufs[i];
        const auto& v = v_bufs[i];
        TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                        k.scalar_type() == v.scalar_type() &&
                        (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat),
                    "radixrt_attn.bind: buffers must be contiguous [num_slots, KVH, D] bf16 / f32 pairs");
    }
    TORCH_CHECK(decode_fn != 0 && prefixed_fn != 0, "radixrt_attn.bind: kernel addresses missing");
    Bound b;
    b.num_slots = k_bufs[0].size(0);
    b.kvh = k_bufs[0].size(1);
    b.dim = k_bufs[0].size(2);
    b.dtype = k_bufs[0].scalar_type();
    for (size_t i = 0; i < k_bufs.size(); i++) {
        TORCH_CHECK(k_bufs[i].sizes() == k_bufs[0].sizes() && k_bufs[i].scalar_type() == b.dtype,
                    "radixrt_attn.bind: every layer's buffers must have one shape and dtype");
        b.k.push_back(k_bufs[i].data_ptr());
        b.v.push_back(v_bufs[i].data_ptr());
    }
    b.decode = reinterpret_cast<DecodeFn>(decode_fn);
    b.prefixed = reinterpret_cast<PrefixedFn>(prefixed_fn);
    b.scale = scale;
    b.window = window;
    g_bound = std::move(b);
}

void begin(at::Tensor table, at::Tensor lens, at::Tensor loc, int64_t threads, int64_t prefix_start,
           int64_t prefix_len, std::optional<at::Tensor> not_sharing) {
    TORCH_CHECK(!g_bound.k.empty(), "radixrt_attn.begin before bind");
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && (table.size(1) <= 1 || table.stride(1) == 1),
                "radixrt_attn.begin: slot table must be [B, W] int64 with a unit inner stride");
    TORCH_CHECK(lens.dim() == 1 && lens.scalar_type() == at::kLong && lens.is_contiguous() &&
                    lens.size(0) == table.size(0),
                "radixrt_attn.begin: seq_lens must be contiguous int64 [B]");
    TORCH_CHECK(loc.dim() == 1 && loc.scalar_type() == at::kLong && loc.is_contiguous() && loc.size(0) == lens.size(0),
                "radixrt_attn.begin: out_cache_loc must be contiguous int64 [B]");
    const int64_t num_slots = g_bound.num_slots;
    const int64_t* l = loc.data_ptr<int64_t>();
    for (int64_t i = 0; i < loc.size(0); i++)
        TORCH_CHECK(l[i] >= 0 && l[i] < num_slots, "radixrt_attn.begin: out_cache_loc outside the pool");
    TORCH_CHECK(prefix_len == 0 || (prefix_start >= 0 && prefix_start + prefix_len <= num_slots),
                "radixrt_attn.begin: shared prefix outside the pool");
    g_step = Step{std::move(table), std::move(lens), std::move(loc), prefix_start, prefix_len,
                  not_sharing.has_value() ? *not_sharing : at::Tensor(), std::max<int64_t>(threads, 1), 0, 0.0,
                  true};
}

std::tuple<int64_t, double> finish() {
    const auto out = std::make_tuple(g_step.layer, g_step.seconds);
    g_step = Step{};
    return out;
}

// rows of src [B, KVH, D] (any strides) into buf[loc[i]]
void store_rows(const at::Tensor& buf, const at::Tensor& src, const at::Tensor& loc) {
    const int64_t B = src.size(0), row = buf.size(1) * buf.size(2);
    const int64_t* l = loc.data_ptr<int64_t>();
    if (src.scalar_type() == buf.scalar_type() && src.stride(2) == 1 && src.stride(1) == buf.size(2)) {
        const size_t bytes = static_cast<size_t>(row) * buf.element_size();
        char* dst = static_cast<char*>(buf.data_ptr());
        const char* s = static_cast<const char*>(src.data_ptr());
        for (int64_t i = 0; i < B; i++)
            std::memcpy(dst + l[i] * bytes, s + i * src.stride(0) * src.element_size(), bytes);
        return;
    }
    buf.index_copy_(0, loc, src.to(buf.scalar_type()));
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const auto t0 = std::chrono::steady_clock::now();
    TORCH_CHECK(g_step.active, "radixrt_attn.decode outside a compiled forward");
    const int64_t layer = g_step.layer++;
    TORCH_CHECK(layer < static_cast<int64_t>(g_bound.k.size()), "radixrt_attn.decode: more layers than bound");
    const at::Tensor kb = pool_view(g_bound.k[layer]);
    const at::Tensor vb = pool_view(g_bound.v[layer]);
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kb.size(1), num_slots = kb.size(0);
    TORCH_CHECK(q.scalar_type() == kb.scalar_type() && q.stride(2) == 1 && (H == 1 || q.stride(1) == D) &&
                    kb.size(2) == D && H % KVH == 0 && B == g_step.lens.size(0),
                "radixrt_attn.decode: q does not fit the pool or the step");
    TORCH_CHECK(k.dim() == 3 && k.size(0) == B && k.size(1) == KVH && k.size(2) == D && v.sizes() == k.sizes(),
                "radixrt_attn.decode: k / v must be [B, KVH, D]");
    store_rows(kb, k, g_step.loc);
    store_rows(vb, v, g_step.loc);
    at::Tensor out = at::empty({B, H, D}, q.options());
    const int bf16 = q.scalar_type() == at::kBFloat16;
    const float scale = static_cast<float>(g_bound.scale);
    const at::Tensor& table = g_step.table;
    int status;
    if (g_step.prefix_len > 0) {
        const int64_t G = H / KVH, end = g_step.prefix_start + g_step.prefix_len;
        const at::Tensor keys = kb.slice(0, g_step.prefix_start, end).transpose(0, 1).unsqueeze(0);
        const at::Tensor values = vb.slice(0, g_step.prefix_start, end).transpose(0, 1).unsqueeze(0);
        const at::Tensor queries = q.reshape({B, KVH, G, D}).transpose(0, 1).reshape({1, KVH, B * G, D});
        auto [pre_out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(queries, keys, values, 0.0, false,
                                                                              std::nullopt, g_bound.scale);
        pre_out = pre_out.contiguous();
        lse = lse.contiguous();
        if (g_step.not_sharing.defined())
            lse.view({KVH, B, G}).masked_fill_(g_step.not_sharing.view({1, B, 1}),
                                               -std::numeric_limits<float>::infinity());
        status = g_bound.prefixed(q.data_ptr(), q.stride(0), kb.data_ptr(), vb.data_ptr(), num_slots,
                                  table.data_ptr<int64_t>(), table.stride(0), table.size(1),
                                  g_step.lens.data_ptr<int64_t>(), B, H, KVH, D, scale, 0, out.data_ptr(),
                                  static_cast<int>(g_step.threads), bf16, pre_out.data_ptr(), lse.data_ptr<float>());
    } else {
        status = g_bound.decode(q.data_ptr(), q.stride(0), kb.data_ptr(), vb.data_ptr(), num_slots,
                                table.data_ptr<int64_t>(), table.stride(0), table.size(1),
                                g_step.lens.data_ptr<int64_t>(), B, H, KVH, D, scale, g_bound.window, out.data_ptr(),
                                static_cast<int>(g_step.threads));
    }
    TORCH_CHECK(status == 0, "radixrt_attn.decode: the paged decode kernel returned status ", status,
                " (1: a seq_len outside the slot table, 2: a slot outside the pool, 3: out of memory)");
    g_step.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
}

}  // namespace

TORCH_LIBRARY(radixrt_attn, m) {
    m.def("bind(Tensor[] k_bufs, Tensor[] v_bufs, int decode_fn, int prefixed_fn, float scale, int window) -> ()",
          bind);
    m.def("begin(Tensor table, Tensor lens, Tensor loc, int threads, int prefix_start, int prefix_len, "
          "Tensor? not_sharing) -> ()",
          begin);
    m.def("finish() -> (int, float)", finish);
    m.def("decode(Tensor q, Tensor k, Tensor v) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixrt_attn, CPU, m) { m.impl("decode", decode); }
