"""The shape of a Llama-architecture decoder: :class:`LlamaConfig`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pagedkv.errors import InvalidArgumentError

__all__ = ["LlamaConfig"]

# Hugging Face ``config.json`` keys a Llama checkpoint must have -> LlamaConfig field.
_REQUIRED_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
}


@dataclass(frozen=True)
class LlamaConfig:
    """Dimensions and constants of a Llama-family decoder (token embedding, RMSNorm, rotary
    position embedding, grouped-query attention, SwiGLU MLP, LM head).

    ``num_heads`` query heads share ``num_kv_heads`` K/V heads (grouped-query attention), so
    ``num_heads`` must be a multiple of ``num_kv_heads``. ``eos_token_ids`` is a tuple because
    some checkpoints (Llama 3) stop on several tokens.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise InvalidArgumentError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise InvalidArgumentError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        special = [self.bos_token_id, *self.eos_token_ids]
        if any(t is not None and not 0 <= t < self.vocab_size for t in special):
            raise InvalidArgumentError(f"special token ids {special} must lie in [0, {self.vocab_size})")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one K/V head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """The built-in test and demo model: 4 layers, hidden 256, 8 query heads over 2 K/V heads
        (grouped-query attention), head_dim 32, vocabulary 512 (room for the byte tokenizer's 259
        ids). About 3.3 M parameters, fast enough to serve hundreds of requests on 2 CPU cores."""
        return cls(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=768,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=32,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_ids=(2,),
        )

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """Reads a Hugging Face Llama ``config.json`` (already parsed). Raises
        :class:`InvalidArgumentError` for a missing key or an architecture feature this model does
        not implement (rope scaling, attention or MLP biases, an activation other than SiLU)."""
        missing = [key for key in _REQUIRED_HF_KEYS if key not in hf]
        if missing:
            raise InvalidArgumentError(f"config is missing required keys {missing}")
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise InvalidArgumentError(f"model_type {model_type!r} is not supported (only 'llama')")
        unsupported = {
            "rope_scaling": hf.get("rope_scaling") is not None,
            "attention_bias": bool(hf.get("attention_bias", False)),
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "hidden_act": hf.get("hidden_act", "silu") != "silu",
        }
        for key, present in unsupported.items():
            if present:
                raise InvalidArgumentError(f"config {key}={hf[key]!r} is not supported")
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        fields: dict[str, Any] = {field: hf[key] for key, field in _REQUIRED_HF_KEYS.items()}
        fields.update(
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        return cls(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` content describing this model."""
        eos: int | list[int] | None = (
            self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids) or None
        )
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }

    def replace(self, **changes: Any) -> LlamaConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
