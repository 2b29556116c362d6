"""embedded_requests.py: `ResponseGenerator.generate(request, generation_args,
progress_callback)` called as upstream 0.32.2's APIHandler calls it, its Responses read
as that handler reads them (the text state machine's split, flush and discard): the
text equals plain generation, speculating or not; refusals raise before any work; an
iterator closed early stops its job."""

import pytest
from test_server_embedding import model_dirs, reference, upstream_cli_args  # noqa: F401  (model_dirs: a fixture)

from mlx_lm.embedded_requests import request_body
from mlx_lm.server import LRUPromptCache, ModelProvider, ResponseGenerator
from mlx_lm.server_embedding import (
    CompletionRequest,
    GenerationArguments,
    LogitsProcessorArguments,
    ModelDescription,
    SamplingArguments,
)
from mlx_lm.text_state_machine import TextStateMachine
from mlx_lm.utils import load

MAX_TOKENS = 10
MESSAGES = [{"role": "user", "content": "Tell me about caches."}]


def arguments(**overrides):
    """What upstream's handler builds for a request that sets nothing (its defaults)."""
    fields = dict(model=ModelDescription("default_model", "default_model", None),
                  sampling=SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.1),
                  logits=LogitsProcessorArguments(None, 0.0, 20, 0.0, 20, 0.0, 20), stop_words=[],
                  max_tokens=MAX_TOKENS, num_draft_tokens=3, logprobs=False, top_logprobs=-1, seed=None,
                  chat_template_kwargs=None)
    return GenerationArguments(**{**fields, **overrides})


def chat(messages=MESSAGES):
    return CompletionRequest("chat", "", messages, None, None)


def read_like_upstream(context, responses):
    """(text, reasoning, finish_reason, number of Responses) as upstream's handler reads them."""
    state = context.text_sm.make_state(context.initial_state)
    text, reasoning, finish_reason, count = "", "", None, 0
    for gen in responses:
        count += 1
        if gen.finish_reason == "stop":
            state, current = TextStateMachine.discard(state)
            segments = [(current, "")]
        elif gen.finish_reason == "length":
            state, segments = TextStateMachine.split(state, gen.text)
            state, flushed, current = TextStateMachine.flush(state)
            segments.append((current, flushed))
        else:
            state, segments = TextStateMachine.split(state, gen.text)
        for name, piece in segments:
            text, reasoning = (text + piece, reasoning) if name == "normal" else (text, reasoning + piece)
        finish_reason = gen.finish_reason or finish_reason
    return text, reasoning, finish_reason, count


@pytest.fixture(scope="module")
def generators(model_dirs):  # noqa: F811
    """Plain and speculating (a draft) generators, both batching."""
    made = {name: ResponseGenerator(ModelProvider(upstream_cli_args(model=str(model_dirs["dense"]), **extra)),
                                    LRUPromptCache())
            for name, extra in {"plain": {}, "draft": {"draft_model": str(model_dirs["draft"])}}.items()}
    yield made
    for generator in made.values():
        generator.stop_and_join()


@pytest.mark.parametrize("kind", ["plain", "draft"])
def test_generate_gives_plain_generations_text_as_upstream_reads_it(generators, model_dirs, kind):  # noqa: F811
    generator = generators[kind]
    progress = []
    context, responses = generator.generate(chat(), arguments(), lambda done, total: progress.append((done, total)))
    tokenizer = load(str(model_dirs["dense"]))[1]
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert context.prompt == rendered and context.initial_state == "normal"
    text, reasoning, finish_reason, count = read_like_upstream(context, responses)
    assert (text, reasoning) == (reference(model_dirs["dense"], messages=MESSAGES), "")
    assert finish_reason == "length" and count >= 2  # pieces, then the finish
    assert progress[-1][1] == len(rendered) and context.prompt_cache_count >= 0
    prompt = "Once upon a time there was"
    context, responses = generator.generate(CompletionRequest("text", prompt, [], None, None), arguments())
    assert read_like_upstream(context, responses)[0] == reference(model_dirs["dense"], prompt=prompt)


def test_stop_words_logprobs_and_a_second_identical_request(generators, model_dirs):  # noqa: F811
    generator = generators["plain"]
    expected = reference(model_dirs["dense"], messages=MESSAGES)
    stop = expected[3:6]
    context, responses = generator.generate(chat(), arguments(stop_words=[stop], logprobs=True, top_logprobs=2))
    pieces = list(responses)
    assert "".join(p.text for p in pieces) == expected[: expected.index(stop)]
    assert pieces[-1].finish_reason == "stop" and all(p.token is None for p in pieces)
    assert all(len(p.top_tokens) == 2 and p.logprob <= 0 for p in pieces[:-1] if p.top_tokens)
    context, responses = generator.generate(chat(), arguments())
    assert read_like_upstream(context, responses)[0] == expected
    assert context.prompt_cache_count > 0  # the first request's cache served the second


def test_an_iterator_closed_early_stops_its_job(generators, model_dirs):  # noqa: F811
    generator = generators["plain"]
    context, responses = generator.generate(chat(), arguments(max_tokens=200))
    next(responses)
    responses.close()  # as upstream's handler's `finally: ctx.stop()` does
    context, responses = generator.generate(chat(), arguments())
    assert read_like_upstream(context, responses)[0] == reference(model_dirs["dense"], messages=MESSAGES)


@pytest.mark.parametrize("change, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(model=ModelDescription("default_model", None, "adapters")), "adapter"),
    (dict(model=ModelDescription("elsewhere", None, None)), "'elsewhere' is not served here"),
    (dict(sampling=SamplingArguments(-1.0, 1.0, 0, 0.0, 0.0, 0.1)), "temperature"),
])
def test_refused_requests_raise_before_any_work(generators, change, message):
    with pytest.raises(ValueError, match=message):
        generators["plain"].generate(chat(), arguments(**change))
    with pytest.raises(ValueError, match="role_mapping"):
        generators["plain"].generate(CompletionRequest("chat", "", MESSAGES, None, {"user": "U:"}), arguments())


def test_the_body_carries_upstreams_fields():
    logits = LogitsProcessorArguments({5: -10.0}, 1.2, 8, 0.0, 20, 0.5, 4)
    body = request_body(chat(), arguments(logits=logits, seed=7, top_logprobs=3, logprobs=True), speculating=False)
    assert body["logit_bias"] == {"5": -10.0} and body["repetition_penalty"] == 1.2
    assert body["repetition_context_size"] == 8 and "presence_penalty" not in body  # 0: upstream's "off"
    assert (body["frequency_penalty"], body["seed"], body["top_logprobs"]) == (0.5, 7, 3)
    assert "num_draft_tokens" not in body  # refused by a worker that does not speculate; upstream ignores it
    assert request_body(chat(), arguments(), speculating=True)["num_draft_tokens"] == 3
    text = request_body(CompletionRequest("text", "hi", [], None, None), arguments(logprobs=True, top_logprobs=2),
                        speculating=False)
    assert (text["prompt"], text["logprobs"]) == ("hi", 2) and "messages" not in text


def test_a_dead_worker_is_reported(model_dirs):  # noqa: F811
    generator = ResponseGenerator(ModelProvider(upstream_cli_args(model=str(model_dirs["dense"]))), LRUPromptCache())
    generator.stop_and_join()
    with pytest.raises(RuntimeError, match="generation thread died"):
        generator.generate(chat(), arguments())
