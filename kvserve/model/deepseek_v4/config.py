"""DeepseekV4Config: the validated, frozen description of a DeepSeek V4 model.

Owns translating an HF `config.json` into the fields the model and the KV
cache need. Two spellings exist and both are read:
  * the HF form: `layer_types` (sliding / compressed_sparse / heavily_compressed
    attention), `compress_rates`, `mlp_layer_types`, nested `rope_parameters`;
  * the checkpoint form: per-layer `compress_ratios` (0 / 4 / 128),
    `num_hash_layers`, `qk_rope_head_dim`, a flat YaRN `rope_scaling`.
Semantics follow transformers' `DeepseekV4Config`: YaRN applies only to the
"compress" rope (CSA/HCA layers and their compressors), with attention
factor 1; sliding-only layers use plain RoPE at `rope_theta`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.model.config import eos_ids

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_DEFAULT_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters of the compress rope (attention factor is always 1 in V4)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position_embeddings < 1:
            raise ValueError(f"yarn rope scaling needs factor > 0 and original_max_position_embeddings "
                             f">= 1, got {self.factor} and {self.original_max_position_embeddings}")


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    mlp_layer_types: tuple[str, ...]
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    compress_yarn: YarnScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    architecture: str = "DeepseekV4ForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                     "index_head_dim", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                     "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"DeepSeek V4 config: {name} must be >= 1, got {getattr(self, name)}")
        if self.index_topk < 1:
            raise ValueError(f"DeepSeek V4 config: index_topk must be >= 1, got {self.index_topk}")
        self._check_layers()
        self._check_dims()

    def _check_layers(self) -> None:
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)):
            if len(types) != self.num_hidden_layers:
                raise ValueError(f"DeepSeek V4 config: {name} has {len(types)} entries for "
                                 f"num_hidden_layers={self.num_hidden_layers}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"DeepSeek V4 config: {name} entries must be one of {allowed}, got {bad}")
        for kind, rate in self.compress_rates:
            if rate < 1:
                raise ValueError(f"DeepSeek V4 config: compress rate of {kind} must be >= 1, got {rate}")

    def _check_dims(self) -> None:
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"DeepSeek V4 config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"n_routed_experts ({self.n_routed_experts})")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"DeepSeek V4 config: num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of o_groups ({self.o_groups})")
        rope = self.qk_rope_head_dim
        if rope < 2 or rope % 2 or rope > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"DeepSeek V4 config: qk_rope_head_dim must be even and within 2..min(head_dim, "
                             f"index_head_dim) = {min(self.head_dim, self.index_head_dim)}, got {rope}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"DeepSeek V4 config: scoring_func must be one of {SCORING_FUNCS}, "
                             f"got {self.scoring_func!r}")

    def compress_rate(self, layer_type: str) -> int:
        """Source tokens per compressed entry (0 for sliding-only layers)."""
        return dict(self.compress_rates).get(layer_type, 0)

    @property
    def num_key_value_heads(self) -> int:
        return 1  # one shared K=V head

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any], hf_overrides: dict[str, Any] | None = None,
                       generation_config: dict[str, Any] | None = None) -> "DeepseekV4Config":
        cfg = {**hf_config, **(hf_overrides or {})}
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"DeepSeek V4 config: hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
        if cfg.get("num_key_value_heads", 1) != 1:
            raise ValueError(f"DeepSeek V4 config: num_key_value_heads must be 1 (one shared K=V head), "
                             f"got {cfg['num_key_value_heads']}")
        n = int(_required(cfg, "num_hidden_layers"))
        head_dim = int(cfg.get("head_dim", 512))
        rope_dim = _rope_head_dim(cfg, head_dim)
        main, compress = _rope_dicts(cfg)
        return cls(
            vocab_size=int(_required(cfg, "vocab_size")), hidden_size=int(_required(cfg, "hidden_size")),
            num_hidden_layers=n, num_attention_heads=int(cfg.get("num_attention_heads", 64)),
            head_dim=head_dim, qk_rope_head_dim=rope_dim, q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
            o_groups=int(cfg.get("o_groups", 8)), o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
            sliding_window=int(cfg.get("sliding_window", 128)), layer_types=_layer_types(cfg, n),
            compress_rates=_compress_rates(cfg), index_n_heads=int(cfg.get("index_n_heads", 64)),
            index_head_dim=int(cfg.get("index_head_dim", 128)), index_topk=int(cfg.get("index_topk", 512)),
            mlp_layer_types=_mlp_layer_types(cfg, n),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 2048)),
            n_routed_experts=int(cfg.get("n_routed_experts", 256)),
            n_shared_experts=int(cfg.get("n_shared_experts", 1)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 6)),
            scoring_func=cfg.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)), hc_mult=int(cfg.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)), hc_eps=float(cfg.get("hc_eps", 1e-6)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(main.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            compress_rope_theta=float(compress.get("rope_theta", cfg.get("compress_rope_theta", 160000.0))),
            compress_yarn=_yarn(compress),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(cfg, generation_config or {}), bos_token_id=cfg.get("bos_token_id"))


def is_deepseek_v4(hf_config: dict[str, Any]) -> bool:
    archs = hf_config.get("architectures") or []
    return hf_config.get("model_type") == "deepseek_v4" or "DeepseekV4ForCausalLM" in archs


def _required(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"DeepSeek V4 config is missing required field {key!r}")
    return cfg[key]


def _rope_head_dim(cfg: dict[str, Any], head_dim: int) -> int:
    if cfg.get("qk_rope_head_dim") is not None:
        return int(cfg["qk_rope_head_dim"])
    factor = cfg.get("partial_rotary_factor")
    return int(head_dim * factor) if factor is not None else 64 * head_dim // 512


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratios = list(cfg["compress_ratios"])
        if len(ratios) < n:
            raise ValueError(f"DeepSeek V4 config: compress_ratios has {len(ratios)} entries for "
                             f"num_hidden_layers={n}")
        kinds = {0: SLIDING, 4: CSA, 128: HCA}
        bad = sorted({r for r in ratios[:n] if r not in kinds})
        if bad:
            raise ValueError(f"DeepSeek V4 config: compress_ratios entries must be 0, 4 or 128, got {bad}")
        # Entries past the layer count belong to the MTP layers, which are not run.
        return tuple(kinds[r] for r in ratios[:n])
    if types is None:  # transformers' default: 2 HCA layers, then CSA/HCA interleaved
        return tuple([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])
    return tuple(types)


def _mlp_layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    if cfg.get("mlp_layer_types") is not None:
        return tuple(cfg["mlp_layer_types"])
    num_hash = int(cfg.get("num_hash_layers", 3))
    if num_hash < 0:
        raise ValueError(f"DeepSeek V4 config: num_hash_layers must be >= 0, got {num_hash}")
    return tuple(["hash_moe"] * min(n, num_hash) + ["moe"] * max(0, n - num_hash))


def _compress_rates(cfg: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    rates = dict(_DEFAULT_RATES)
    rates.update(cfg.get("compress_rates") or {})
    for kind, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if cfg.get(key) is not None:
            rates[kind] = int(cfg[key])
    return tuple(sorted((k, int(v)) for k, v in rates.items()))


def _rope_dicts(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, compress) rope parameter dicts from either spelling."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return params["main"], params["compress"]
    flat = dict(params or cfg.get("rope_scaling") or {})
    flat.pop("rope_theta", None)
    return {}, flat


def _yarn(compress: dict[str, Any]) -> YarnScaling | None:
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"DeepSeek V4 config: unsupported compress rope type {kind!r}; supported: default, yarn")
    if compress.get("attention_factor", 1.0) != 1.0:
        raise ValueError("DeepSeek V4 config: the compress rope's attention_factor must be 1.0")
    return YarnScaling(factor=float(compress["factor"]),
                       original_max_position_embeddings=int(compress["original_max_position_embeddings"]),
                       beta_fast=float(compress.get("beta_fast") or 32), beta_slow=float(compress.get("beta_slow") or 1))

