"""Streamed text: the incremental detokenizer (deltas concatenate to ``decode(all tokens)`` for the
byte tokenizer and SmolLM2's byte-level BPE, across split UTF-8 characters, at a bounded cost per
token), the stop-string matcher (the earliest stop string cuts the text, whatever the chunking),
and both inside the engine core, driven by a scripted runner so each test chooses the tokens: stop
strings across token boundaries and at the very start, the request finished in the scheduler (its
blocks freed) in the step its stop string completes."""

from __future__ import annotations

import codecs
import sys
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.engine import EngineConfig, EngineCore
from pagedkv.errors import InvalidArgumentError
from pagedkv.loaders.gguf import config_from_gguf
from pagedkv.loaders.gguf_file import read_gguf
from pagedkv.loaders.registry import locate_registered
from pagedkv.loaders.tokenizers import tokenizer_from_gguf_metadata
from pagedkv.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, Samples, SamplingParams
from pagedkv.text import detokenizer
from pagedkv.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pagedkv.text.tokenizer import ByteTokenizer, HFTokenizer
from support.gated_model import HANG_GUARD_S

BYTES = ByteTokenizer()


@pytest.fixture(scope="module")
def smollm() -> HFTokenizer:
    """SmolLM2-135M-Instruct's tokenizer, from its GGUF metadata (no weights loaded)."""
    path = locate_registered("smollm2-135m")
    header = read_gguf(path)
    return tokenizer_from_gguf_metadata(header.metadata, path, config_from_gguf(header).vocab_size)


def stream(decode, tokens: Sequence[int]) -> tuple[list[str], IncrementalDetokenizer]:
    """The deltas of pushing ``tokens`` one by one, then the final flush (last in the list)."""
    detokenizer = IncrementalDetokenizer(decode)
    deltas = [detokenizer.push(t) for t in tokens]
    return deltas + [detokenizer.finish()], detokenizer


def check_stream(decode, tokens: Sequence[int]) -> None:
    detokenizer = IncrementalDetokenizer(decode)
    delivered = ""
    for i, token in enumerate(tokens):
        delivered += detokenizer.push(token)
        so_far = decode(tokens[: i + 1])
        assert so_far.startswith(delivered)  # nothing delivered is ever taken back
        assert not so_far[len(delivered):].strip("\ufffd")  # only replacement chars held back
    assert delivered + detokenizer.finish() == decode(list(tokens))


# ---- the incremental detokenizer ------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 270), max_size=60))
def test_byte_tokenizer_deltas_concatenate_to_the_decode(tokens):
    # Random bytes: invalid UTF-8, characters split over tokens, special ids, ids past the bytes.
    check_stream(BYTES.decode, tokens)


def per_byte_decode(token_ids: Sequence[int]) -> str:
    """The byte tokenizer's ids decoded as a byte-fallback decoder does: one U+FFFD per byte of
    an invalid or incomplete sequence (until it completes)."""
    data = bytes(t - 3 for t in token_ids if 3 <= t < 259)
    return data.decode("utf-8", errors="pagedkv-test-per-byte")


codecs.register_error("pagedkv-test-per-byte", lambda e: ("\ufffd" * (e.end - e.start), e.end))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 258), st.sampled_from([0xE2 + 3, 0x82 + 3, 0xAC + 3, 0xF0 + 3])), max_size=40))
def test_a_decoder_replacing_each_byte_of_a_cut_character_streams_correctly(tokens):
    assert per_byte_decode([0xE2 + 3, 0x82 + 3]) == "\ufffd\ufffd"  # the model this test covers
    check_stream(per_byte_decode, tokens)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.lists(st.integers(0, 270), max_size=8), st.integers(0, 40))
def test_byte_tokenizer_text_with_noise_inserted(text, noise, at):
    tokens = BYTES.encode(text, add_special_tokens=False)
    check_stream(BYTES.decode, tokens[:at] + noise + tokens[at:])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 49151), max_size=40))
def test_smollm_deltas_concatenate_to_the_decode_of_random_tokens(smollm, tokens):
    check_stream(smollm.decode, tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(codec="utf-8"), max_size=30), st.lists(st.integers(0, 49151), max_size=4), st.integers(0, 30))
def test_smollm_deltas_concatenate_to_the_decode_of_text(smollm, text, noise, at):
    tokens = smollm.encode(text, add_special_tokens=False)
    check_stream(smollm.decode, tokens[:at] + noise + tokens[at:])


def test_a_character_split_over_tokens_is_held_until_complete(smollm):
    # A rare CJK character and an emoji are each several byte-level tokens: no token alone decodes.
    text = "a 𝄞😀 龘 b"
    tokens = smollm.encode(text, add_special_tokens=False)
    assert any("\ufffd" in smollm.decode([t]) for t in tokens), "the text must split a character"
    deltas, _ = stream(smollm.decode, tokens)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # never a partial character, never one redone
    # Bytes one by one: a 4-byte character arrives whole, with its last byte.
    deltas, _ = stream(BYTES.decode, BYTES.encode("€😀", add_special_tokens=False))
    assert deltas == ["", "", "€", "", "", "", "😀", ""]


def test_each_token_decodes_a_bounded_window(smollm):
    """The cost per token does not grow with the output: count the tokens each decode call is
    given, for outputs of 200 and 2000 tokens."""
    text = "The quick brown fox jumps over the lazy dog; naïve café, 東京 and 😀. " * 100
    all_tokens = smollm.encode(text, add_special_tokens=False)
    assert len(all_tokens) > 2000
    for n in (200, 2000):
        sizes: list[int] = []

        def counting_decode(tokens, sizes=sizes):
            sizes.append(len(tokens))
            return smollm.decode(tokens)

        deltas, _ = stream(counting_decode, all_tokens[:n])
        assert "".join(deltas) == smollm.decode(all_tokens[:n])
        assert len(sizes) <= 2 * n + 1  # one decode per token, one more per window move
        # Twice the context (4) plus the new token, plus the few a window move is put off by
        # (while the last 4 tokens start inside a character): the same for 200 and 2000 tokens.
        assert max(sizes) <= 2 * 4 + 4
        assert sum(sizes) <= 12 * n


# ---- the stop-string matcher ----------------------------------------------------------------------


def cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The reference: the text before the stop string that completes first (of those completing at
    the same character, the longest), by brute force over every end position."""
    for end in range(1, len(text) + 1):
        lengths = [len(s) for s in stops if text[:end].endswith(s)]
        if lengths:
            return text[: end - max(lengths)], True
    return text, False


@settings(max_examples=400, deadline=None)
@given(st.text("ab\u00e9", max_size=30), st.lists(st.text("ab\u00e9", min_size=1, max_size=4), min_size=1, max_size=3),
       st.lists(st.integers(0, 30), max_size=10))
def test_stop_strings_cut_where_the_first_completes_whatever_the_chunking(text, stops, splits):
    # A two-letter alphabet makes overlapping stop strings and prefixes of them common.
    bounds = sorted({0, len(text), *(min(s, len(text)) for s in splits)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher = StopStringMatcher(stops)
    delivered = seen = ""
    whole, stops_in_text = cut(text, stops)
    for chunk in chunks:
        delivered += matcher.push(chunk)
        seen += chunk
        before_stop, stopped = cut(seen, stops)
        assert matcher.stopped == stopped
        if stopped:  # the same cut as the whole text's, whatever the chunks
            assert delivered == before_stop == whole
            assert matcher.push("more") == ""
            return
        held = max((k for s in stops for k in range(len(s)) if seen.endswith(s[:k])), default=0)
        assert delivered == seen[: len(seen) - held]  # all but what may still start a stop string
    assert not stops_in_text
    assert delivered + matcher.finish() == text


def test_stop_string_overlapping_another_and_at_the_start():
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.push("ab") == ""  # "ab" may start "abcd", "b" may start "bc"
    assert matcher.push("cd") == "a"  # "bc" completes first
    assert matcher.stopped
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.push("abcd") == "a"  # the same in one chunk
    matcher = StopStringMatcher(["b", "ab"])
    assert matcher.push("xab") == "x"  # both complete at "b": the longest wins
    matcher = StopStringMatcher(["He"])
    assert (matcher.push("Hello"), matcher.stopped) == ("", True)


def lines_run(matcher: StopStringMatcher, chunks: Sequence[str]) -> int:
    """Lines of the detokenizer module run while ``chunks`` are pushed: the matcher's work,
    counted rather than timed."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename == detokenizer.__file__:
            count += event == "line"
            return trace
        return None

    sys.settrace(trace)
    try:
        for chunk in chunks:
            matcher.push(chunk)
    finally:
        sys.settrace(None)
    return count


def test_the_work_per_character_does_not_grow_with_the_number_of_stop_strings():
    """Issue 23 item 15: 100k stop strings cost ~14 ms per token, each searched at every push."""
    text = ("the quick brown fox jumps over the lazy dog; " * 8)[:300]
    chunks = [text[i:i + 3] for i in range(0, len(text), 3)]
    one = lines_run(StopStringMatcher(["<|never|>"]), chunks)
    # Sixteen long stop strings sharing prefixes with the text, none of them completing.
    many = [f"the quick brown {word}" + "x" * 200 for word in ("fox", "fix", "fog", "fax")]
    many += [f"{word} the lazy cat" + "y" * 200 for word in ("over", "ever", "oven", "offer")]
    many += [c * MAX_STOP_STRING_CHARS for c in "qwzvkjQW"]
    assert len(many) == MAX_STOP_STRINGS
    assert lines_run(StopStringMatcher(many), chunks) < 2 * one


def test_stop_strings_are_bounded():
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
    for bad in (["x"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_STRING_CHARS + 1)], ["y"] * 100_000):
        with pytest.raises(InvalidArgumentError, match=f"at most {MAX_STOP_STRINGS} strings"):
            SamplingParams(stop=bad)


def test_stop_must_be_nonempty_strings():
    assert SamplingParams(stop="x").stop == ("x",)
    for bad in ("", [""], [3], 3, [["x"]]):
        with pytest.raises(InvalidArgumentError, match="stop"):
            SamplingParams(stop=bad)


# ---- inside the engine core -----------------------------------------------------------------------


class ScriptedRunner:
    """Gives each sample the next token of its script (the last one forever after): a request's
    script is a list of tokens (for all its samples) or a tuple of one list per sample."""

    max_model_len = 4096
    kv_spec = None  # keeps no K/V

    def __init__(self, vocab_size: int, scripts: dict[str, list[int]]) -> None:
        self.vocab_size = vocab_size
        self.scripts = scripts
        self.given: dict[tuple[str, int], int] = {}

    def run(self, step, params, generators, histories) -> Samples:
        tokens = []
        for request_id, index in zip(step.sample_request_ids, step.sample_seq_indices.tolist(), strict=True):
            script = self.scripts[request_id]
            script = script[index] if isinstance(script, tuple) else script
            at = self.given.get((request_id, index), 0)
            self.given[(request_id, index)] = at + 1
            tokens.append(script[min(at, len(script) - 1)])
        return Samples.certain(np.array(tokens, dtype=np.int64), params)


def run_core(tokenizer, script: list[int] | tuple[list[int], ...], params: SamplingParams, eos: Sequence[int] = ()):
    """Runs one request through a core until it ends; returns (per-step events, output, core),
    checking after each step that an ended request holds no block any more."""
    runner = ScriptedRunner(max(tokenizer.vocab_size, 300), {"r": script})
    config = EngineConfig(num_blocks=64, block_size=4, enable_prefix_caching=False)  # freed blocks stay free
    core = EngineCore(runner, config, eos_token_ids=eos, tokenizer=tokenizer)
    free = core.scheduler.num_free_blocks
    core.add_request("r", [5, 6, 7], params)
    steps = []
    for _ in range(200):
        events, ended = core.step()
        steps.append(events)
        if ended:
            assert "r" not in core.scheduler and not core.scheduler.has_unfinished()
            assert core.scheduler.num_free_blocks == free
            return steps, ended[0], core
    raise AssertionError("the request never ended")


def byte_ids(text: str) -> list[int]:
    return BYTES.encode(text, add_special_tokens=False)


def test_stop_string_across_byte_tokens_ends_the_request_in_that_step():
    steps, output, _ = run_core(BYTES, byte_ids("hello world, again"), SamplingParams(max_tokens=50, stop=["o w"]))
    assert output.text == "hell"
    assert output.outputs[0].finish_reason == "stop"
    assert output.token_ids == byte_ids("hello w")  # the token completing the stop string is kept
    assert [e.finish_reason for e in steps[-1]] == ["stop"]
    assert "".join(e.text for events in steps for e in events) == "hell"


def test_stop_string_at_the_very_start_gives_empty_text():
    _, output, _ = run_core(BYTES, byte_ids("Hi there"), SamplingParams(max_tokens=50, stop=["Hi"]))
    assert (output.text, output.outputs[0].finish_reason, len(output.token_ids)) == ("", "stop", 2)


def test_held_prefix_of_a_stop_string_is_released_when_it_does_not_complete():
    steps, output, _ = run_core(BYTES, byte_ids("abab!") + [BYTES.EOS_ID], SamplingParams(max_tokens=50, stop=["abc"]),
                                eos=[BYTES.EOS_ID])
    deltas = [e.text for events in steps for e in events]
    # "a", "ab" held (they may start "abc"); "aba" releases "ab" and holds "a"; "!" frees the rest.
    assert deltas == ["", "", "ab", "", "ab!", ""]
    assert (output.text, output.outputs[0].finish_reason) == ("abab!", "stop")


def test_text_held_at_the_length_limit_is_flushed():
    _, output, _ = run_core(BYTES, byte_ids("xyab"), SamplingParams(max_tokens=4, stop=["abc"]))
    assert (output.text, output.outputs[0].finish_reason) == ("xyab", "length")
    _, output, _ = run_core(BYTES, byte_ids("xy\u20ac"), SamplingParams(max_tokens=4))
    assert output.text == "xy\ufffd"  # the cut character, as decode gives it


def test_stop_string_across_bpe_tokens_of_smollm(smollm):
    script = smollm.encode("The capital of France is Paris.", add_special_tokens=False)
    for stop, text in [("capital of", "The "), ("Par", "The capital of France is "), ("s P", "The capital of France i")]:
        steps, output, _ = run_core(smollm, script, SamplingParams(max_tokens=50, stop=[stop]))
        assert (output.text, output.outputs[0].finish_reason) == (text, "stop")
        assert "".join(e.text for events in steps for e in events) == text
        completing = len(smollm.decode(output.token_ids)) - len(smollm.decode(output.token_ids[:-1]))
        assert smollm.decode(output.token_ids).find(stop) + len(stop) > len(smollm.decode(output.token_ids)) - completing


def test_without_stop_the_text_is_the_decode_and_eos_ends_it(smollm):
    script = smollm.encode("naïve 😀 done", add_special_tokens=False) + [2]
    steps, output, _ = run_core(smollm, script, SamplingParams(max_tokens=50), eos=[2])
    assert output.text == smollm.decode(output.token_ids) == "naïve 😀 done"
    assert output.token_ids[-1] == 2 and output.outputs[0].finish_reason == "stop"
    assert "".join(e.text for events in steps for e in events) == output.text


def test_parallel_samples_each_stop_and_the_request_ends_when_all_have():
    # Both samples follow the same script: they stop in the same step, and the request ends then.
    _, output, _ = run_core(BYTES, byte_ids("one two"), SamplingParams(max_tokens=50, n=2, stop=[" t"]))
    assert [(c.text, c.finish_reason) for c in output.outputs] == [("one", "stop")] * 2


def test_a_sample_stopped_before_the_others_gets_no_more_tokens():
    script = (byte_ids("stop here"), byte_ids("no stopping"))
    steps, output, _ = run_core(BYTES, script, SamplingParams(max_tokens=11, n=2, stop=[" h"]))
    first, second = output.outputs
    assert (first.text, first.finish_reason, first.token_ids) == ("stop", "stop", byte_ids("stop h"))
    assert (second.text, second.finish_reason) == ("no stopping", "length")
    events = [e for step in steps for e in step]
    assert [e.token_id for e in events if e.index == 0] == byte_ids("stop h")  # none after the stop
    assert "".join(e.text for e in events if e.index == 1) == "no stopping"


def test_stop_strings_need_a_tokenizer():
    core = EngineCore(ScriptedRunner(300, {}), EngineConfig(num_blocks=8, block_size=4))
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        core.add_request("r", [1, 2], SamplingParams(stop=["x"]))
    assert not core.scheduler.has_unfinished()


def test_a_tokenizer_that_raises_fails_its_request_alone():
    class Broken(ByteTokenizer):
        def decode(self, token_ids):
            if 0x21 + 3 in token_ids:  # "!"
                raise RuntimeError("cannot decode")
            return super().decode(token_ids)

    runner = ScriptedRunner(300, {"bad": byte_ids("ok!"), "good": byte_ids("fine")})
    core = EngineCore(runner, EngineConfig(num_blocks=64, block_size=4), tokenizer=Broken())
    core.add_request("bad", [5, 6], SamplingParams(max_tokens=10))
    core.add_request("good", [5, 6], SamplingParams(max_tokens=4))
    ended = {}
    for _ in range(20):
        for output in core.step()[1]:
            ended[output.request_id] = output
    assert ended["bad"].error is not None and "cannot decode" in ended["bad"].error
    assert ended["bad"].outputs[0].finish_reason == "error"
    assert (ended["good"].text, ended["good"].error) == ("fine", None)
    assert not core.scheduler.has_unfinished()


def test_detokenizing_holds_up_no_other_request():
    """Issue 19: a step's output processing (detokenizing, stop strings) runs outside the core's
    lock. While a tokenizer's decode is held inside a step, another thread adds a request and
    aborts another; both return (the hang guard only turns a hang into a failure) and the held
    request ends with its text once released."""
    entered, release = threading.Event(), threading.Event()

    class Held(ByteTokenizer):
        def decode(self, token_ids):
            if 0x21 + 3 in token_ids and not release.is_set():  # "!": hold the step here
                entered.set()
                assert release.wait(HANG_GUARD_S), "the test never released the tokenizer"
            return super().decode(token_ids)

    runner = ScriptedRunner(300, {"held": byte_ids("hi!"), "other": byte_ids("ok"), "late": byte_ids("x")})
    core = EngineCore(runner, EngineConfig(num_blocks=64, block_size=4), tokenizer=Held())
    core.add_request("held", [5, 6], SamplingParams(max_tokens=3))
    core.add_request("other", [5, 6], SamplingParams(max_tokens=8))
    ended: dict[str, object] = {}

    def drive() -> None:
        while core.has_unfinished():
            for output in core.step()[1]:
                ended[output.request_id] = output

    stepping = threading.Thread(target=drive, daemon=True)
    stepping.start()
    assert entered.wait(HANG_GUARD_S), "the step never decoded the held token"
    meanwhile = threading.Thread(
        target=lambda: (core.add_request("late", [5], SamplingParams(max_tokens=1)), core.abort("other")), daemon=True
    )
    meanwhile.start()
    meanwhile.join(HANG_GUARD_S)
    released_late = not meanwhile.is_alive()
    release.set()
    stepping.join(HANG_GUARD_S)
    assert released_late, "add_request or abort waited for another request's detokenizing"
    assert not stepping.is_alive() and not core.has_unfinished()
    assert ended["held"].text == "hi!" and ended["late"].text == "x"
    assert "other" not in ended  # aborted: its output went to the abort's caller
