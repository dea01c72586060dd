// The Token Table's per-step writes on the CPU, each in one op (core/token_table.py, core/row_reads.py): what the
// torch ops there do in ten to twenty small ops, every one of which costs tens of microseconds right after a
// forward on a CPU. Same results, bit for bit (integers, and float sums in the torch ops' order).
//
// register_tokens: TokenTable.sync_new_tokens(rows, counts, claim_pages=claim) for tokens the engine already wrote
//   into the row store. Per row r (distinct) and k < counts: slot s = slots[r, live_len[r] + k] gets logical id
//   logical_len[r] + k, its per-slot policy state zeroed if it had no reader, one more reader; its page
//   p = s / page_size is claimed by r when untracked (owner -1) and claim is set, and counts one more live token
//   when private (owner >= 0). Then live_len[r] and logical_len[r] grow by counts.
// fold_rows: RowReads.add_row_state ("sum": every live entry of rows[i] in columns j < min(live_len, width) adds
//   values[i, j] to its state cell) and set_row_state ("set": writes it). The cell of entry (r, j) is the row's
//   own, pool_slots + shared_base[r] + j, for j < n_shared[r] (its shared prefix), else its slot (state_store.py):
//   every entry has a cell of its own (rows distinct).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

constexpr int32_t kFree = -1;  // pages.FREE

int64_t checked_slot(const int32_t* row_store, int64_t at, int64_t pool_slots) {
  const int64_t s = row_store[at];
  TORCH_CHECK(s >= 0 && s < pool_slots, "a row holds slot ", s, ", outside the pool's ", pool_slots, " slots");
  return s;
}

void check_table_tensors(const at::Tensor& slots, const at::Tensor& live_len) {
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kInt && slots.is_contiguous(),
              "slots: the row store, int32 [rows, context], contiguous");
  TORCH_CHECK(live_len.scalar_type() == at::kLong && live_len.is_contiguous() && live_len.numel() == slots.size(0),
              "live_len: int64 [rows]");
}

void register_tokens(const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& counts, at::Tensor live_len,
                     at::Tensor logical_len, at::Tensor logical, at::Tensor readers, at::TensorList states,
                     at::Tensor owner, at::Tensor page_live, int64_t page_size, bool claim) {
  check_table_tensors(slots, live_len);
  TORCH_CHECK(logical_len.scalar_type() == at::kLong && logical_len.is_contiguous(), "logical_len: int64 [rows]");
  TORCH_CHECK(logical.scalar_type() == at::kInt && readers.scalar_type() == at::kInt && logical.is_contiguous() &&
                  readers.is_contiguous() && readers.numel() == logical.numel(),
              "logical, readers: int32 [pool slots]");
  TORCH_CHECK(owner.scalar_type() == at::kInt && page_live.scalar_type() == at::kInt && owner.is_contiguous() &&
                  page_live.is_contiguous() && owner.numel() * page_size == logical.numel(),
              "owner, page_live: int32 [pages]");
  std::vector<float*> state;
  for (const auto& t : states) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() >= logical.numel(),
                "states: float32 [pool slots + extents]");
    state.push_back(t.data_ptr<float>());
  }
  const auto r_idx = rows.to(at::kLong).contiguous();
  const auto n_new = counts.to(at::kLong).contiguous();
  TORCH_CHECK(r_idx.numel() == n_new.numel(), "one count per row");
  const int64_t num_rows = slots.size(0), context = slots.size(1), pool_slots = logical.numel();
  const int32_t* store = slots.data_ptr<int32_t>();
  int64_t* live = live_len.data_ptr<int64_t>();
  int64_t* next_logical = logical_len.data_ptr<int64_t>();
  int32_t* slot_logical = logical.data_ptr<int32_t>();
  int32_t* slot_readers = readers.data_ptr<int32_t>();
  int32_t* page_owner = owner.data_ptr<int32_t>();
  int32_t* live_tokens = page_live.data_ptr<int32_t>();
  for (int64_t i = 0; i < r_idx.numel(); ++i) {
    const int64_t r = r_idx.data_ptr<int64_t>()[i], n = n_new.data_ptr<int64_t>()[i];
    TORCH_CHECK(r >= 0 && r < num_rows && n >= 0, "row ", r, " with ", n, " tokens");
    TORCH_CHECK(live[r] + n <= context, "row overflow");
    for (int64_t k = 0; k < n; ++k) {
      const int64_t s = checked_slot(store, r * context + live[r] + k, pool_slots);
      slot_logical[s] = static_cast<int32_t>(next_logical[r] + k);
      if (slot_readers[s] == 0) {
        for (float* t : state) t[s] = 0.f;
      }
      slot_readers[s] += 1;
      const int64_t p = s / page_size;
      if (claim && page_owner[p] == kFree) page_owner[p] = static_cast<int32_t>(r);
      if (page_owner[p] >= 0) {
        live_tokens[p] += 1;
        TORCH_CHECK(live_tokens[p] <= page_size, "a page's live count left [0, page_size]");
      }
    }
    live[r] += n;
    next_logical[r] += n;
  }
}

void fold_rows(at::Tensor state, const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& live_len,
               const at::Tensor& n_shared, const at::Tensor& shared_base, int64_t pool_slots, const at::Tensor& values,
               c10::string_view reduce) {
  check_table_tensors(slots, live_len);
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.numel() >= pool_slots,
              "state: float32 [pool slots + extents]");
  TORCH_CHECK(n_shared.scalar_type() == at::kLong && shared_base.scalar_type() == at::kLong &&
                  n_shared.is_contiguous() && shared_base.is_contiguous() && n_shared.numel() == slots.size(0) &&
                  shared_base.numel() == slots.size(0),
              "n_shared, shared_base: int64 [rows]");
  TORCH_CHECK(values.dim() == 2 && values.size(0) == rows.numel(), "values: [rows, width]");
  const bool set = reduce == "set";
  TORCH_CHECK(set || reduce == "sum", "reduce: sum or set");
  const auto r_idx = rows.to(at::kLong).contiguous();
  const auto v = values.to(at::kFloat).contiguous();
  const int64_t context = slots.size(1), width = v.size(1), cells = state.numel();
  const int32_t* store = slots.data_ptr<int32_t>();
  const int64_t* live = live_len.data_ptr<int64_t>();
  const int64_t* shared = n_shared.data_ptr<int64_t>();
  const int64_t* base = shared_base.data_ptr<int64_t>();
  const int64_t* r_ptr = r_idx.data_ptr<int64_t>();
  const float* val = v.data_ptr<float>();
  float* out = state.data_ptr<float>();
  for (int64_t i = 0; i < r_idx.numel(); ++i) {
    const int64_t r = r_ptr[i];
    TORCH_CHECK(r >= 0 && r < slots.size(0), "row ", r, " out of range");
    const int64_t n = std::min(live[r], width), ns = std::min(shared[r], n);
    const float* row_values = val + i * width;
    const int32_t* row_slots = store + r * context;
    TORCH_CHECK(ns == 0 || (base[r] >= 0 && pool_slots + base[r] + ns <= cells), "row ", r,
                "'s shared extent is outside the state's cells");
    float* own = out + pool_slots + base[r];
    for (int64_t j = 0; j < ns; ++j) own[j] = set ? row_values[j] : own[j] + row_values[j];
    for (int64_t j = ns; j < n; ++j) {
      const int64_t s = checked_slot(row_slots, j, pool_slots);
      out[s] = set ? row_values[j] : out[s] + row_values[j];
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vtoken_cpu, m) {
  m.def("register_tokens(Tensor slots, Tensor rows, Tensor counts, Tensor(a!) live_len, Tensor(b!) logical_len, "
        "Tensor(c!) logical, Tensor(d!) readers, Tensor(e!)[] states, Tensor(f!) owner, Tensor(g!) page_live, "
        "int page_size, bool claim) -> ()");
  m.def("fold_rows(Tensor(a!) state, Tensor slots, Tensor rows, Tensor live_len, Tensor n_shared, Tensor shared_base, "
        "int pool_slots, Tensor values, str reduce) -> ()");
}

TORCH_LIBRARY_IMPL(vtoken_cpu, CPU, m) {
  m.impl("register_tokens", &register_tokens);
  m.impl("fold_rows", &fold_rows);
}
