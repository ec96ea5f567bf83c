"""The shape of a Llama-architecture decoder: :class:`LlamaConfig`, with its rotary scaling
:class:`RopeScaling`, and how both are read from a Hugging Face ``config.json``.

Invariants: a constructed config is valid (``__post_init__`` checks every range); JSON types are
checked by one reader, :class:`_Fields`, whose errors name the offending key; a JSON null is a value
of the wrong type except for the keys transformers gives a meaning to when null
(:data:`_NULL_MEANS_ABSENT`); a setting the model does not implement is refused, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from pagedkv.errors import InvalidArgumentError

__all__ = ["LlamaConfig", "RopeScaling", "generation_eos_token_ids", "union_token_ids"]

T = TypeVar("T")

# Dataclass field -> its config.json key, where they differ (for error messages).
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}

# Keys whose null transformers reads as "derive it" or "none": the K/V heads (= query heads), the
# head size (= hidden / heads), the special tokens and the rope settings. Any other null (say
# rms_norm_eps) would reach the model as None in transformers; here it is refused as a wrong type.
_NULL_MEANS_ABSENT = frozenset(
    {"num_key_value_heads", "head_dim", "bos_token_id", "eos_token_id", "rope_scaling", "rope_parameters"}
)

# Keys of a rope settings object (config.json "rope_parameters" or "rope_scaling") this model reads.
_ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
}


@dataclass(frozen=True)
class RopeScaling:
    """A rescaling of the rotary frequencies for contexts longer than pretraining, as transformers
    defines it (the frequencies are computed by :func:`pagedkv.models.rope.rope_frequencies`).

    - ``"linear"``: every frequency divided by ``factor``; the other fields are None.
    - ``"llama3"`` (Llama 3.1 and later): wavelengths shorter than
      ``original_max_position_embeddings / high_freq_factor`` keep their frequency, those longer
      than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and
      those between are interpolated smoothly between the two.
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        _check_rope_type(self.rope_type)
        if not _is_positive_number(self.factor):
            raise InvalidArgumentError(f"rope factor must be a positive number, got {self.factor!r}")
        llama3 = (self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings)
        if self.rope_type == "linear":
            if any(value is not None for value in llama3):
                raise InvalidArgumentError("linear rope scaling takes only a factor")
            return
        low, high, original = llama3
        if not (_is_positive_number(low) and _is_positive_number(high) and low < high):  # type: ignore[operator]
            raise InvalidArgumentError(
                f"llama3 rope needs 0 < low_freq_factor < high_freq_factor, got {low!r} and {high!r}"
            )
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise InvalidArgumentError(
                f"llama3 rope original_max_position_embeddings must be a positive integer, got {original!r}"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``rope_scaling`` object of a ``config.json``."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


@dataclass(frozen=True)
class LlamaConfig:
    """Dimensions and constants of a Llama-family decoder (token embedding, RMSNorm, rotary
    position embedding, grouped-query attention, SwiGLU MLP, LM head).

    ``num_heads`` query heads share ``num_kv_heads`` K/V heads (grouped-query attention), so
    ``num_heads`` must be a multiple of ``num_kv_heads``. ``rope_scaling`` None is plain rotary
    embedding. ``eos_token_ids`` holds every id that ends generation (Llama 3 has several);
    generation stops on any of them.
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
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                hf_name = f" ({_HF_NAMES[name]} in config.json)" if name in _HF_NAMES else ""
                raise InvalidArgumentError(f"{name}{hf_name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if not _is_positive_number(self.rope_theta):
            raise InvalidArgumentError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        if not _is_positive_number(self.rms_norm_eps):
            raise InvalidArgumentError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise InvalidArgumentError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise InvalidArgumentError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        special = [self.bos_token_id, *self.eos_token_ids]
        if any(t is not None and not (_is_int(t) and 0 <= t < self.vocab_size) for t in special):
            raise InvalidArgumentError(f"special token ids {special} must be integers in [0, {self.vocab_size})")

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
        """Reads a Hugging Face Llama ``config.json`` (already parsed). A JSON null counts as an
        absent key only where transformers gives null a meaning (the K/V heads, the head size, the
        special tokens, the rope settings); elsewhere it is a value of the wrong type. Rope
        settings are read from ``rope_parameters`` (transformers ≥ 5) or ``rope_theta`` +
        ``rope_scaling`` (earlier), which must agree where both are given.
        ``eos_token_id`` may be an id or a list of ids. Raises :class:`InvalidArgumentError`,
        naming the key, for a missing key, a value of the wrong type or range, or an
        architecture feature this model does not implement (rope types other than default,
        linear and llama3, partial rotary embedding, attention or MLP biases, an activation
        other than SiLU)."""
        f = _Fields(hf)
        model_type = f.str_("model_type", "llama")
        if model_type != "llama":
            raise InvalidArgumentError(f"model_type {model_type!r} is not supported (only 'llama')")
        hidden_act = f.str_("hidden_act", "silu")
        if hidden_act != "silu":
            raise InvalidArgumentError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        for key in ("attention_bias", "mlp_bias"):
            if f.bool_(key, False):
                raise InvalidArgumentError(f"{key}=true is not supported")
        if f.number("partial_rotary_factor", 1.0) != 1.0:
            raise InvalidArgumentError(f"partial_rotary_factor={hf['partial_rotary_factor']!r} is not supported (only 1.0)")
        hidden_size = f.int_("hidden_size")
        num_heads = f.int_("num_attention_heads")
        # A non-positive num_heads derives no head_dim; __post_init__ then reports num_heads.
        derived_head_dim = hidden_size // num_heads if num_heads > 0 else 0
        rope_theta, rope_scaling = _read_rope(f)
        return cls(
            vocab_size=f.int_("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=f.int_("intermediate_size"),
            num_layers=f.int_("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=f.int_("num_key_value_heads", num_heads),
            head_dim=f.int_("head_dim", derived_head_dim),
            rope_theta=rope_theta,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            max_position_embeddings=f.int_("max_position_embeddings", 2048),
            tie_word_embeddings=f.bool_("tie_word_embeddings", False),
            bos_token_id=f.get("bos_token_id", _is_int, "an integer", None),
            eos_token_ids=f.token_ids("eos_token_id"),
            rope_scaling=rope_scaling,
        )

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
            "rope_scaling": self.rope_scaling.to_hf_dict() if self.rope_scaling else None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }

    def replace(self, **changes: Any) -> LlamaConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def generation_eos_token_ids(generation_config: Mapping[str, Any]) -> tuple[int, ...]:
    """The ``eos_token_id`` (an id or a list of ids) of a parsed ``generation_config.json``."""
    return _Fields(generation_config).token_ids("eos_token_id")


def union_token_ids(*groups: tuple[int, ...]) -> tuple[int, ...]:
    """The ids of every group, each once, in order of first appearance."""
    return tuple(dict.fromkeys(t for group in groups for t in group))


def _read_rope(f: _Fields) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_parameters`` and/or the older ``rope_theta`` +
    ``rope_scaling``; a value given in both places must be the same."""
    sources = [(key, sub) for key in ("rope_parameters", "rope_scaling") if (sub := f.object_(key)) is not None]
    thetas: dict[str, float] = {}
    if (top_theta := f.number("rope_theta", None)) is not None:
        thetas["rope_theta"] = top_theta
    scalings: dict[str, RopeScaling | None] = {}
    for key, sub in sources:
        if (theta := sub.number("rope_theta", None)) is not None:
            thetas[f"{key}.rope_theta"] = theta
        scalings[key] = _read_rope_scaling(sub)
    if len(set(thetas.values())) > 1:
        raise InvalidArgumentError(f"conflicting rope theta: {thetas}")
    if len(set(scalings.values())) > 1:
        raise InvalidArgumentError(f"rope_parameters and rope_scaling disagree: {dict(f.raw(k) for k in scalings)}")
    theta = next(iter(thetas.values()), 10000.0)
    return theta, next(iter(scalings.values()), None)


def _read_rope_scaling(rope: _Fields) -> RopeScaling | None:
    """A rope settings object (None for the default rope type). Keys this model does not read are
    refused: any of them could change the rotation."""
    unknown = sorted(rope.keys() - _ROPE_KEYS)
    if unknown:
        raise InvalidArgumentError(f"{rope.name(unknown[0])} is not supported")
    rope_type = rope.str_("rope_type", None) or rope.str_("type", "default")
    if rope_type == "default":
        return None
    try:
        _check_rope_type(rope_type)  # before reading the keys that type needs
        needed = ... if rope_type == "llama3" else None
        return RopeScaling(
            rope_type=rope_type,
            factor=rope.number("factor"),
            low_freq_factor=rope.number("low_freq_factor", needed),
            high_freq_factor=rope.number("high_freq_factor", needed),
            original_max_position_embeddings=rope.int_("original_max_position_embeddings", needed),
        )
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{rope.name()}: {error}") from None


def _check_rope_type(rope_type: str) -> None:
    if rope_type not in ("linear", "llama3"):
        raise InvalidArgumentError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")


class _Fields:
    """Typed reads of one JSON object: each method returns the value of a key, checked to be of
    the expected JSON type, or the default when the key is absent, or null where null means absent
    (no default: the key is required). Errors name the key (``where`` prefixes keys of nested
    objects)."""

    def __init__(self, obj: Mapping[str, Any], where: str = "") -> None:
        self._obj = obj
        self._where = where

    def get(self, key: str, check: Callable[[Any], bool], expected: str, default: Any = ...) -> Any:
        value = self._obj.get(key)
        if value is None and (key not in self._obj or (key in _NULL_MEANS_ABSENT and not self._where)):
            if default is ...:
                raise InvalidArgumentError(f"missing required key {self._where}{key}")
            return default
        if not check(value):
            self._fail(key, expected, value)
        return value

    def int_(self, key: str, default: Any = ...) -> Any:
        return self.get(key, _is_int, "an integer", default)

    def number(self, key: str, default: Any = ...) -> Any:
        """A JSON number, as a float."""
        value = self.get(key, _is_float_like, "a number", default)
        return float(value) if value is not None else None

    def bool_(self, key: str, default: Any = ...) -> Any:
        return self.get(key, lambda v: isinstance(v, bool), "true or false", default)

    def str_(self, key: str, default: Any = ...) -> Any:
        return self.get(key, lambda v: isinstance(v, str), "a string", default)

    def object_(self, key: str) -> _Fields | None:
        value = self.get(key, lambda v: isinstance(v, dict), "an object", None)
        return None if value is None else _Fields(value, f"{self._where}{key}.")

    def token_ids(self, key: str) -> tuple[int, ...]:
        """An id or a list of ids (absent or null: none), each once, in order."""
        value = self.get(key, lambda v: _is_int(v) or (isinstance(v, list) and all(map(_is_int, v))),
                         "a token id or a list of token ids", None)
        return () if value is None else union_token_ids(tuple(value) if isinstance(value, list) else (value,))

    def keys(self) -> set[str]:
        return set(self._obj)

    def name(self, key: str = "") -> str:
        """How errors name ``key`` of this object (the object itself when empty)."""
        return f"{self._where}{key}" if key else self._where.rstrip(".")

    def raw(self, key: str) -> tuple[str, Any]:
        return self.name(key), self._obj.get(key)

    def _fail(self, key: str, expected: str, value: Any) -> NoReturn:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise InvalidArgumentError(f"{self._where}{key} must be {expected}, got {shown}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_float_like(value: object) -> bool:
    """An int or float that converts to a float (JSON integers may have hundreds of digits)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) <= _FLOAT_MAX)


def _is_positive_number(value: object) -> bool:
    """A finite number above 0 (NaN is not)."""
    return _is_float_like(value) and math.isfinite(value) and value > 0  # type: ignore[arg-type, operator]


_FLOAT_MAX = int(sys.float_info.max)
