"""The CTranslate2 reader/writer (models/ctranslate2.py) and Whisper's name mapping (models/ct2_whisper.py), on a
tiny random Whisper written in CTranslate2's layout by the test (the real whisper-base file is checked by hand: see
the Whisper issue's report)."""

from __future__ import annotations

import json

import pytest
import torch
from support.whisper_checkpoints import save_tiny_whisper
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from omnivox.models.audio.whisper import load_whisper
from omnivox.models.ct2_whisper import convert_ct2_whisper_folder, ct2_whisper_to_hf, hf_whisper_to_ct2
from omnivox.models.ctranslate2 import WHISPER_SPEC, read_ct2, resolve_aliases, write_ct2

# A byte-level tokenizer with Whisper's special tokens: ids 256 (<|endoftext|>) ... 265 (<|notimestamps|>), then
# the converter adds 34 timestamp tokens up to the tiny vocabulary of 300.
SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|de|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nocaptions|>",
    "<|notimestamps|>",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = save_tiny_whisper(tmp_path_factory.mktemp("hf"))
    state = {k: v for k, v in hf.state_dict().items() if k != "proj_out.weight"}
    return hf, state


def test_write_read_round_trip(tiny, tmp_path):
    hf, state = tiny
    ct2, aliases = hf_whisper_to_ct2(state, hf.config)
    assert ct2["decoder/layer_1/self_attention/linear_0/weight"].shape == (192, 64)  # q|k|v fused
    assert ct2["decoder/layer_1/attention/linear_1/bias"].shape == (128,)  # cross k|v fused, k bias zeros
    write_ct2(tmp_path / "model.bin", WHISPER_SPEC, ct2, aliases)
    spec, back, back_aliases = read_ct2(tmp_path / "model.bin")
    assert (spec, back_aliases, list(back)) == (WHISPER_SPEC, aliases, list(ct2))
    for name, t in ct2.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    hf_back = ct2_whisper_to_hf(back)
    assert sorted(hf_back) == sorted(state)
    for name, t in state.items():
        assert torch.equal(hf_back[name], t), name

    # float16 on disk (as faster-whisper ships whisper-base) reads back as float32, exactly the rounded values
    half = {k: v.half() if v.is_floating_point() else v for k, v in ct2.items()}
    write_ct2(tmp_path / "half.bin", WHISPER_SPEC, half, aliases)
    _, back16, _ = read_ct2(tmp_path / "half.bin")
    assert (tmp_path / "half.bin").stat().st_size < 0.6 * (tmp_path / "model.bin").stat().st_size
    for name, t in half.items():
        assert back16[name].dtype == (torch.float32 if t.is_floating_point() else t.dtype)
        assert torch.equal(back16[name], t.float() if t.is_floating_point() else t), name


def test_mapping_refuses_what_whisper_is_not(tiny):
    hf, state = tiny
    ct2, _ = hf_whisper_to_ct2(state, hf.config)
    with pytest.raises(ValueError, match="pre_norm"):
        ct2_whisper_to_hf({**ct2, "decoder/pre_norm": torch.tensor(0, dtype=torch.int8)})
    bias = ct2["encoder/layer_0/self_attention/linear_0/bias"].clone()
    bias[70] = 1.0  # inside the k third
    with pytest.raises(ValueError, match="no bias"):
        ct2_whisper_to_hf({**ct2, "encoder/layer_0/self_attention/linear_0/bias": bias})
    w = "decoder/layer_0/ffn/linear_0/weight"
    with pytest.raises(ValueError, match="without"):
        ct2_whisper_to_hf({**ct2, w: ct2[w].to(torch.int8)})
    with pytest.raises(ValueError, match="no place"):
        ct2_whisper_to_hf({**ct2, "decoder/layer_0/extra/weight": torch.zeros(2)})


def _tokenizer_json() -> dict:
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return json.loads(tok.to_str())


def test_convert_folder_loads_in_transformers_and_ours(tiny, tmp_path):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    hf, state = tiny
    src, dst = tmp_path / "ct2", tmp_path / "hf"
    src.mkdir()
    ct2, aliases = hf_whisper_to_ct2(state, hf.config)
    write_ct2(src / "model.bin", WHISPER_SPEC, {k: v.half() if v.is_floating_point() else v for k, v in ct2.items()})
    ct2_config = {"suppress_ids": [1, 2], "suppress_ids_begin": [32, 256], "lang_ids": [258, 259]}
    ct2_config["alignment_heads"] = [[1, 0], [1, 3]]
    (src / "config.json").write_text(json.dumps(ct2_config))
    (src / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    convert_ct2_whisper_folder(src, dst)

    converted = WhisperForConditionalGeneration.from_pretrained(dst).eval()
    for name, t in state.items():
        assert torch.equal(converted.state_dict()[name], t.half().float()), name
    cfg = converted.config
    assert (cfg.vocab_size, cfg.decoder_start_token_id, cfg.eos_token_id, cfg.max_target_positions) == (
        300,
        257,
        256,
        64,
    )
    gen = converted.generation_config
    assert gen.lang_to_id == {"<|en|>": 258, "<|de|>": 259}
    assert gen.task_to_id == {"transcribe": 261, "translate": 260}
    assert (gen.no_timestamps_token_id, gen.prev_sot_token_id, gen.decoder_start_token_id) == (265, 263, 257)
    assert (gen.suppress_tokens, gen.begin_suppress_tokens, gen.alignment_heads) == (
        [1, 2],
        [32, 256],
        [[1, 0], [1, 3]],
    )

    processor = WhisperProcessor.from_pretrained(dst)
    tok = processor.tokenizer
    assert len(tok) == 300 and tok.all_special_ids[-1] == 265
    assert tok.convert_tokens_to_ids(["<|0.00|>", "<|0.66|>"]) == [266, 299]
    hi = tok.encode("hi", add_special_tokens=False)
    text = tok.decode([257, 258, 261, 266, *hi, 270, 256], decode_with_timestamps=True)
    assert text == "<|startoftranscript|><|en|><|transcribe|><|0.00|>hi<|0.08|><|endoftext|>"
    assert processor.feature_extractor.feature_size == 16

    # transformers' Whisper generate runs on the folder (language and task tokens from generation_config.json), and
    # our model loaded from it gives its greedy tokens
    torch.manual_seed(3)
    features = torch.randn(1, 16, 3000)
    with torch.no_grad():
        out = converted.generate(features, language="en", task="transcribe", max_new_tokens=6)
        prompt = torch.tensor([[257, 258, 261, 265]])
        ref = converted(input_features=features, decoder_input_ids=prompt).logits[0, -1]
    assert out.shape[-1] >= 1
    ours = load_whisper(str(dst))
    kv = ours.encode_cross(features)[0]
    from support.whisper_checkpoints import BLOCK, _Seq, _step

    caches = [(torch.zeros(4 * BLOCK, 4, 16), torch.zeros(4 * BLOCK, 4, 16)) for _ in range(2)]
    seq = _Seq(prompt[0].tolist(), [0, 1], kv)
    _step(ours, caches, [], [(seq, 4)])
    torch.testing.assert_close(seq.logits[3], ref, atol=1e-4, rtol=0)


def test_cached_conversion_builds_once(tiny, tmp_path):
    from omnivox.models.ct2_whisper import cached_ct2_whisper_folder, is_ct2_whisper_folder

    hf, state = tiny
    src = tmp_path / "ct2"
    src.mkdir()
    ct2, aliases = hf_whisper_to_ct2(state, hf.config)
    write_ct2(src / "model.bin", WHISPER_SPEC, ct2, aliases)
    (src / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))  # no config.json: empty lists
    assert is_ct2_whisper_folder(src) and not is_ct2_whisper_folder(tmp_path)
    dst = cached_ct2_whisper_folder(src, cache_dir=tmp_path / "cache")
    assert not is_ct2_whisper_folder(dst) and (dst / "model.safetensors").is_file()
    stamp = (dst / "model.safetensors").stat().st_mtime_ns
    assert cached_ct2_whisper_folder(src, cache_dir=tmp_path / "cache") == dst
    assert (dst / "model.safetensors").stat().st_mtime_ns == stamp  # found, not rebuilt
    assert json.loads((dst / "generation_config.json").read_text())["lang_to_id"] == {}
    with pytest.raises(ValueError, match="not a CTranslate2 Whisper"):
        cached_ct2_whisper_folder(dst, cache_dir=tmp_path / "cache")


def test_int8_model_is_dequantised(tiny, tmp_path):
    """CTranslate2's int8 recipe (q = rint(w * 127 / max|row|), float32 scale per row) applied by the test to every
    linear, conv and embedding weight; the tied projection aliases the embedding and its scale, as CTranslate2
    saves it. Read back, every weight is within half a quantisation step of the original."""
    hf, state = tiny
    ct2, aliases = hf_whisper_to_ct2(state, hf.config)
    quantised = {}
    for name, t in ct2.items():
        if name.endswith("/weight") and "layer_norm" not in name:
            scale = 127.0 / t.abs().amax(dim=1).clamp_min(1e-12)  # [out] or, for a conv, [out, k]
            quantised[name] = torch.round(t * scale.unsqueeze(1)).to(torch.int8)
            quantised[name + "_scale"] = scale
        else:
            quantised[name] = t.half() if t.is_floating_point() else t  # int8_float16: the rest in float16
    aliases["decoder/projection/weight_scale"] = "decoder/embeddings/weight_scale"
    write_ct2(tmp_path / "model.bin", WHISPER_SPEC, quantised, aliases)
    _, back, back_aliases = read_ct2(tmp_path / "model.bin")
    hf_back = ct2_whisper_to_hf(resolve_aliases(back, back_aliases))
    assert sorted(hf_back) == sorted(state)
    for name, t in state.items():
        err = (hf_back[name] - t).abs().max()
        bound = 0.5 * t.abs().max() / 127 + 1e-3 * t.abs().max()  # half a step (float16 for the unquantised)
        assert hf_back[name].dtype == torch.float32 and err <= bound, (name, float(err), float(bound))
    assert (hf_back["model.decoder.layers.0.fc1.weight"] - state["model.decoder.layers.0.fc1.weight"]).abs().max() > 0
