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
