// The signature of the paged-attention entry points (cpu_paged_attention.cpp defines one per
// query and pool type; cpu_layer_stack.cpp calls two), written once; and the prefill kernel's.
//
// q, out: [T, H, D], the step's flat tokens (only the requests below are read and written);
// k, v: one layer of the pool, [slots, KVH, D]; kscale, vscale: [slots, KVH] float32 for a
// quantized pool (row = codes x scale), else null; table: [rows, stride] int32. Per request:
// req_row, req_len (context including its new tokens, all stored), q_start (its first new
// token in q), n_new (its new tokens: 1 for a decode; each attends causally). order: request
// indices grouped, group g = order[group_start[g] .. group_start[g + 1]), sharing its first
// group_prefix[g] slots (0 for a request alone).
#pragma once

#include <cstdint>

#define BANYAN_PAGED_ATTENTION_SIGNATURE(NAME, QT, KT)                                         \
    void NAME(const QT* q, const KT* k, const KT* v, const float* kscale, const float* vscale, \
              const int32_t* table, int64_t table_stride, const int64_t* req_row,             \
              const int64_t* req_len, const int64_t* q_start, const int64_t* n_new,           \
              const int64_t* order, const int64_t* group_start, const int64_t* group_prefix,  \
              int64_t n_groups, QT* out, int64_t heads, int64_t kvh, int64_t d, float scale,  \
              int64_t n_threads)

// The prefill kernel's entry points (cpu_prefill_attention.cpp): the same arguments without
// the grouping (each request attends alone, causally, over its whole context); its tile and
// layer-stack entries add one argument after them.
#define BANYAN_PREFILL_ATTENTION_PARAMS(QT, KT)                                               \
    const QT* q, const KT* k, const KT* v, const float* kscale, const float* vscale,         \
        const int32_t* table, int64_t table_stride, const int64_t* req_row,                  \
        const int64_t* req_len, const int64_t* q_start, const int64_t* n_new, int64_t n_reqs, \
        QT* out, int64_t heads, int64_t kvh, int64_t d, float scale, int64_t n_threads
#define BANYAN_PREFILL_ATTENTION_SIGNATURE(NAME, QT, KT) \
    void NAME(BANYAN_PREFILL_ATTENTION_PARAMS(QT, KT))
