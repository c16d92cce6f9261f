"""Incremental detokenizing: no broken UTF-8 characters, stop strings found across token boundaries."""

from __future__ import annotations

import pytest
from engines import tiny_checkpoint
from transformers import AutoTokenizer

from omnivox.engine.detokenizer import IncrementalDetokenizer

TEXT = "Hello 😀🎉 東京は日本の首都です。 café, naïve 👍!"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(tiny_checkpoint(tmp_path_factory.mktemp("detok"), "llama"))


def test_streaming_never_emits_a_broken_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # Byte-level BPE splits the emoji and CJK characters over several tokens: the test needs such splits.
    assert any("\ufffd" in tokenizer.decode(ids[: i + 1]) for i in range(len(ids)))
    detok = IncrementalDetokenizer(tokenizer, [1], stop=None, include_stop=False, skip_special_tokens=True)
    deltas = []
    for t in ids:
        detok.add(t)
        deltas.append(detok.take(final=False))
    deltas.append(detok.take(final=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


@pytest.mark.parametrize("stop", ["東京", "😀🎉", "é, n", "👍!"])
def test_stop_string_across_tokens_is_cut_and_never_released(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=[stop, "zzz"], include_stop=False, skip_special_tokens=True)
    released = ""
    hit = False
    for t in ids:
        hit = detok.add(t)
        released += detok.take(final=hit)
        if hit:
            break
        assert stop not in released
    assert hit
    assert released == TEXT[: TEXT.index(stop)]


def test_stop_string_included_when_asked(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["日本"], include_stop=True, skip_special_tokens=True)
    for t in ids:
        if detok.add(t):
            break
    assert detok.take(final=True) == TEXT[: TEXT.index("日本") + 2]


def test_only_a_possible_stop_start_is_held_back(tokenizer):
    # A delta ends where its token does unless the text's tail could still begin a stop string (the old rule held
    # back len(stop) - 1 characters always: with stop "\n\n" every delta lagged one character behind its token).
    text = "Hello there.\nGood day\n\nbye"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["\n\n", "xyz"], include_stop=False, skip_special_tokens=True)
    released = ""
    for t in ids:
        hit = detok.add(t)
        released += detok.take(final=hit)
        if hit:
            break
        tail = detok.text[len(released) :]
        assert tail == "" or any(s.startswith(tail) for s in ["\n\n", "xyz"])
        if not detok.text.endswith(("\n", "x", "xy")):
            assert released == detok.text
    assert released == "Hello there.\nGood day"
