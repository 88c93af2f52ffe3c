"""ModelConfig: the one validated, frozen description of a Llama-family model.

Owns translating an HF `config.json` dict (after `hf_overrides`) into the
fields the model and the KV cache need, including the per-layer attention
specs. Sliding-window semantics follow transformers 5.x exactly: a window W
lets a query see W keys including itself (`kv_idx > q_idx - W` in
`masking_utils.sliding_window_overlay`), which is `SlidingWindowSpec(window=W)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvserve.cache.specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM",
                           "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# transformers' per-architecture defaults for keys a config.json may omit.
_DEFAULT_ROPE_THETA = 10000.0
_QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
_DEFAULT_SLIDING_WINDOW = 4096


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (HF rope_type "llama3")."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    layer_specs: tuple[AttentionSpec, ...]
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if len(self.layer_specs) != self.num_hidden_layers:
            raise ValueError(f"layer_specs has {len(self.layer_specs)} entries for "
                             f"{self.num_hidden_layers} layers")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"rms_norm_eps ({self.rms_norm_eps}) and rope_theta "
                             f"({self.rope_theta}) must be > 0")

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any],
                       hf_overrides: dict[str, Any] | None = None,
                       generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """Parse an HF config dict; `hf_overrides` keys replace the dict's first.

        `generation_config` (generation_config.json) contributes eos ids, as HF
        `generate` stops on those too.
        """
        cfg = {**hf_config, **(hf_overrides or {})}
        arch = _architecture(cfg)
        _reject_unsupported_options(cfg)
        theta, scaling = _rope(cfg)
        num_heads = _required(cfg, "num_attention_heads")
        return cls(
            architecture=arch,
            vocab_size=_required(cfg, "vocab_size"),
            hidden_size=_required(cfg, "hidden_size"),
            intermediate_size=_required(cfg, "intermediate_size"),
            num_hidden_layers=_required(cfg, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=_head_dim(cfg, arch),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or _attention_bias(cfg, arch),
            o_proj_bias=_attention_bias(cfg, arch),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids(cfg, generation_config or {}),
            bos_token_id=cfg.get("bos_token_id"),
            layer_specs=_layer_specs(cfg, arch),
        )


def _required(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"model config is missing required field {key!r}")
    return cfg[key]


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs[0]!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        return archs[0]
    model_type = cfg.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(f"model config names no architecture (model_type={model_type!r}); "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _reject_unsupported_options(cfg: dict[str, Any]) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")


def _head_dim(cfg: dict[str, Any], arch: str) -> int:
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if arch == "Qwen3ForCausalLM":  # Qwen3Config's default is 128, not hidden/heads.
        return 128
    return _required(cfg, "hidden_size") // _required(cfg, "num_attention_heads")


def _attention_bias(cfg: dict[str, Any], arch: str) -> bool:
    """Llama/Qwen3 `attention_bias` covers q, k, v and o; Mistral has none;
    Qwen2 always biases q/k/v (handled by the caller) and never o."""
    if arch in ("MistralForCausalLM", "Qwen2ForCausalLM"):
        return False
    return bool(cfg.get("attention_bias", False))


def _rope(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Read transformers-5 `rope_parameters` or the older `rope_theta` +
    `rope_scaling` pair (transformers merges them the same way)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, llama3")
    return theta, Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))))


def eos_ids(cfg: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids from config.json and generation_config.json, each once, in order."""
    ids: list[int] = []
    for source in (cfg.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token in source if isinstance(source, list) else [source]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


def _layer_specs(cfg: dict[str, Any], arch: str) -> tuple[AttentionSpec, ...]:
    num_layers = _required(cfg, "num_hidden_layers")
    window = _sliding_window(cfg, arch)
    if window is None:
        return (FullAttentionSpec(),) * num_layers
    sliding = SlidingWindowSpec(window=int(window), sink=int(cfg.get("attention_sink_size", 0)))
    layer_types = _layer_types(cfg, arch, num_layers)
    for kind in layer_types:
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"unsupported layer type {kind!r} in layer_types; "
                             "supported: full_attention, sliding_attention")
    return tuple(sliding if kind == "sliding_attention" else FullAttentionSpec()
                 for kind in layer_types)


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """The window HF would use, or None when no layer slides."""
    if arch == "LlamaForCausalLM":
        return None  # HF Llama ignores sliding_window entirely.
    window = cfg.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window"):
        return None  # Qwen2/3Config null the window unless use_sliding_window.
    return window


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    if arch == "MistralForCausalLM":
        return ["sliding_attention"] * num_layers  # HF Mistral ignores layer_types.
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        # Qwen2/3: layers at index >= max_window_layers slide, the first ones are full.
        first_sliding = cfg.get("max_window_layers", _QWEN_DEFAULT_MAX_WINDOW_LAYERS)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention"
                       for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return list(layer_types)
