"""feeding.py: running a generator's steps on a given stream (run_on_stream), and the
stream check."""

import mlx.core as mx
import pytest

from mlx_lm.feeding import (
    check_stream,
    current_generation_stream,
    generating_on,
    generation_stream,
    on_generation_stream,
    run_on_stream,
)


def default_stream():
    return mx.default_stream(mx.default_device())


def steps_that_record(seen):
    """Yields 1, 2, 3, recording (where it is, the current generation stream) at each
    step, at a thrown-in ValueError (which it swallows, yielding -1) and at its close."""
    try:
        for value in (1, 2, 3):
            seen.append(("step", default_stream(), current_generation_stream()))
            try:
                yield value
            except ValueError:
                seen.append(("thrown", default_stream(), current_generation_stream()))
                yield -1
    finally:
        seen.append(("finally", default_stream(), current_generation_stream()))


def test_steps_throws_and_close_run_on_the_stream_and_the_caller_does_not():
    stream, seen = mx.new_stream(mx.default_device()), []
    callers = default_stream()
    steps = run_on_stream(steps_that_record(seen), stream)
    assert next(steps) == 1 and default_stream() == callers and current_generation_stream() is generation_stream
    assert steps.throw(ValueError("at the yield")) == -1
    assert next(steps) == 2
    steps.close()
    assert [what for what, _, _ in seen] == ["step", "thrown", "step", "finally"]
    assert all(where == stream and current is stream for _, where, current in seen)
    assert default_stream() == callers and current_generation_stream() is generation_stream


def test_an_exception_the_steps_do_not_catch_reaches_the_caller_after_their_finally():
    stream, seen = mx.new_stream(mx.default_device()), []
    steps = run_on_stream(steps_that_record(seen), stream)
    next(steps)
    with pytest.raises(KeyError, match="not caught"):
        steps.throw(KeyError("not caught"))
    assert [what for what, _, _ in seen] == ["step", "finally"] and seen[-1][1] == stream
    assert current_generation_stream() is generation_stream


def test_nested_generators_each_keep_their_stream():
    outer_stream, inner_stream, seen = mx.new_stream(mx.default_device()), mx.new_stream(mx.default_device()), []

    def outer():
        inner = run_on_stream(steps_that_record(seen), inner_stream)
        for value in inner:
            seen.append(("outer", default_stream(), current_generation_stream()))
            yield value

    assert list(run_on_stream(outer(), outer_stream)) == [1, 2, 3]
    assert [(what, where == (outer_stream if what == "outer" else inner_stream)) for what, where, _ in seen] == \
        [(what, True) for what in ["step", "outer"] * 3 + ["finally"]]


def test_check_stream():
    stream = mx.new_stream(mx.default_device())
    assert check_stream(stream) is stream and check_stream(None) is generation_stream
    assert check_stream(mx.cpu) is mx.cpu
    with pytest.raises(ValueError, match=r"got \[1\] \(list\)"):
        check_stream([1])


def test_on_generation_stream_follows_generating_on():
    stream = mx.new_stream(mx.default_device())

    @on_generation_stream
    def where():
        return default_stream()

    with generating_on(stream):
        inside = where()
    with mx.stream(generation_stream):
        default = default_stream()
    assert inside == stream and where() == default and current_generation_stream() is generation_stream
