"""Chat: SmolLM2's own template rendered to the exact text transformers gives (computed here by
hand), the Jinja environment transformers sets (trim/lstrip blocks, raise_exception, a sandbox
the template cannot escape or mutate through), conversations refused synchronously with typed
errors, templates and token text read from tokenizer_config.json, sampling defaults from
generation_config.json, and the real SmolLM2-135M-Instruct answering a question through
Engine.chat, stopping at <|im_end|>."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pagedkv.engine import Engine, EngineConfig
from pagedkv.errors import CheckpointError, InvalidArgumentError, NoChatTemplateError
from pagedkv.loaders import save_checkpoint
from pagedkv.loaders.generation_config import default_sampling_params
from pagedkv.loaders.gguf import config_from_gguf
from pagedkv.loaders.gguf_file import read_gguf
from pagedkv.loaders.registry import locate_registered
from pagedkv.loaders.tokenizers import tokenizer_from_file, tokenizer_from_gguf_metadata
from pagedkv.models import LlamaConfig, LlamaModel, LlamaWeights
from pagedkv.sampling import SamplingParams
from pagedkv.text.chat import render_chat
from pagedkv.text.tokenizer import ByteTokenizer, HFTokenizer

SYSTEM_DEFAULT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def smollm() -> HFTokenizer:
    path = locate_registered("smollm2-135m")
    header = read_gguf(path)
    return tokenizer_from_gguf_metadata(header.metadata, path, config_from_gguf(header).vocab_size)


def render(tokenizer: HFTokenizer, messages, add_generation_prompt: bool = True) -> str:
    assert tokenizer.chat_template is not None
    return render_chat(tokenizer.chat_template, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)


# ---- rendering ------------------------------------------------------------------------------------


def test_smollm_template_renders_a_two_message_conversation_exactly(smollm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    body = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert render(smollm, messages, add_generation_prompt=False) == body
    assert render(smollm, messages) == body + "<|im_start|>assistant\n"
    # Without a system message, the template writes its own first.
    reply = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert render(smollm, reply, add_generation_prompt=False) == (
        SYSTEM_DEFAULT + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n")
    assert (smollm.bos_token, smollm.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_the_rendered_prompt_tokenizes_its_special_tokens_whole(smollm):
    text = render(smollm, [{"role": "user", "content": "Hi"}])
    ids = smollm.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> ×3, <|im_end|> ×2
    assert smollm.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_environment_trims_and_lstrips_blocks_as_transformers_does():
    template = ("{% for m in messages %}\n"
                "    {% if m.role == 'user' %}\n"
                "U: {{ m.content }}\n"
                "    {% endif %}\n"
                "{% endfor %}"
                "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}")
    messages = [{"role": "user", "content": "hé"}, {"role": "assistant", "content": "x"}]
    expected = "U: hé\n<s>|</s>|" + json.dumps(messages, ensure_ascii=False)
    assert render_chat(template, messages, bos_token="<s>", eos_token="</s>") == expected


def test_raise_exception_in_a_template_is_an_invalid_argument():
    template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}")
    assert render_chat(template, [{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(InvalidArgumentError, match="Unknown role: tool"):
        render_chat(template, [{"role": "tool", "content": "x"}])


def test_the_sandbox_stops_escapes_and_mutation():
    messages = [{"role": "user", "content": "x"}]
    for template in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{% set _ = messages.append(messages[0]) %}"):
        with pytest.raises(InvalidArgumentError):
            render_chat(template, messages)
    assert messages == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("template, match", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ messages[0].content.nope() }}", "has no attribute"),
])
def test_any_runtime_error_of_a_template_is_an_invalid_argument(template, match):
    """Issue 23 item 11: only jinja2.TemplateError was mapped; the rest escaped as a plain-text 500."""
    with pytest.raises(InvalidArgumentError, match=match):
        render_chat(template, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template, match", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),  # 1e10 turns
    ("{{ 'x' * 10**10 }}", "repeats a str"),
    ("{{ messages * 10**9 }}", "repeats a list"),
    ("{{ 7 ** 100000 }}", "bits"),
    ("{{ (2 ** 60000) * (2 ** 60000) }}", "bits"),
    ("{{ messages | tojson(indent=10**9) }}", "indent"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "characters"),  # 100 M chars, 1,000 at a time
])
def test_a_template_past_its_bounds_is_refused(template, match):
    """Issue 23 item 4: a template looping ~1e10 times froze every endpoint; these are refused
    within the rendering's bounds (MAX_RENDER_SECONDS, MAX_RENDERED_CHARS)."""
    with pytest.raises(InvalidArgumentError, match=match):
        render_chat(template, [{"role": "user", "content": "x"}])
    assert render_chat("{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ messages | tojson(indent=2) | length > 0 }}",
                       [{"role": "user", "content": "x"}]) == "ababab1024True"


def test_the_deadline_leaves_the_threads_tracer_as_it_was():
    import sys

    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        render_chat("{{ messages[0].content }}", [{"role": "user", "content": "x"}])
        with pytest.raises(InvalidArgumentError):
            render_chat("{{ 1 / 0 }}", [{"role": "user", "content": "x"}])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_a_template_that_does_not_compile_names_its_source():
    with pytest.raises(CheckpointError, match="tokenizer_config.json.*does not compile"):
        render_chat("{% for %}", [{"role": "user", "content": "x"}], source="tokenizer_config.json")


@pytest.mark.parametrize("messages", [
    "hello", [], None, {"role": "user", "content": "x"}, ["hi"], [{"role": "user"}],
    [{"role": "user", "content": ["a list"]}], [{"role": 3, "content": "x"}], [{"content": "x"}],
])
def test_malformed_messages_are_refused(messages):
    with pytest.raises(InvalidArgumentError, match="message"):
        render_chat("{{ messages }}", messages)


# ---- Engine.chat on the tiny model: errors in the caller ------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(weights):
    tokenizer = ByteTokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('only users') }}"
                               "{% endif %}[{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    with Engine(LlamaModel(weights), tokenizer, EngineConfig(num_blocks=64, block_size=4)) as engine:
        yield engine


def test_chat_submits_the_rendered_prompt_without_a_second_bos(tiny_engine):
    handle = tiny_engine.submit_chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, temperature=0))
    assert handle.prompt == "[hi]>"
    assert handle.prompt_token_ids == ByteTokenizer().encode("[hi]>", add_special_tokens=False)
    output = handle.result(timeout=60)
    assert output.text == tiny_engine.tokenizer.decode(output.token_ids) and len(output.token_ids) <= 2
    unprompted = tiny_engine.submit_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert unprompted.prompt == "[hi]"
    unprompted.result(timeout=60)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "system", "content": "x"}], "only users"),
    ([{"role": "user", "content": 5}], "content"),
    ("hi", "list"),
])
def test_bad_conversations_raise_in_the_caller_and_queue_nothing(tiny_engine, messages, match):
    with pytest.raises(InvalidArgumentError, match=match):
        tiny_engine.chat(messages, timeout=60)
    assert not tiny_engine.core.has_unfinished() and not tiny_engine._state.handles


def test_a_chat_past_its_timeout_is_aborted(tiny_engine):
    long = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    with pytest.raises(TimeoutError):
        tiny_engine.chat([{"role": "user", "content": "go on"}], long, timeout=0.01)  # ~250 decode steps take far longer
    deadline = time.monotonic() + 30
    while tiny_engine.core.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tiny_engine.core.has_unfinished() and not tiny_engine._state.handles


def test_a_model_without_a_template_refuses_chat(weights):
    with Engine(LlamaModel(weights), ByteTokenizer(), EngineConfig(num_blocks=16, block_size=4)) as engine:
        with pytest.raises(NoChatTemplateError, match="no chat template"):
            engine.chat([{"role": "user", "content": "hi"}])
        assert not engine.core.has_unfinished()


# ---- files of a checkpoint directory --------------------------------------------------------------


def checkpoint(tmp_path: Path, smollm: HFTokenizer, **files: object) -> Path:
    """A tokenizer-only directory: SmolLM2's tokenizer.json plus the given JSON files."""
    (tmp_path / "tokenizer.json").write_text(smollm._tokenizer.to_str())
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return tmp_path


def test_tokenizer_config_gives_the_template_and_token_text(tmp_path, smollm):
    directory = checkpoint(tmp_path, smollm, tokenizer_config={
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        "bos_token": {"content": "<|im_start|>", "lstrip": False}, "eos_token": "<|im_end|>"})
    tokenizer = tokenizer_from_file(directory / "tokenizer.json")
    assert (tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token) == ("D", "<|im_start|>", "<|im_end|>")
    (directory / "tokenizer_config.json").unlink()
    assert tokenizer_from_file(directory / "tokenizer.json").chat_template is None


@pytest.mark.parametrize("config", [[], {"chat_template": 5}, {"chat_template": "x", "eos_token": {"content": 3}}])
def test_a_malformed_tokenizer_config_is_refused(tmp_path, smollm, config):
    directory = checkpoint(tmp_path, smollm, tokenizer_config=config)
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        tokenizer_from_file(directory / "tokenizer.json")


def test_a_tokenizer_config_outside_the_directory_is_refused(tmp_path, smollm):
    (tmp_path / "model").mkdir()
    directory = checkpoint(tmp_path / "model", smollm)
    (tmp_path / "secret.json").write_text("{}")
    (directory / "tokenizer_config.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        tokenizer_from_file(directory / "tokenizer.json")


def test_generation_config_gives_the_default_sampling_params(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_new_tokens": 7, "eos_token_id": 2,
         "bos_token_id": 1, "transformers_version": "4.42"}))
    assert default_sampling_params(tmp_path) == SamplingParams(max_tokens=7, temperature=0.6, top_p=0.9, top_k=50)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert default_sampling_params(tmp_path) == SamplingParams(temperature=0.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(CheckpointError, match="generation_config.json.*top_p"):
        default_sampling_params(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert default_sampling_params(tmp_path) is None


def test_the_engine_samples_with_the_checkpoint_defaults_unless_given_params(tmp_path):
    save_checkpoint(LlamaWeights.random(LlamaConfig.tiny(), seed=0), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 3}))
    with Engine.from_pretrained(tmp_path, num_blocks=32, block_size=4) as engine:
        assert engine.default_params == SamplingParams(max_tokens=3, temperature=0.0)
        default = engine.submit([5, 6, 7]).result(timeout=60)
        explicit = engine.submit([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0)).result(timeout=60)
        assert default.token_ids == explicit.token_ids and len(default.token_ids) <= 3
        longer = engine.submit([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)).result(timeout=60)
        assert len(longer.token_ids) == 6  # the caller's params replace the defaults whole
    with Engine.from_pretrained(tmp_path, num_blocks=32, block_size=4, default_params=SamplingParams(max_tokens=1)) as engine:
        assert engine.default_params == SamplingParams(max_tokens=1)


# ---- the real model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_engine():
    with Engine.from_pretrained("smollm2-135m", num_blocks=128, block_size=16) as engine:
        yield engine


def test_smollm_answers_the_capital_of_france_and_stops_at_im_end(smollm_engine):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    handle = smollm_engine.submit_chat(question, SamplingParams(max_tokens=48, temperature=0))
    events = list(handle)
    output = handle.result(timeout=120)
    assert "Paris" in output.text
    assert output.token_ids[-1] in smollm_engine.model.config.eos_token_ids
    assert smollm_engine.tokenizer.decode([output.token_ids[-1]]) == ""  # <|im_end|>: special, not in the text
    assert output.outputs[0].finish_reason == "stop" and len(output.token_ids) < 48
    assert "".join(e.text for e in events) == output.text == smollm_engine.tokenizer.decode(output.token_ids)
    assert "<|im_end|>" not in output.text


def test_smollm_stop_string_cuts_the_answer(smollm_engine):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    full = smollm_engine.chat(question, SamplingParams(max_tokens=48, temperature=0), timeout=120)
    assert "Paris" in full.text
    cut = smollm_engine.chat(question, SamplingParams(max_tokens=48, temperature=0, stop=["Paris"]), timeout=120)
    assert cut.text == full.text[: full.text.index("Paris")]
    assert cut.outputs[0].finish_reason == "stop" and len(cut.token_ids) < len(full.token_ids)
    assert not smollm_engine.core.has_unfinished()


def test_a_gguf_tokenizer_saved_as_a_hugging_face_directory_loads_back_alike(smollm, tmp_path):
    """What `make clients` hands lm-eval and guidellm (transformers' AutoTokenizer reads the
    same two files): the same ids, special tokens and chat template."""
    import json

    tokenizer = smollm
    tokenizer.save(tmp_path / "tok")
    loaded = tokenizer_from_file(tmp_path / "tok" / "tokenizer.json")
    text = "Hello, world! <|im_start|>user\nnaïve café 🚀<|im_end|>"
    assert loaded.encode(text) == tokenizer.encode(text) and loaded.vocab_size == tokenizer.vocab_size
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["chat_template"]) == (tokenizer.eos_token, tokenizer.chat_template)
