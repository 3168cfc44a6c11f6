import pytest

from services.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Unicode: naïve café, 東京, emoji 🎉🎉 and done.",
    "  leading spaces\n\tand tabs\n\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, ())
    pieces = []
    for t in ids:
        detok.add_tokens([t])
        pieces.append(detok.take_delta(final=False))
    pieces.append(detok.take_delta(final=True))
    assert "".join(pieces) == detok.text == tokenizer.decode(ids)


def test_stop_string_cuts_text_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode("one two three STOP four five", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], ("STOP",))
    streamed = ""
    for t in ids:
        detok.add_tokens([t])
        streamed += detok.take_delta(final=detok.stopped)
        if detok.stopped:
            break
    assert detok.stopped
    assert detok.text == "one two three "
    assert streamed == detok.text
    assert "ST" not in streamed


def test_no_stop_when_absent(tokenizer):
    ids = tokenizer.encode("alpha beta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], ("gamma",))
    detok.add_tokens(ids)
    assert not detok.stopped and detok.text == "alpha beta"


def test_stop_matcher_finds_stops_across_feeds_and_the_partial_tail():
    from services.engine.detokenizer import StopMatcher

    m = StopMatcher(("abab", "xyz"))
    text = "zzaba"
    assert m.feed(text, 0) is None and m.partial == 3  # "aba" may still become "abab"
    text += "b"
    assert m.feed(text, 5) == 2
    m = StopMatcher(("aab",))
    text = "aaaa"
    assert m.feed(text, 0) is None and m.partial == 2
    text += "b!"
    assert m.feed(text, 4) == 2  # KMP falls back correctly after repeated 'a'


def test_long_stop_strings_stream_everything_but_a_possible_stop(tokenizer):
    """16 stop strings of the maximum length that almost match: nothing is lost or held back
    beyond the longest tail that could still start one of them."""
    stops = tuple("word " * 200 + str(i) for i in range(16))  # 1001 characters each
    ids = tokenizer.encode("word " * 300, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stops)
    streamed = ""
    for t in ids:
        detok.add_tokens([t])
        streamed += detok.take_delta(final=False)
    assert not detok.stopped
    held = detok.text[len(streamed) :]
    assert len(held) <= 1000 and ("word " * 200).startswith(held)
    assert streamed + detok.take_delta(final=True) == detok.text == "word " * 300
