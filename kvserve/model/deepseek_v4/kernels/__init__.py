"""Triton kernels of DeepSeek V4 attention, reading and writing the paged V4
storage directly (layout: cache/v4_specs.py, addressing: pages.py).

One layer's step on the kernel path: `write_rows` stores the new sliding
K=V and compressor-state rows; `compress` pools every window a token closes
into its entry (compressor, and the indexer's own compressor on CSA layers);
`index_top_k` scores each query's visible indexer keys and picks its top-k;
`sparse_attention` attends to window + chosen (CSA) or all visible (HCA)
entries with the per-head sinks. Every output buffer is written in full each
step, whatever the batch, so the launches can be captured in CUDA graphs.
"""
from kvserve.model.deepseek_v4.kernels.compressor import compress
from kvserve.model.deepseek_v4.kernels.indexer import index_scores, index_top_k, top_k_indices
from kvserve.model.deepseek_v4.kernels.pages import PageRef, V4PagedBatch, write_rows
from kvserve.model.deepseek_v4.kernels.sparse_attention import SparseAttentionConfig, sparse_attention



def unsupported_reason(config) -> str | None:
    """Why the kernels cannot run a `DeepseekV4Config` (None: they can). Both
    products of a tile need power-of-two head dims of at least 16."""
    dims = {"head_dim": config.head_dim}
    if "compressed_sparse_attention" in config.layer_types:
        dims["index_head_dim"] = config.index_head_dim
    for name, dim in dims.items():
        if dim < 16 or dim & (dim - 1):
            return f"{name} must be a power of two >= 16, got {dim}"
    return None


__all__ = ["unsupported_reason", "PageRef", "V4PagedBatch", "write_rows", "compress", "index_scores",
           "top_k_indices", "index_top_k", "sparse_attention", "SparseAttentionConfig"]
