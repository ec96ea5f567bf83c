"""Tokenizers from files: a checkpoint directory's ``tokenizer.json`` (with the chat template and
special tokens of its ``tokenizer_config.json``), a GGUF file's vocabulary, or the byte tokenizer.

Invariants: files are opened only through :class:`~pagedkv.loaders.files.CheckpointFile`; a
tokenizer with more ids than its model is refused before it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pagedkv.errors import CheckpointError, InvalidArgumentError
from pagedkv.loaders.files import CheckpointFile, is_present
from pagedkv.models.config import _Fields
from pagedkv.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["TOKENIZER_FILE", "load_tokenizer", "tokenizer_from_file", "tokenizer_from_gguf_metadata"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def tokenizer_from_file(file: str | Path | CheckpointFile) -> HFTokenizer:
    """Loads a ``tokenizer.json``: a :class:`CheckpointFile`, or a path, which must be a
    regular file inside its own directory."""
    from tokenizers import Tokenizer as _Tokenizer

    if not isinstance(file, CheckpointFile):
        file = CheckpointFile.locate(Path(file).parent, Path(file).name)
    text = file.read_text()
    try:
        tokenizer = _Tokenizer.from_str(text)
    except Exception as error:  # the tokenizers package raises a bare Exception on bad files
        raise CheckpointError(file.path, f"cannot load tokenizer: {error}") from error
    directory = file.path.parent
    if not is_present(directory, TOKENIZER_CONFIG_FILE):
        return HFTokenizer(tokenizer, file.path)
    return HFTokenizer(tokenizer, file.path, *_chat_settings(CheckpointFile.locate(directory, TOKENIZER_CONFIG_FILE)))

def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], path: Path, model_vocab_size: int) -> HFTokenizer:
    """The byte-level BPE tokenizer a GGUF file describes (``tokenizer.ggml.model`` "gpt2",
    as llama.cpp's converter writes every tokenizer.json BPE): ``tokenizer.ggml.tokens`` are
    the vocabulary in id order, ``merges`` the BPE merges by rank, ``token_type`` marks
    control tokens (special: matched whole in text, skipped by decode) and user-defined ones
    (matched whole, kept by decode). ``tokenizer.ggml.pre`` names the pre-tokenizer; those of
    :data:`_GGUF_PRE_TOKENIZERS` are supported. ``add_bos_token`` (default false) makes
    :meth:`encode` prepend ``bos_token_id``, ``add_eos_token`` append ``eos_token_id``;
    ``tokenizer.chat_template`` becomes :attr:`chat_template`. Raises :class:`CheckpointError`
    naming ``path`` for another tokenizer model or pre-tokenizer, malformed vocabulary
    metadata, or more tokens than the model's ``model_vocab_size`` (checked before anything is
    built from them)."""
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as _Tokenizer

    def fail(detail: str) -> CheckpointError:
        return CheckpointError(path, f"GGUF tokenizer metadata: {detail}")

    f = _Fields(metadata)
    try:
        kind, pre = f.str_("tokenizer.ggml.model"), f.str_("tokenizer.ggml.pre", "default")
        tokens = f.get("tokenizer.ggml.tokens", _is_str_list, "a list of strings")
        merges = f.get("tokenizer.ggml.merges", _is_str_list, "a list of strings")
        types = f.get("tokenizer.ggml.token_type",
                      lambda v: isinstance(v, list) and len(v) == len(tokens) and all(isinstance(t, int) for t in v),
                      "a list of one integer per token", [_NORMAL] * len(tokens))
        # The ids encode() adds before and after the text (a key is required only when used).
        added_ids = [f.int_(f"tokenizer.ggml.{end}_token_id") if f.bool_(f"tokenizer.ggml.add_{end}_token", False)
                     else None for end in ("bos", "eos")]
        chat_template = f.str_("tokenizer.chat_template", None)
    except InvalidArgumentError as error:
        raise fail(str(error)) from None
    if len(tokens) > model_vocab_size:
        raise fail(f"{len(tokens)} tokens, but the model has only {model_vocab_size} ids")
    if kind != "gpt2":
        raise fail(f"tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', a byte-level BPE)")
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise fail(f"tokenizer.ggml.pre {pre!r} is not supported ({', '.join(sorted(_GGUF_PRE_TOKENIZERS))})")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise fail("tokenizer.ggml.tokens holds a token twice")
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if not all(len(pair) == 2 and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab for pair in pairs):
        raise fail("a merge is not two vocabulary tokens, separated by a space, whose join is one too")
    if any(i is not None and not 0 <= i < len(tokens) for i in added_ids):
        raise fail(f"tokenizer.ggml.bos_token_id or eos_token_id ({added_ids}) is not a token id")
    try:
        tokenizer = _Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    except Exception as error:  # the tokenizers package raises a bare Exception
        raise fail(f"cannot build the BPE: {error}") from error
    tokenizer.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    added = [AddedToken(token, special=token_type == _CONTROL, normalized=False)
             for token, token_type in zip(tokens, types, strict=True) if token_type in (_CONTROL, _USER_DEFINED)]
    tokenizer.add_tokens(added)  # each is already in the vocabulary: its id is kept
    bos, eos = added_ids
    pieces = ([tokens[bos]] if bos is not None else []) + ["$A"] + ([tokens[eos]] if eos is not None else [])
    if len(pieces) > 1:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(pieces), special_tokens=[(tokens[i], i) for i in {bos, eos} - {None}])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise fail("an added token got an id of its own (its text is not its vocabulary entry)")
    # The text a chat template writes for bos and eos (config.py checks the ids themselves).
    bos_token, eos_token = (tokens[i] if isinstance(i := metadata.get(f"tokenizer.ggml.{end}_token_id"), int)
                            and 0 <= i < len(tokens) else "" for end in ("bos", "eos"))
    return HFTokenizer(tokenizer, path, chat_template, bos_token, eos_token)


def _chat_settings(file: CheckpointFile) -> tuple[str | None, str, str]:
    """The chat template and the bos and eos token text of a ``tokenizer_config.json``: its
    ``chat_template`` is a string, or a list of ``{name, template}`` of which "default" is taken;
    a token is a string or an added-token dict with ``content``. Raises :class:`CheckpointError`
    for other shapes."""
    config = file.read_json()
    if not isinstance(config, dict):
        raise CheckpointError(file.path, "not a JSON object")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(file.path, "chat_template must be a string or a list of {name, template} with a 'default'")

    def token(key: str) -> str:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(value, str):
            raise CheckpointError(file.path, f"{key} must be a string or a dict with a string 'content'")
        return value or ""

    return template, token("bos_token"), token("eos_token")


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


# llama.cpp's token types (gguf.TokenType) this module distinguishes; the others are plain BPE tokens.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _byte_level() -> Any:
    """GPT-2's split (contractions, letter runs, digit runs, other runs, spaces), then bytes to
    the printable characters the BPE vocabulary is written in."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> Any:
    """Each digit a piece of its own, then :func:`_byte_level` (SmolLM's tokenizer.json)."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# tokenizer.ggml.pre -> the tokenizers pre-tokenizer doing what llama.cpp's regexes for it do.
_GGUF_PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {"gpt2": _byte_level, "smollm": _digits_then_byte_level}


def load_tokenizer(checkpoint_dir: str | Path | None, vocab_size: int) -> Tokenizer:
    """The tokenizer for a model of ``vocab_size`` ids: ``checkpoint_dir/tokenizer.json`` if the
    directory has that entry, else a :class:`ByteTokenizer`. Raises :class:`CheckpointError` when
    the entry is not a regular file inside the directory or not a tokenizer, and
    :class:`InvalidArgumentError` when the chosen tokenizer produces ids the model does not have."""
    tokenizer: Tokenizer
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if directory is not None and is_present(directory, TOKENIZER_FILE):
        tokenizer = tokenizer_from_file(CheckpointFile.locate(directory, TOKENIZER_FILE))
    else:
        tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > vocab_size:
        source = tokenizer.path if isinstance(tokenizer, HFTokenizer) else "the byte tokenizer"
        raise InvalidArgumentError(f"{source} has {tokenizer.vocab_size} ids but the model only {vocab_size}")
    return tokenizer
