"""Bad GGUF input fails at load with one ``GGUFLoadError`` (a ValueError) naming the file and the reason: a
truncated or corrupt file, an unknown architecture, an unsupported tensor type, no tokenizer metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from gpu_workers.engine import LLM
from gpu_workers.engine.models.gguf_checkpoint import converted_folder
from gpu_workers.engine.models.gguf_errors import GGUFLoadError
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

from .gguf_files import write_gguf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gguf_errors") / "hf", num_layers=1)


@pytest.fixture(scope="module")
def good_bytes(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf_good") / "good.gguf"
    write_gguf(hf_dir, path, T.Q8_0)
    return path.read_bytes()


def _refused(path: Path, reason: str) -> GGUFLoadError:
    with pytest.raises(GGUFLoadError, match=reason) as info:
        LLM(str(path))
    assert str(path.name) in str(info.value)
    assert isinstance(info.value, ValueError)
    assert not (path.parent / f"{path.stem}.hf").exists()  # nothing half-converted left behind
    return info.value


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_file(keep: float, good_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(good_bytes[: int(len(good_bytes) * keep)])
    _refused(path, "truncated or corrupt|cannot be read")


@pytest.mark.parametrize("size", [0, 3, 20])
def test_a_file_too_short_for_a_header(size: int, good_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "short.gguf"
    path.write_bytes(good_bytes[:size])
    _refused(path, "truncated or corrupt")


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "noise.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 64)
    _refused(path, "truncated or corrupt")


def test_corrupt_metadata(good_bytes: bytes, tmp_path: Path) -> None:
    """The metadata count and first key length overwritten with huge values."""
    path = tmp_path / "corrupt.gguf"
    data = bytearray(good_bytes)
    data[16:32] = b"\xff" * 16
    path.write_bytes(bytes(data))
    _refused(path, "truncated or corrupt")


def test_an_unknown_architecture(hf_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    write_gguf(hf_dir, path, arch="falcon")
    _refused(path, "architecture 'falcon' is not supported")


def test_an_unsupported_tensor_type(hf_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "q5.gguf"
    write_gguf(hf_dir, path, T.Q5_0)
    error = _refused(path, "type Q5_0, not supported")
    assert "Q4_K" in str(error)  # the supported types are listed


def test_missing_tokenizer_metadata(hf_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "notok.gguf"
    write_gguf(hf_dir, path, tokenizer=False)
    _refused(path, "no tokenizer: metadata key 'tokenizer.ggml.model' is missing")


def test_a_missing_file() -> None:
    with pytest.raises(GGUFLoadError, match="no such file"):
        converted_folder("/nonexistent/model.gguf")
