"""Sampling inside the engine core (issue 11 §3): penalties see each sample's own history, logprobs
reach the outputs and the stream, and a seeded request draws the same whatever shares its batch.

Most tests drive the core with :class:`LogitsRunner`, whose logits are a fixed function of a row's
(position, input token), the same in any batch: the reference is then
:func:`sample_with_logprobs` run row by row here, with a history kept by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedkv import Engine, InvalidArgumentError, Scheduler, TokenLogprob, UnknownSequenceError
from pagedkv.engine import EngineConfig, EngineCore, SimulatedRunner, VirtualClock
from pagedkv.loaders import load_tokenizer
from pagedkv.models import DenseReference, LlamaModel, SimulatedModel
from pagedkv.sampling import Samples, SamplingParams, TokenHistory, sample_with_logprobs
from pagedkv.text.tokenizer import ByteTokenizer

VOCAB = 259  # ByteTokenizer's
LETTERS = np.arange(ord("a") + 3, ord("z") + 4)  # ByteTokenizer ids of a..z
FAVOURITE = int(LETTERS[4])  # "e": ahead of every other token by 3 nats


def logits_at(position: int, token: int) -> np.ndarray:
    """The stub model's logits after ``token`` at ``position``: letters only, "e" the favourite."""
    rng = np.random.default_rng([position, token])
    row = np.full(VOCAB, -30.0, dtype=np.float32)
    row[LETTERS] = rng.normal(0.0, 0.5, len(LETTERS))
    row[FAVOURITE] += 3.0
    return row


class LogitsRunner:
    """A model whose logits are :func:`logits_at` each row's last input, sampled as
    :class:`~pagedkv.engine.PagedModelRunner` samples."""

    vocab_size = VOCAB
    max_model_len = 4096
    kv_spec = None  # keeps no K/V

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []
        self.rows: list[tuple[str, int]] = []  # (request id, sample index) of every row drawn

    def run(self, step, params, generators, histories) -> Samples:
        rows = np.asarray(step.logits_indices)
        positions, inputs = np.asarray(step.positions)[rows], np.asarray(step.input_ids)[rows]
        logits = np.stack([logits_at(int(p), int(t)) for p, t in zip(positions, inputs, strict=True)])
        self.batch_sizes.append(len(rows))
        self.rows += zip(step.sample_request_ids, step.sample_seq_indices.tolist(), strict=True)
        return sample_with_logprobs(logits, params, generators, histories)


def reference(prompt: list[int], params: SamplingParams, index: int = 0) -> tuple[list[int], list[TokenLogprob]]:
    """Sample ``index`` of a request, one row at a time, its history kept here (no eos: runs to
    ``max_tokens``)."""
    generator = params.make_generator(index)
    history = TokenHistory(prompt) if params.penalized else None
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    context = list(prompt)
    for _ in range(params.max_tokens):
        out = sample_with_logprobs(logits_at(len(context) - 1, context[-1])[None], [params], [generator], [history])
        token = int(out.tokens[0])
        k = params.top_logprobs
        top = tuple(zip(out.top_ids[0, :k].tolist(), out.top_logprobs[0, :k].tolist(), strict=True))
        logprobs.append(TokenLogprob(token, float(out.logprobs[0]), top))
        tokens.append(token)
        context.append(token)
        if history is not None:
            history.append(token)
    return tokens, logprobs


def run_all(requests: dict[str, tuple[list[int], SamplingParams]], tokenizer=None):
    """Runs ``requests`` together through a core over :class:`LogitsRunner`; returns (events by
    request id, final outputs by request id, runner)."""
    runner = LogitsRunner()
    core = EngineCore(runner, EngineConfig(num_blocks=64, block_size=4), tokenizer=tokenizer)
    for request_id, (prompt, params) in requests.items():
        core.add_request(request_id, prompt, params)
    events: dict[str, list] = {rid: [] for rid in requests}
    outputs = {}
    for _ in range(500):
        stepped, ended = core.step()
        for event in stepped:
            events[event.request_id].append(event)
        outputs.update((o.request_id, o) for o in ended)
        if not core.has_unfinished():
            return events, outputs, runner
    raise AssertionError("the requests never ended")


PROMPT = [LETTERS[0].item(), LETTERS[1].item(), FAVOURITE, LETTERS[2].item()]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize(
    "penalty",
    [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(repetition_penalty=4.0)],
    ids=["frequency", "presence", "repetition"],
)
def test_penalties_change_greedy_output_as_the_sampler_does(penalty):
    plain = greedy(logprobs=True)
    penalised = greedy(logprobs=True, **penalty)
    _, outputs, _ = run_all({"plain": (PROMPT, plain), "penalised": (PROMPT, penalised)})
    assert outputs["plain"].token_ids == [FAVOURITE] * 12  # nothing penalises it
    tokens, logprobs = reference(PROMPT, penalised)
    assert outputs["penalised"].token_ids == tokens != outputs["plain"].token_ids
    assert outputs["penalised"].outputs[0].logprobs == logprobs


def test_greedy_logprobs_are_the_log_softmax_with_ordered_top_alternatives():
    params = greedy(logprobs=True, top_logprobs=5)
    events, outputs, _ = run_all({"r": (PROMPT, params)})
    completion = outputs["r"].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids) == 12
    context = list(PROMPT)
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        logits = logits_at(len(context) - 1, context[-1]).astype(np.float64)
        log_softmax = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        order = np.argsort(-log_softmax, kind="stable")[:5]
        assert entry.token_id == token == order[0]
        assert entry.logprob == pytest.approx(log_softmax[token], abs=1e-5)
        assert [t for t, _ in entry.top] == order.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(log_softmax[order].tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:], strict=False))
        context.append(token)
    assert [e.logprob for e in events["r"]] == completion.logprobs


def test_no_logprobs_unless_asked():
    events, outputs, _ = run_all({"r": (PROMPT, greedy())})
    assert outputs["r"].outputs[0].logprobs is None
    assert all(e.logprob is None for e in events["r"])
    _, outputs, _ = run_all({"r": (PROMPT, greedy(logprobs=True))})
    assert all(entry.top == () for entry in outputs["r"].outputs[0].logprobs)


def test_a_seeded_penalised_request_draws_the_same_alone_or_in_a_batch():
    """Item 3: tokens and logprobs of each of n=2 samples equal the reference drawn alone, each
    sample with its own history, whatever else (penalised or not) shares the steps."""
    params = SamplingParams(
        max_tokens=10, temperature=1.0, top_k=8, seed=11, n=2, ignore_eos=True,
        frequency_penalty=0.7, repetition_penalty=1.3, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    others = {
        f"o{i}": ([LETTERS[i].item()] * (3 + i), SamplingParams(max_tokens=6 + i, temperature=0.9, presence_penalty=1.0, seed=i))
        for i in range(3)
    }
    _, alone, _ = run_all({"r": (PROMPT, params)})
    events, crowded, runner = run_all({**others, "r": (PROMPT, params)})
    assert max(runner.batch_sizes) > 2  # it did share steps
    for index in range(2):
        tokens, logprobs = reference(PROMPT, params, index)
        for outputs in (alone, crowded):
            assert outputs["r"].outputs[index].token_ids == tokens
            assert outputs["r"].outputs[index].logprobs == logprobs
        assert [e.logprob for e in events["r"] if e.index == index] == logprobs
    assert alone["r"].outputs[0].token_ids != alone["r"].outputs[1].token_ids


def test_a_stop_string_leaves_no_logprob_behind_while_the_sibling_runs():
    """n=2: sample 0 meets its stop string first and leaves the batch at once (item 5: drawn
    no more, its blocks freed) while its sibling runs to its end; each output's logprobs match its
    tokens, and the stream carries what the output holds."""
    tokenizer = ByteTokenizer()
    base = dict(max_tokens=10, temperature=1.0, n=2, ignore_eos=True, logprobs=True, top_logprobs=1)
    for seed in range(50):  # the first seed whose sample 0 has a letter sample 1 lacks, mid-way
        params = SamplingParams(seed=seed, **base)
        free = [reference(PROMPT, params, i)[0] for i in range(2)]
        texts = [tokenizer.decode(tokens) for tokens in free]
        cut = next((i for i in range(1, 8) if texts[0][i] not in texts[1] and texts[0][i] not in texts[0][:i]), None)
        if cut is not None:
            break
    else:
        raise AssertionError("no seed gives a usable stop letter")
    stopped = SamplingParams(seed=seed, stop=texts[0][cut], **base)
    events, outputs, runner = run_all({"r": (PROMPT, stopped)}, tokenizer)
    first, second = outputs["r"].outputs
    assert first.finish_reason == "stop" and first.token_ids == free[0][: cut + 1]
    assert first.text == texts[0][:cut]
    assert second.finish_reason == "length" and second.token_ids == free[1]
    assert runner.rows.count(("r", 0)) == cut + 1 and runner.rows.count(("r", 1)) == 10
    for index, completion in enumerate((first, second)):
        assert completion.logprobs == reference(PROMPT, stopped, index)[1][: len(completion.token_ids)]
        streamed = [e for e in events["r"] if e.index == index]
        assert [e.token_id for e in streamed] == completion.token_ids
        assert [e.logprob for e in streamed] == completion.logprobs


def test_the_tiny_model_penalises_and_streams_logprobs_as_the_sampler_does(weights):
    """Through the threaded engine and the real runner: a penalised greedy request gives the
    tokens and logprobs of the sampler run step by step on the float64 reference's logits, an
    unpenalised one's tokens are their own top alternative, and the stream equals the output."""
    prompt, plain = [40, 41], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    params = dataclasses.replace(plain, frequency_penalty=1.0, repetition_penalty=1.5)
    model = LlamaModel(weights)
    with Engine(model, load_tokenizer(None, model.config.vocab_size), EngineConfig(num_blocks=64)) as engine:
        handles = [engine.submit(prompt, plain), engine.submit(prompt, params)]
        unpenalised, output = (handle.result(timeout=60) for handle in handles)
        streamed = list(handles[1])  # ended: the handle replays its events without blocking
    dense, history, context = DenseReference(weights), TokenHistory(prompt), list(prompt)
    want = []
    for _ in range(12):
        logits = dense.logits(context)[-1:].astype(np.float32)
        out = sample_with_logprobs(logits, [params], [params.make_generator()], [history])
        top = list(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist(), strict=True))
        want.append((int(out.tokens[0]), float(out.logprobs[0]), top))
        context.append(want[-1][0])
        history.append(want[-1][0])
    completion = output.outputs[0]
    assert completion.token_ids == [token for token, _, _ in want]
    assert len(set(unpenalised.token_ids)) < 12 == len(set(completion.token_ids))  # the penalty bit
    for entry, (_, logprob, top) in zip(completion.logprobs, want, strict=True):
        assert entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert [t for t, _ in entry.top] == [t for t, _ in top]
        assert [lp for _, lp in entry.top] == pytest.approx([lp for _, lp in top], abs=1e-4)
    # Logprobs are the raw model's: where the penalty overrode the argmax, the top one is another.
    assert any(entry.top[0][0] != token for entry, token in zip(completion.logprobs, completion.token_ids, strict=True))
    for entry, token in zip(unpenalised.outputs[0].logprobs, unpenalised.token_ids, strict=True):
        assert entry.top[0] == (token, entry.logprob)
    assert [e.logprob for e in streamed] == completion.logprobs


def test_a_simulated_model_reports_its_tokens_as_certain():
    """The simulated runner has no logits: each token is its own only alternative, at logprob 0."""
    clock = VirtualClock()
    core = EngineCore(SimulatedRunner(SimulatedModel(vocab_size=VOCAB), clock), EngineConfig(num_blocks=64), clock=clock)
    core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3, n=2))
    core.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    outputs = {}
    while core.has_unfinished():
        outputs.update((o.request_id, o) for o in core.step()[1])
    for completion in outputs["r"].outputs:
        assert completion.logprobs == [TokenLogprob(t, 0.0, ((t, 0.0),)) for t in completion.token_ids]
    assert outputs["plain"].outputs[0].logprobs is None


def test_finish_sample_refuses_bad_input_with_typed_errors_changing_nothing():
    scheduler = Scheduler(num_blocks=16, block_size=4)
    scheduler.add_request("r", [5, 6, 7], max_tokens=4, n=2)
    scheduler.update(out := scheduler.schedule(), [8] * out.num_samples)  # forks the two samples
    with pytest.raises(UnknownSequenceError):
        scheduler.finish_sample("r", 2)
    with pytest.raises(UnknownSequenceError):
        scheduler.finish_sample("nope", 0)
    with pytest.raises(InvalidArgumentError):
        scheduler.finish_sample("r", "0")
    assert scheduler.num_running == 2
    scheduler.finish_sample("r", 0)
    with pytest.raises(InvalidArgumentError, match="last"):
        scheduler.finish_sample("r", 1)
    scheduler.check_invariants()
    assert scheduler.num_running == 1
