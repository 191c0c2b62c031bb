"""The incremental detokenizer: multibyte streaming and stop strings across pushes."""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minedraft.engine.detokenize import IncrementalDetokenizer

# -- incremental detokenizer ------------------------------------------------------------------------

MULTIBYTE = "naïve café — 東京 ✓ 🎉 done"


def stream(tok, ids, chunks, stop=()):
    """Push ids in chunks of the given sizes (the rest in a final push); return (deltas, detokenizer)."""
    det = IncrementalDetokenizer(tok, tuple(stop))
    deltas, i = [], 0
    for c in chunks:
        deltas.append(det.push(ids[i:i + c]))
        i += c
    deltas.append(det.push(ids[i:], final=True))
    return deltas, det


def test_multibyte_streaming_one_token_at_a_time(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    # the test means something only if some tokens are partial characters
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4
    deltas, det = stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == MULTIBYTE == det.text
    assert not any("\ufffd" in d for d in deltas)
    assert det.ids == ids and not det.stopped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="ab é東🎉\n", min_size=1, max_size=20), data=st.data())
def test_streaming_any_chunking_equals_full_decode(tiny_tokenizer, text, data):
    tok = tiny_tokenizer
    ids = tok.encode(text)
    chunks = data.draw(st.lists(st.integers(0, 4), max_size=len(ids)))
    deltas, det = stream(tok, ids, chunks)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_spanning_two_pushes(tiny_tokenizer):
    tok = tiny_tokenizer
    text, stop = "hello world, more text", "o w"
    ids = tok.encode(text)
    # find a split point inside the stop string's span
    cut = text.index(stop)
    bounds = [len(tok.decode(ids[:j])) for j in range(len(ids) + 1)]
    inside = [j for j, b in enumerate(bounds) if cut < b < cut + len(stop)]
    assert inside, "tokenization leaves no boundary inside the stop string"
    for j in inside:
        det = IncrementalDetokenizer(tok, (stop,))
        first = det.push(ids[:j])
        assert not det.stopped
        assert first == text[:cut], "text that might begin the stop string must be held back"
        second = det.push(ids[j:])
        assert det.stopped and second == "" and det.text == text[:cut] == "hell"
        assert det.push([5, 6], final=True) == "" and det.text == "hell"


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_multibyte_stop_string(tiny_tokenizer, chunk):
    tok = tiny_tokenizer
    ids = tok.encode(MULTIBYTE)
    deltas, det = stream(tok, ids, [chunk] * (len(ids) // chunk), stop=["東京"])
    assert det.stopped
    assert "".join(deltas) == det.text == MULTIBYTE[: MULTIBYTE.index("東京")]
    assert not any("\ufffd" in d for d in deltas)


def held_back(text: str, stops) -> int:
    """Reference: length of the longest tail of text that is a proper prefix of some stop string."""
    return max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)


def test_partial_stop_held_back_then_released(tiny_tokenizer):
    tok = tiny_tokenizer
    text, stops = "abc abd", ("abx", "d!")
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, stops)
    emitted = ""
    for j in range(1, len(ids) + 1):
        emitted += det.push(ids[j - 1:j])
        prefix = tok.decode(ids[:j])
        assert emitted == prefix[: len(prefix) - held_back(prefix, stops)]
    assert emitted == "abc ab"  # the final "d" could still begin "d!"
    emitted += det.push([], final=True)
    assert emitted == text and not det.stopped


def test_stop_string_at_start_and_earliest_of_several(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("stop here, or there")
    assert "".join(stream(tok, ids, [1] * len(ids), stop=["stop"])[0]) == ""
    for chunks in ([1] * len(ids), [len(ids)]):
        deltas, det = stream(tok, ids, chunks, stop=["there", "or", "here"])
        assert "".join(deltas) == "stop " and det.stopped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="abc é東", min_size=2, max_size=16), data=st.data())
def test_single_stop_string_any_chunking(tiny_tokenizer, text, data):
    tok = tiny_tokenizer
    i = data.draw(st.integers(0, len(text) - 1))
    stop = text[i: i + data.draw(st.integers(1, 3))]
    ids = tok.encode(text)
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    deltas, det = stream(tok, ids, chunks, stop=[stop])
    assert det.stopped
    assert "".join(deltas) == det.text == text[: text.index(stop)]


def test_overlapping_stop_strings_do_not_depend_on_chunking(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("xabcdyz")
    results = {"".join(stream(tok, ids, chunks, stop=["bc", "abcd"])[0])
               for chunks in ([1] * len(ids), [len(ids)], [2, 5])}
    assert results == {"xa"}


def first_stop_cut(text: str, stops) -> int | None:
    """Reference: where text is cut for the stop string that completes first (the longest of those that end
    there), or None."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    return min(ends)[0] + min(ends)[1] if ends else None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="ab c東", min_size=1, max_size=24),
       stops=st.lists(st.text(alphabet="ab c東", min_size=1, max_size=5), min_size=1, max_size=6),
       data=st.data())
def test_many_stop_strings_any_chunking_match_a_naive_search(tiny_tokenizer, text, stops, data):
    tok = tiny_tokenizer
    ids = tok.encode(text)
    chunks = data.draw(st.lists(st.integers(0, 4), max_size=len(ids)))
    deltas, det = stream(tok, ids, chunks, stop=stops)
    cut = first_stop_cut(text, stops)
    assert det.stopped == (cut is not None)
    assert "".join(deltas) == det.text == (text if cut is None else text[:cut])
    if cut is not None:  # token_ids end with the token that completed the stop string, whatever the chunking
        n = next(n for n in range(1, len(ids) + 1) if first_stop_cut(tok.decode(ids[:n]), stops) is not None)
        assert det.ids == ids[:n]


def test_stop_matching_cost_per_push_does_not_grow_with_the_number_of_stop_strings(tiny_tokenizer, monkeypatch):
    """Each push reads only the held-back tail and the new text, once, whatever the number of stop strings (the
    check that was stops x length per push froze the server's event loop, issue 35)."""
    from minedraft.engine import detokenize
    steps = [0]
    step = detokenize.StopMatcher.step

    def counted(self, state, ch):
        steps[0] += 1
        return step(self, state, ch)
    monkeypatch.setattr(detokenize.StopMatcher, "step", counted)
    tok = tiny_tokenizer
    ids = tok.encode("The class statement defines a class. " * 8)
    for n_stops in (1, 16):
        stops = tuple(f"{i:02d}" + "x" * 126 for i in range(n_stops - 1)) + ("The class statement" + "y" * 100,)
        det = IncrementalDetokenizer(tok, stops)
        worst = 0
        for i in range(0, len(ids), 3):
            steps[0] = 0
            held = len(tok.decode(ids[:i])) - len(det.text)
            det.push(ids[i:i + 3])
            worst = max(worst, steps[0] - held - len(tok.decode(ids[i:i + 3])))
        assert worst <= 2, n_stops  # a token's text may decode a character or two differently at a boundary


def test_stop_completed_by_a_held_back_partial_character_keeps_the_same_ids_whatever_the_chunking(tiny_tokenizer):
    """A stop string that ends in a token whose text was held back (here a partial UTF-8 byte, shown as U+FFFD
    only once the next token proves it invalid) ends token_ids at that token, as a one-push decode does, even when
    the proof arrives in a later push."""
    tok = tiny_tokenizer
    ids = [258, 216, 216, 29, 123, 216, 40, 41]
    texts = [tok.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]
    assert texts[5].endswith("\ufffd")  # token 123 is a partial byte
    stop = texts[5][-2:]
    first = next(n for n in range(len(ids) + 1) if stop in texts[n])
    for chunks in ([5], [1] * 5, [2, 3], [4, 2], [len(ids)]):
        _, det = stream(tok, ids, chunks, [stop])
        assert det.stopped and det.ids == ids[:first], chunks
