"""Incremental detokenizing: no broken UTF-8 characters, stop strings found across token boundaries."""

from __future__ import annotations

import pytest
from support.engines import tiny_checkpoint
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


# --- Bounded work per token, and streamed text == one-shot decode for mixed token sequences -------------------------


def sentencepiece_tokenizer():
    """A Llama-style SentencePiece tokenizer (Metaspace "▁" spacing, <0xNN> byte fallback, leading space stripped),
    with pieces trained on ASCII lines: emoji and CJK characters come out as byte tokens."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    lines = ["Hello there! How are you today? I am fine, thank you.", "The quick brown fox jumps over the lazy dog."]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.train_from_iterator(lines * 4, trainer=trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>"]))
    trained = json.loads(tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    spm = LlamaTokenizer(vocab=vocab, merges=merges)
    spm.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return spm


@pytest.fixture(scope="module")
def tokenizers_under_test(tokenizer):
    from omnivox.models.checkpoint import load_tokenizer
    from omnivox.services.parts.defaults import ensure_default_model

    return {
        "tiny-bpe": tokenizer,
        "smollm2": load_tokenizer(ensure_default_model(progress=False)),
        "sentencepiece": sentencepiece_tokenizer(),
    }


def byte_token_ids(tok, char: str) -> list[int]:
    """The character as one token per UTF-8 byte: <0xNN> pieces (SentencePiece) or byte-level BPE's byte alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    raw = char.encode()
    names = [f"<0x{b:02X}>" for b in raw]
    if tok.convert_tokens_to_ids(names[0]) in (None, tok.unk_token_id):
        names = [bytes_to_unicode()[b] for b in raw]
    ids = tok.convert_tokens_to_ids(names)
    assert tok.unk_token_id not in ids and tok.decode(ids) == char
    return ids


def mixed_sequence(tok, rng, n: int, inside: bool) -> list[int]:
    """n tokens or so: ordinary tokens, whole encoded phrases (byte-level tokens there end inside characters), single
    characters as one byte token a byte, special tokens between them, and when `inside` also between the bytes of one
    character (kept as text there, a special token breaks the character, and SentencePiece's byte fallback then renders
    the bytes on both sides differently as more come: no stream can match that, and the old detokenizer did not)."""
    from omnivox.engine.detokenizer import skipped_token_ids

    phrases = ["東京は日本の首都です。", " café, naïve", " 😀🎉", " 👍!", " Hello there, how are you?", " The fox."]
    encoded = [tok.encode(p, add_special_tokens=False) for p in phrases]
    ordinary = sorted({t for ids in encoded for t in ids if "\ufffd" not in tok.decode([t])})
    specials = sorted(skipped_token_ids(tok))
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.3:
            out.append(rng.choice(ordinary))
        elif r < 0.65:
            chunk = rng.choice(encoded) if r < 0.45 else byte_token_ids(tok, rng.choice("😀é東👍ü"))
            for t in chunk:
                out.append(t)
                if inside and rng.random() < 0.3:
                    out.append(rng.choice(specials))
        else:
            out.extend(rng.choice(specials) for _ in range(rng.randint(1, 12)))
    return out


def streamed(tok, prompt: list[int], ids: list[int], skip_special: bool) -> str:
    detok = IncrementalDetokenizer(tok, prompt, stop=None, include_stop=False, skip_special_tokens=skip_special)
    text = ""
    for t in ids:
        detok.add(t)
        delta = detok.take(final=False)
        assert "\ufffd" not in delta
        text += delta
    return text + detok.take(final=True)


@pytest.mark.parametrize("name", ["tiny-bpe", "smollm2", "sentencepiece"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_streamed_text_equals_the_one_shot_decode_of_mixed_tokens(tokenizers_under_test, name, skip_special):
    import random

    tok = tokenizers_under_test[name]
    rng = random.Random(0)
    hello = tok.encode("Hello", add_special_tokens=False)
    for seq in range(12):
        # Prompts with and without text before the output, so the output's first "▁" is a space or is stripped.
        prompt = [tok.bos_token_id] + (hello if seq % 2 else [])
        ids = mixed_sequence(tok, rng, 150, inside=skip_special)
        ids.extend(tok.encode(" fin", add_special_tokens=False))  # end on a complete character
        whole = tok.decode(prompt + ids, skip_special_tokens=skip_special)
        head = tok.decode(prompt, skip_special_tokens=skip_special)
        assert whole.startswith(head)
        assert streamed(tok, prompt, ids, skip_special) == whole[len(head) :], (name, seq)


def test_sentencepiece_spacing_is_kept(tokenizers_under_test):
    tok = tokenizers_under_test["sentencepiece"]
    ids = tok.encode("Hello there 😀 you", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[0].startswith("▁")
    # After a bos only the first "▁" is dropped (as the one-shot decode does); after text it is the space it means.
    assert streamed(tok, [tok.bos_token_id], ids, True) == "Hello there 😀 you"
    assert streamed(tok, tok.encode("Hi", add_special_tokens=False), ids, True) == " Hello there 😀 you"


class CountingTokenizer:
    """The tokenizer under test, counting the tokens each decode call is given."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece"])
def test_work_per_token_is_bounded_over_long_special_runs(tokenizers_under_test, name):
    tok = tokenizers_under_test[name]
    specials = sorted(t for t in tok.all_special_ids if t != tok.unk_token_id)
    head = tok.encode("Hello there", add_special_tokens=False)
    ids = (
        head + [specials[i % len(specials)] for i in range(2000)] + tok.encode(" you 😀 fox", add_special_tokens=False)
    )
    counting = CountingTokenizer(tok)
    for skip_special, expect in [(True, "Hello there you 😀 fox"), (False, None)]:
        counting.sizes.clear()
        text = streamed(counting, [tok.bos_token_id], ids, skip_special)
        assert text == (expect or tok.decode([tok.bos_token_id] + ids)[len(tok.decode([tok.bos_token_id])) :])
        assert max(counting.sizes) <= 16, (skip_special, max(counting.sizes))  # 2000 before the fix
        assert sum(counting.sizes) <= 20 * len(ids)


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece"])
def test_work_per_token_is_bounded_over_invalid_bytes(tokenizers_under_test, name):
    # Lone UTF-8 continuation bytes never complete a character: the window is released every few tokens as the
    # one-shot decode shows it (one U+FFFD a byte), instead of waiting (and re-decoding) for ever.
    tok = tokenizers_under_test[name]
    lone = byte_token_ids(tok, "é")[1]
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, [tok.bos_token_id], None, False, skip_special_tokens=True)
    for _ in range(2000):
        detok.add(lone)
    assert max(counting.sizes) <= 16
    assert 2000 - 8 <= len(detok.text) <= 2000 and set(detok.text) == {"\ufffd"}
    # A character whose bytes are the last tokens when the window is moved on still comes out whole (byte-level
    # BPE; SentencePiece's byte fallback renders every byte of an invalid run as U+FFFD, that character included).
    tail = [lone] * 6 + byte_token_ids(tok, "東") + tok.encode(" A", add_special_tokens=False)
    for t in tail:
        detok.add(t)
    expect = tok.decode([lone] * 2000 + tail)
    assert detok.text == expect and ("東" in expect) == (name == "smollm2")


def test_detokenize_benchmark_runs_and_both_sides_release_the_same_text(tmp_path):
    import json

    from omnivox.benchmarks import detokenize

    out = tmp_path / "detok.json"
    detokenize.main(["--tokens", "120", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())["workloads"]
    assert set(result) == {"mixed", "specials", "text"}
    assert (
        result["specials"]["decoded_tokens_per_token"]["after"]
        < 1
        < result["specials"]["decoded_tokens_per_token"]["before"]
    )
