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
    """The tokenizer a GGUF file describes, of either model llama.cpp's converter writes:

    - ``tokenizer.ggml.model`` "gpt2", a byte-level BPE: ``tokens`` are the vocabulary in id order
      and ``merges`` the BPE merges by rank; ``tokenizer.ggml.pre`` names the pre-tokenizer (those
      of :data:`_GGUF_PRE_TOKENIZERS` are supported);
    - "llama", a SentencePiece BPE (Llama 2, Gemma): ``tokens`` with their ``scores``, no merges:
      see :func:`_sentencepiece_bpe`.

    In both, ``token_type`` marks control tokens (special: matched whole in text, skipped by
    decode) and user-defined ones (matched whole, kept by decode). ``add_bos_token`` (default
    false) makes :meth:`encode` prepend ``bos_token_id``, ``add_eos_token`` append
    ``eos_token_id``; ``tokenizer.chat_template`` becomes :attr:`chat_template`. Raises
    :class:`CheckpointError` naming ``path`` for another tokenizer model or pre-tokenizer,
    malformed vocabulary metadata, or more tokens than the model's ``model_vocab_size`` (checked
    before anything is built from them)."""
    from tokenizers import AddedToken, processors

    def fail(detail: str) -> CheckpointError:
        return CheckpointError(path, f"GGUF tokenizer metadata: {detail}")

    f = _Fields(metadata)
    try:
        kind = f.str_("tokenizer.ggml.model")
        tokens = f.get("tokenizer.ggml.tokens", _is_str_list, "a list of strings")
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
    if kind not in _GGUF_TOKENIZER_MODELS:
        raise fail(f"tokenizer.ggml.model {kind!r} is not supported ({', '.join(sorted(_GGUF_TOKENIZER_MODELS))})")
    if len(set(tokens)) != len(tokens):
        raise fail("tokenizer.ggml.tokens holds a token twice")
    if any(i is not None and not 0 <= i < len(tokens) for i in added_ids):
        raise fail(f"tokenizer.ggml.bos_token_id or eos_token_id ({added_ids}) is not a token id")
    try:
        tokenizer, vocabulary = _GGUF_TOKENIZER_MODELS[kind](f, tokens, types)
    except InvalidArgumentError as error:
        raise fail(str(error)) from None
    # A user-defined token holding a space is left to the model (see _sentencepiece_bpe).
    added = [AddedToken(token, special=token_type == _CONTROL, normalized=False)
             for written, token, token_type in zip(tokens, vocabulary, types, strict=True)
             if token_type == _CONTROL or (token_type == _USER_DEFINED and " " not in written)]
    tokenizer.add_tokens(added)  # each is already in the vocabulary: its id is kept
    bos, eos = added_ids
    pieces = ([vocabulary[bos]] if bos is not None else []) + ["$A"] + ([vocabulary[eos]] if eos is not None else [])
    if len(pieces) > 1:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(pieces), special_tokens=[(vocabulary[i], i) for i in {bos, eos} - {None}])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise fail("an added token got an id of its own (its text is not its vocabulary entry)")
    # The text a chat template writes for bos and eos (config.py checks the ids themselves).
    bos_token, eos_token = (tokens[i] if isinstance(i := metadata.get(f"tokenizer.ggml.{end}_token_id"), int)
                            and 0 <= i < len(tokens) else "" for end in ("bos", "eos"))
    return HFTokenizer(tokenizer, path, chat_template, bos_token, eos_token)


def _byte_level_bpe(f: _Fields, tokens: list[str], types: list[int]) -> tuple[Any, list[str]]:
    """A "gpt2" tokenizer: the BPE of ``tokenizer.ggml.merges``, split by the pre-tokenizer
    ``tokenizer.ggml.pre`` names, decoded from GPT-2's printable bytes. Returns it with its
    vocabulary in id order (the tokens as written)."""
    from tokenizers import Tokenizer, decoders, models

    pre = f.str_("tokenizer.ggml.pre", "default")
    merges = f.get("tokenizer.ggml.merges", _is_str_list, "a list of strings")
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise InvalidArgumentError(f"tokenizer.ggml.pre {pre!r} is not supported ({', '.join(sorted(_GGUF_PRE_TOKENIZERS))})")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if not all(len(pair) == 2 and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab for pair in pairs):
        raise InvalidArgumentError("a merge is not two vocabulary tokens, separated by a space, whose join is one too")
    tokenizer = Tokenizer(_bpe(models.BPE, vocab, pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, tokens


def _sentencepiece_bpe(f: _Fields, tokens: list[str], types: list[int]) -> tuple[Any, list[str]]:
    """A "llama" tokenizer: SentencePiece's BPE over text whose spaces are "▁" (a space prefix
    first when ``tokenizer.ggml.add_space_prefix``), falling back to the ``<0xNN>`` byte tokens
    for characters the vocabulary lacks, ``unknown_token_id`` for the rest.

    The file has no merges, only a score per token; the merges are every split of a token into
    two vocabulary tokens, ranked by the merged token's id (SentencePiece gives the lower id the
    higher score), the longer left piece first. That is the order transformers' GGUF converter
    derives (checked on Gemma 3's 262,144 tokens: the same 514,906 merges in the same order),
    and so the same ids on every text. User-defined tokens made of spaces are left to the BPE, as
    transformers leaves them: matched whole they would take the "▁" of the word after them.
    Returns the tokenizer and its vocabulary in id order (spaces written "▁")."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    unknown = f.int_("tokenizer.ggml.unknown_token_id", None)
    if unknown is not None and not 0 <= unknown < len(tokens):
        raise InvalidArgumentError(f"tokenizer.ggml.unknown_token_id {unknown} is not a token id")
    vocabulary = [token.replace(" ", _SPACE) for token in tokens]
    vocab = {token: i for i, token in enumerate(vocabulary)}
    if len(vocab) != len(vocabulary):
        raise InvalidArgumentError("two tokens differ only in writing a space as ' ' or '▁'")
    splits = [(vocab[token], -cut, token[:cut], token[cut:]) for token in vocabulary
              for cut in range(1, len(token)) if token[:cut] in vocab and token[cut:] in vocab]
    splits.sort()
    model = _bpe(models.BPE, vocab, [(left, right) for _, _, left, right in splits], fuse_unk=True, byte_fallback=True,
                 unk_token=None if unknown is None else vocabulary[unknown])
    tokenizer = Tokenizer(model)
    replace = normalizers.Replace(" ", _SPACE)
    add_prefix = f.bool_("tokenizer.ggml.add_space_prefix", False)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if add_prefix else replace
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(" "), behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                          + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return tokenizer, vocabulary


def _bpe(build: Callable[..., Any], vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> Any:
    try:
        return build(vocab, merges, **options)
    except Exception as error:  # the tokenizers package raises a bare Exception
        raise InvalidArgumentError(f"cannot build the BPE: {error}") from error


# SentencePiece's stand-in for a space.
_SPACE = "\u2581"

# tokenizer.ggml.model -> the builder of that tokenizer.
_GGUF_TOKENIZER_MODELS: dict[str, Callable[[_Fields, list[str], list[int]], tuple[Any, list[str]]]] = {
    "gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe,
}


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
