"""Prompt-cache files (models/cache.py save/load), mlx_lm.cache_prompt and
mlx_lm.generate --prompt-cache-file."""

import functools
import os
import re

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import TINY_CONFIGS, write_checkpoint
from mlx.utils import tree_flatten

from mlx_lm.cache_prompt import fill_cache, load_cached_prompt, tokens_after_cache
from mlx_lm.cache_prompt import main as cache_prompt_main
from mlx_lm.cli_args import format_bytes
from mlx_lm.generate import build_prompt, generate_step, maybe_quantize_kv_cache
from mlx_lm.generate import main as generate_main
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from mlx_lm.utils import load, load_model

PROMPT = [5, 17, 260, 33, 101, 7, 99, 300, 12, 45, 8, 200]
KV_CONFIG = dict(TINY_CONFIGS["llama"], num_attention_heads=2, num_key_value_heads=1)  # head_dim 32


def kv(num_tokens, seed, dim=32):
    rng = np.random.default_rng(seed)
    shape = (1, 2, num_tokens, dim)
    keys = mx.array(rng.standard_normal(shape), dtype=mx.float32)
    return keys, mx.array(rng.standard_normal(shape), dtype=mx.float32)


def filled(cache, *updates):
    for num_tokens, seed in updates:
        cache.update_and_fetch(*kv(num_tokens, seed))
    return cache


def arrays_cache():
    cache = ArraysCache(3)
    cache[0], cache[2] = mx.ones((1, 3, 4)), mx.arange(6, dtype=mx.float32).reshape(1, 2, 3)
    return cache  # entry 1 stays None


CACHES = {
    "kv": lambda: filled(KVCache(), (300, 0)),  # crosses a 256-row growth step
    "kv_empty": KVCache,
    "concatenate": lambda: filled(ConcatenateKVCache(), (5, 0), (2, 1)),
    "rotating_wrapped": lambda: filled(RotatingKVCache(6, keep=2), (5, 0), (1, 1), (1, 2), (1, 3), (1, 4)),
    "quantized": lambda: filled(QuantizedKVCache(group_size=32, bits=4), (10, 0), (1, 1)),
    "arrays": arrays_cache,
    "cache_list": lambda: CacheList(filled(KVCache(), (4, 0)), arrays_cache()),
}


def flat_state(entry):
    return tree_flatten(entry.state)


@pytest.mark.parametrize("name", sorted(CACHES))
def test_every_cache_type_round_trips(tmp_path, name):
    original = [CACHES[name](), KVCache()]
    save_prompt_cache(str(tmp_path / "c.safetensors"), original, {"note": "hi.there"})
    loaded, metadata = load_prompt_cache(str(tmp_path / "c.safetensors"), return_metadata=True)
    assert metadata == {"note": "hi.there"}
    assert [type(c) for c in loaded] == [type(c) for c in original]
    want, got = flat_state(original[0]), flat_state(loaded[0])
    assert [k for k, _ in got] == [k for k, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert (a is None and b is None) or mx.array_equal(a, b)
    assert loaded[0].meta_state == original[0].meta_state
    if name in ("kv", "concatenate", "rotating_wrapped", "quantized"):  # and continues identically
        k, v = kv(3, 9)
        want_out, got_out = original[0].update_and_fetch(k, v), loaded[0].update_and_fetch(k, v)
        assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(tree_flatten(got_out), tree_flatten(want_out)))


def test_file_layout_is_upstreams_current_one(tmp_path):
    """Upstream 0.32.1+ (#1778): scalars inside the states, "1.<layer>" class names,
    "0.<key>" user metadata and a "2" list of the converted tensors' kinds."""
    entries = [filled(KVCache(), (3, 0)), arrays_cache(), filled(QuantizedKVCache(32, 8), (2, 1))]
    save_prompt_cache(str(tmp_path / "c"), entries, {"model": "m"})  # MLX adds .safetensors
    tensors, metadata = mx.load(str(tmp_path / "c.safetensors"), return_metadata=True)
    assert sorted(tensors) == sorted(
        ["0.0", "0.1", "0.2", "1.0.0", "1.0.1", "1.0.2", "1.1", "1.2", "2.2", "2.3", "2.4"]
        + [f"2.{i}.{j}" for i in (0, 1) for j in (0, 1, 2)]
    )
    assert tensors["0.2"].item() == 3 and tensors["1.0.1"].size == 0 and tensors["2.0.0"].dtype == mx.uint32
    assert (tensors["2.2"].item(), tensors["2.3"].item(), tensors["2.4"].item()) == (2, 32, 8)
    kinds = [["0.2", "scalar"], ["1.0.1", "none"], ["1.1", "none"], ["1.2", "none"],
             ["2.2", "scalar"], ["2.3", "scalar"], ["2.4", "scalar"]]
    assert metadata == {
        "0.model": "m", "1.0": "KVCache", "1.1": "ArraysCache", "1.2": "QuantizedKVCache", "2.0": "",
        **{f"2.{i + 1}.{j}": value for i, kind in enumerate(kinds) for j, value in enumerate(kind)},
    }


def test_hand_written_file_of_upstreams_current_layout_loads(tmp_path):
    """As upstream 0.32.2 writes them: a KVCache's whole buffer (longer than its offset),
    a RotatingKVCache's ring with its write index, an ArraysCache with an empty slot
    and a CacheList whose children's class names are strings inside its state."""
    k, v = kv(6, 0)
    tensors = {"0.0": k, "0.1": v, "0.2": mx.array(4),
               "1.0": k[..., :4, :], "1.1": v[..., :4, :], "1.2": mx.array(9), "1.3": mx.array(1),
               "1.4": mx.array(4), "1.5": mx.array(3),
               "2.0.0": k[..., :2, :], "2.0.1": mx.array([]), "2.1": mx.array([]), "2.2": mx.array([]),
               "3.0.0.0": k[..., :2, :], "3.0.0.1": v[..., :2, :], "3.0.0.2": mx.array(2),
               "3.0.1": mx.array([ord(c) for c in "KVCache"])}
    kinds = [["0.2", "scalar"], ["1.2", "scalar"], ["1.3", "scalar"], ["1.4", "scalar"], ["1.5", "scalar"],
             ["2.0.1", "none"], ["2.1", "none"], ["2.2", "none"], ["3.0.0.2", "scalar"], ["3.0.1", "string"]]
    metadata = {"0.model": "some/model", "1.0": "KVCache", "1.1": "RotatingKVCache", "1.2": "ArraysCache",
                "1.3": "CacheList", "2.0": "",
                **{f"2.{i + 1}.{j}": value for i, kind in enumerate(kinds) for j, value in enumerate(kind)}}
    mx.save_safetensors(str(tmp_path / "up.safetensors"), tensors, metadata)
    cache, meta = load_prompt_cache(str(tmp_path / "up.safetensors"), return_metadata=True)
    assert meta == {"model": "some/model"}
    assert cache[0].offset == 4 and mx.array_equal(cache[0].state[0], k[..., :4, :])
    assert (cache[1].keep, cache[1].max_size, cache[1].offset, cache[1]._idx) == (1, 4, 9, 3)
    assert mx.array_equal(cache[2][0], k[..., :2, :]) and cache[2][1] is None
    assert isinstance(cache[3], CacheList) and cache[3].caches[0].offset == 2
    # Written back, the same entries load again (the layout round-trips).
    save_prompt_cache(str(tmp_path / "again.safetensors"), cache, meta)
    again = load_prompt_cache(str(tmp_path / "again.safetensors"))
    for a, b in zip(again, cache):
        got, want = tree_flatten(a.state), tree_flatten(b.state)
        assert [key for key, _ in got] == [key for key, _ in want] and want
        assert all((x is None and y is None) or mx.array_equal(x, y) for (_, x), (_, y) in zip(got, want))
        assert a.meta_state == b.meta_state


def test_concatenate_cache_file_is_upstreams_layout(tmp_path):
    """Upstream stores a ConcatenateKVCache as its (keys, values), nothing else: both ways."""
    k, v = kv(5, 0)
    mx.save_safetensors(str(tmp_path / "up.safetensors"), {"0.0": k, "0.1": v},
                        {"1.0": "ConcatenateKVCache", "2.0": ""})
    (loaded,) = load_prompt_cache(str(tmp_path / "up.safetensors"))
    assert type(loaded) is ConcatenateKVCache and loaded.offset == 5 and mx.array_equal(loaded.keys, k)
    save_prompt_cache(str(tmp_path / "ours.safetensors"), [loaded, ConcatenateKVCache()])
    tensors, metadata = mx.load(str(tmp_path / "ours.safetensors"), return_metadata=True)
    assert sorted(tensors) == ["0.0", "0.1", "1.0", "1.1"] and mx.array_equal(tensors["0.1"], v)
    assert metadata["1.0"] == metadata["1.1"] == "ConcatenateKVCache"
    # Only the empty entry's two None leaves are noted as such.
    assert sorted(m for key, m in metadata.items() if re.fullmatch(r"2\.\d+\.0", key)) == ["1.0", "1.1"]
    assert load_prompt_cache(str(tmp_path / "ours.safetensors"))[1].empty()


def attends_alike(cache_a, cache_b, steps, seed):
    """The next `steps` single tokens attend the same through both caches, each with its own mask."""
    for step in range(steps):
        (k, v), q = kv(1, seed + step), kv(1, seed + 100 + step)[0]
        got = []
        for c in (cache_a, cache_b):
            mask = c.make_mask(1)
            got.append(mx.fast.scaled_dot_product_attention(q, *c.update_and_fetch(k, v), scale=1.0, mask=mask))
        assert mx.allclose(got[0], got[1], atol=1e-5), step


def test_chunked_cache_file_is_upstreams_layout(tmp_path):
    """Upstream holds a ChunkedKVCache's rows in order from start_position (keys, values,
    offset, chunk_size, start_position); this package's ring is written so and read back."""
    cache = filled(ChunkedKVCache(4), (5, 0), (1, 1), (1, 2), (1, 3))  # the ring has wrapped in place
    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    tensors, metadata = mx.load(str(tmp_path / "c.safetensors"), return_metadata=True)
    assert metadata["1.0"] == "ChunkedKVCache" and sorted(tensors) == [f"0.{i}" for i in range(5)]
    assert [tensors[f"0.{i}"].item() for i in (2, 3, 4)] == [8, 4, 4]  # offset, chunk_size, start_position
    assert all(mx.array_equal(tensors[f"0.{i}"], rows) for i, rows in enumerate(cache.held_in_order()))
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert type(loaded) is ChunkedKVCache and (loaded.offset, loaded.chunk_size) == (8, 4)
    attends_alike(loaded, cache, 6, seed=20)  # across the next chunk boundary


@pytest.mark.parametrize("offset,start_position", [(11, 7), (3, 0)])
def test_hand_written_chunked_file_of_upstreams_layout_loads(tmp_path, offset, start_position):
    k, v = kv(256, 0)  # upstream's buffer: 256 rows, positions start_position.. from row 0
    tensors = {"0.0": k, "0.1": v, "0.2": mx.array(offset), "0.3": mx.array(4), "0.4": mx.array(start_position)}
    kinds = [["0.2", "scalar"], ["0.3", "scalar"], ["0.4", "scalar"]]
    metadata = {"1.0": "ChunkedKVCache", "2.0": "",
                **{f"2.{i + 1}.{j}": value for i, kind in enumerate(kinds) for j, value in enumerate(kind)}}
    mx.save_safetensors(str(tmp_path / "up.safetensors"), tensors, metadata)
    (loaded,) = load_prompt_cache(str(tmp_path / "up.safetensors"))
    fed, valid = ChunkedKVCache(4), offset - start_position
    fed.update_and_fetch(*(mx.concatenate([gone, held[..., :valid, :]], axis=2)
                           for gone, held in zip(kv(start_position, 5), (k, v))))
    assert loaded.offset == offset
    assert all(mx.array_equal(a, b) for a, b in zip(loaded.held_in_order(), fed.held_in_order()))
    attends_alike(loaded, fed, 6, seed=30)
    tensors["0.4"] = mx.array(offset - 1)  # one row left: the chunk needs more
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), tensors, metadata)
    with pytest.raises(ValueError, match=f"needs its newest {min(offset, 4)} rows; from position {offset - 1} it has 1"):
        load_prompt_cache(str(tmp_path / "bad.safetensors"))


def test_hand_written_file_of_upstreams_earlier_layout_loads(tmp_path):
    k, v = kv(6, 0)
    qk, qv = mx.quantize(k, 32, 4), mx.quantize(v, 32, 4)
    tensors = {"0.0": k[..., :5, :], "0.1": v[..., :5, :], "2.0": k, "2.1": v, "3.0": k[..., :2, :]}
    tensors.update({f"1.0.{i}": t for i, t in enumerate(qk)})
    tensors.update({f"1.1.{i}": t for i, t in enumerate(qv)})
    metadata = {
        "0.0": "", "0.1.0": "6", "0.1.1": "32", "0.1.2": "4",
        "0.2.0": "2", "0.2.1": "6", "0.2.2": "9", "0.2.3": "3",
        "0.3": "", "2.0": "KVCache", "2.1": "QuantizedKVCache", "2.2": "RotatingKVCache", "2.3": "ArraysCache",
        "1.model": "some/model",
    }
    mx.save_safetensors(str(tmp_path / "up.safetensors"), tensors, metadata)
    cache, meta = load_prompt_cache(str(tmp_path / "up.safetensors"), return_metadata=True)
    assert meta == {"model": "some/model"}
    assert cache[0].offset == 5 and (cache[1].offset, cache[1].group_size, cache[1].bits) == (6, 32, 4)
    assert (cache[2].keep, cache[2].max_size, cache[2].offset, cache[2]._idx) == (2, 6, 9, 3)
    assert mx.array_equal(cache[3][0], k[..., :2, :])  # ArraysCache before #1632: a bare list


def write_bad(path, tensors, metadata):
    mx.save_safetensors(str(path), tensors, metadata)
    return str(path)


@pytest.mark.parametrize(
    "tensors, metadata, message",
    [
        ({"0.0": mx.zeros((1,))}, {"0.0": "", "2.0": "os.system"}, "unknown cache class 'os.system'"),
        ({}, {"0.0": ""}, "0 class names and 1 meta states"),
        ({}, {"0": "", "2.0": "KVCache"}, "1 class names and no list of meta states"),
        ({"x.0": mx.zeros((1,))}, {"0.0": "", "2.0": "KVCache"}, "tensor 'x.0' belongs to no cache entry"),
        ({"0.0": mx.zeros((1, 1, 2, 4))}, {"0.0": "", "2.0": "KVCache"}, r"entry 0 \('KVCache'\)"),
        ({"0": mx.zeros((2, 1, 2, 4))}, {"0.0": "", "2.0": "KVCache"}, "must be a list of arrays"),
        ({}, {"0.0": "", "2.0": "KVCache", "2.2": "KVCache"}, "indices"),
        ({"0.0.0": mx.zeros((1, 1, 2, 1), mx.uint32), "0.0.1": mx.zeros((1, 1, 2, 1)), "0.0.2": mx.zeros((1, 1, 2, 1)),
          "0.1.0": mx.zeros((1, 1, 2, 1), mx.uint32), "0.1.1": mx.zeros((1, 1, 2, 1)), "0.1.2": mx.zeros((1, 1, 2, 1))},
         {"0.0.0": "99", "0.0.1": "32", "0.0.2": "4", "2.0": "QuantizedKVCache"}, "offset 99 exceeds"),
        ({"0.0.0": mx.zeros((1, 2)), "0.1": mx.array([1.0]), "0.2": mx.array([])},
         {"0.0": "", "2.0": "ArraysCache"}, "left padding"),
        # upstream's current layout
        ({"0.0": mx.zeros((1, 1, 2, 4))}, {"1.0": "KVCache", "2.0": "", "2.1.0": "0.2", "2.1.1": "scalar"},
         "names '0.2', which the file has no tensor for"),
        ({"0.0": mx.zeros((1, 1, 2, 4)), "0.1": mx.zeros((1, 1, 2, 4)), "0.2": mx.array(2)},
         {"1.0": "KVCache", "2.0": "", "2.1.0": "0.2", "2.1.1": "int"}, "unknown kind 'int'"),
        ({}, {"2.0": ""}, "no class names"),
        ({"0.0": mx.zeros((1, 2)), "0.1": mx.array([1.0]), "0.2": mx.array([])},
         {"1.0": "ArraysCache", "2.0": "", "2.1.0": "0.2", "2.1.1": "none"}, "left padding"),
    ],
)
def test_malformed_files_get_clear_errors(tmp_path, tensors, metadata, message):
    path = write_bad(tmp_path / "bad.safetensors", tensors, metadata)
    with pytest.raises(ValueError, match=message):
        load_prompt_cache(path)


def test_unreadable_files_and_bad_metadata(tmp_path):
    save_prompt_cache(str(tmp_path / "c.safetensors"), [filled(KVCache(), (8, 0))])
    data = (tmp_path / "c.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="Could not read prompt cache file .*cut.safetensors"):
        load_prompt_cache(str(tmp_path / "cut.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
    with pytest.raises(ValueError, match="Could not read prompt cache file"):
        load_prompt_cache(str(tmp_path / "junk.safetensors"))
    with pytest.raises(ValueError, match="strings to strings"):
        save_prompt_cache(str(tmp_path / "m.safetensors"), [KVCache()], {"layers": 2})


# ---------------------------------------------------------------------------
# Generation from a loaded cache.


@pytest.fixture(scope="module")
def kv_model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("kv"), KV_CONFIG, seed=4)


def run(model, prompt, **kwargs):
    return [(t, lp) for t, lp in generate_step(mx.array(prompt), model, max_tokens=10, **kwargs)]


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_generation_continued_from_a_loaded_cache_equals_uninterrupted(tmp_path, kv_model_dir, kv_bits):
    model, _ = load_model(kv_model_dir)
    cached, rest = PROMPT[:7], PROMPT[7:]
    kv_options = dict(kv_bits=kv_bits, kv_group_size=32, quantized_kv_start=0)
    # The uninterrupted run prefills the cached part as one chunk, as the cache did.
    uninterrupted = run(model, cached + rest, prefill_step_size=len(cached), **kv_options)

    prompt_cache = make_prompt_cache(model)
    fill_cache(model, cached, prompt_cache, functools.partial(maybe_quantize_kv_cache, **kv_options))
    save_prompt_cache(str(tmp_path / "c.safetensors"), prompt_cache)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert all(isinstance(c, QuantizedKVCache if kv_bits else KVCache) and c.offset == 7 for c in loaded)
    resumed = run(model, rest, prompt_cache=loaded, **kv_options)
    assert [t for t, _ in resumed] == [t for t, _ in uninterrupted]
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(resumed, uninterrupted))


def test_tokens_after_cache_trims_to_the_common_prefix():
    prompt_cache = [filled(KVCache(), (5, 0))]
    assert tokens_after_cache(prompt_cache, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7]) == [6, 7]
    assert prompt_cache[0].offset == 5
    assert tokens_after_cache(prompt_cache, [1, 2, 3, 4, 5], [1, 2, 9, 9]) == [9, 9]
    assert prompt_cache[0].offset == 2
    prompt_cache = [filled(KVCache(), (3, 0))]
    assert tokens_after_cache(prompt_cache, [1, 2, 3], [1, 2, 3]) == [3]  # one token must be fed
    assert prompt_cache[0].offset == 2
    with pytest.raises(ValueError, match="cannot be trimmed back .*ArraysCache"):
        tokens_after_cache([arrays_cache()], [1, 2, 3], [1, 5])


@pytest.mark.parametrize("template_flags", [[], ["--ignore-chat-template"]])
def test_cache_prompt_then_generate_equals_generating_from_the_whole_prompt(tmp_path, tiny_model_dir, capsys,
                                                                            template_flags):
    cache_file = str(tmp_path / "doc.safetensors")
    head, tail = "The tokenizer splits text", " into pieces; the detokenizer"
    cache_prompt_main(["--model", str(tiny_model_dir), "--prompt", head, "--prompt-cache-file", cache_file,
                       *template_flags])
    file_size = format_bytes(os.path.getsize(cache_file))
    assert capsys.readouterr().out.endswith(f" prompt tokens in {cache_file} ({file_size})\n")

    common = ["--model", str(tiny_model_dir), "--max-tokens", "8", "--verbose", "false", *template_flags]
    generate_main([*common, "--prompt-cache-file", cache_file, "--prompt", tail])
    resumed = capsys.readouterr().out
    generate_main([*common, "--prompt", head + tail])
    assert resumed == capsys.readouterr().out

    # The same through the API: only the part after the cached prompt is fed.
    model, tokenizer = load(str(tiny_model_dir))
    cached = load_cached_prompt(cache_file, model, str(tiny_model_dir))
    use_template = not template_flags

    def format_prompt(text):
        return build_prompt(tokenizer, text, None, use_template, {})

    prompt_cache, to_feed = cached.resume(tokenizer, tail, format_prompt)
    whole = format_prompt(head + tail)
    assert prompt_cache[0].offset + len(to_feed) == len(whole) and len(to_feed) < len(whole) - 5
    resumed_tokens = [t for t, _ in run(model, to_feed, prompt_cache=prompt_cache)]
    assert resumed_tokens == [t for t, _ in run(model, whole)]


def test_a_cache_file_with_a_draft_model_generates_what_the_whole_prompt_does(tmp_path, tiny_model_dir,
                                                                               tiny_llama_dir, capsys):
    """The file holds the target's cache; the draft (another model: it disagrees, so
    rollbacks happen) is brought to the cached tokens, and generation goes on as without."""
    cache_file = str(tmp_path / "doc")  # MLX adds .safetensors
    head, tail = "The tokenizer splits text", " into pieces; the detokenizer"
    cache_prompt_main(["--model", str(tiny_model_dir), "--prompt", head, "--prompt-cache-file", cache_file])
    saved = cache_file + ".safetensors"
    assert capsys.readouterr().out.endswith(f"in {saved} ({format_bytes(os.path.getsize(saved))})\n")
    common = ["--model", str(tiny_model_dir), "--max-tokens", "12"]
    draft = ["--draft-model", str(tiny_llama_dir)]
    outputs = []
    for extra in (["--prompt", head + tail], [*draft, "--prompt", head + tail],
                  [*draft, "--prompt", tail, "--prompt-cache-file", saved]):
        generate_main([*common, *extra])
        outputs.append(capsys.readouterr().out)
    texts = [out.split("==========")[1] for out in outputs]
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) > 5
    num_prompt = [int(re.search(r"Prompt: (\d+) tokens", out).group(1)) for out in outputs]
    assert num_prompt[2] < num_prompt[1] - 5  # the cached part was not fed again
    accepted, drafted = map(int, re.search(r"Speculation: (\d+)/(\d+) draft tokens", outputs[2]).groups())
    assert accepted < drafted  # the draft disagreed at times, so caches were rolled back

    # Upstream's files do not record their tokens, so the draft cannot catch up.
    model, _ = load_model(tiny_model_dir)
    save_prompt_cache(str(tmp_path / "up.safetensors"), make_prompt_cache(model), {"model": str(tiny_model_dir)})
    with pytest.raises(SystemExit, match="does not record its tokens .* leave out --draft-model"):
        generate_main([*common, *draft, "--prompt", tail, "--prompt-cache-file", str(tmp_path / "up.safetensors")])


def test_generate_refuses_a_cache_from_another_model(tmp_path, tiny_model_dir, tiny_llama_dir):
    cache_file = str(tmp_path / "qwen.safetensors")
    cache_prompt_main(["--model", str(tiny_model_dir), "--prompt", "hello", "--prompt-cache-file", cache_file])
    with pytest.raises(SystemExit) as refused:
        generate_main(["--model", str(tiny_llama_dir), "--prompt-cache-file", cache_file, "--prompt", "x"])
    message = str(refused.value)
    assert f"made for model '{tiny_model_dir}' (qwen3)" in message and f"not for '{tiny_llama_dir}'" in message

    # A file without a fingerprint (as upstream writes them) must name the same model.
    model, _ = load_model(tiny_model_dir)
    save_prompt_cache(str(tmp_path / "up.safetensors"), make_prompt_cache(model), {"model": "org/other"})
    with pytest.raises(ValueError, match="made for model 'org/other'"):
        load_cached_prompt(str(tmp_path / "up.safetensors"), model, str(tiny_model_dir))


def test_quantized_prompt_cache_and_kv_options(tmp_path, kv_model_dir, capsys):
    cache_file = str(tmp_path / "q.safetensors")
    cache_prompt_main(["--model", str(kv_model_dir), "--prompt", "The tokenizer splits text",
                       "--prompt-cache-file", cache_file, "--kv-bits", "8", "--kv-group-size", "32",
                       "--quantized-kv-start", "0"])
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 8 for c in load_prompt_cache(cache_file))
    common = ["--model", str(kv_model_dir), "--prompt-cache-file", cache_file, "--prompt", " into", "--max-tokens", "3"]
    generate_main([*common, "--verbose", "false"])
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit, match="quantized with kv_bits=8, kv_group_size=32"):
        generate_main([*common, "--kv-bits", "4", "--kv-group-size", "32"])
    with pytest.raises(SystemExit, match="does not divide the head dimension 32"):
        cache_prompt_main(["--model", str(kv_model_dir), "--prompt", "hi", "--prompt-cache-file", cache_file + "2",
                           "--kv-bits", "8", "--quantized-kv-start", "0"])
