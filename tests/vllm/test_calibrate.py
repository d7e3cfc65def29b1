"""The pure pieces of `turboquant-vllm calibrate` (the vLLM run itself is checked on the GPU)."""

import pytest

from turboquant_vllm.vllm.calibrate import read_texts, token_windows


def test_read_texts_takes_files_and_folders(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("second")
    (tmp_path / "d" / "a.txt").write_text("first")
    (tmp_path / "d" / "skip.bin").write_text("not text")
    (tmp_path / "c.txt").write_text("third")
    assert read_texts([tmp_path / "d", tmp_path / "c.txt"]) == "first\n\nsecond\n\nthird"
    with pytest.raises(ValueError, match="not found"):
        read_texts([tmp_path / "missing.txt"])


def test_token_windows():
    ids = list(range(100))
    assert token_windows(ids, 10, 1000, [7]) == [[7] + ids[i * 9:(i + 1) * 9] for i in range(11)]
    assert len(token_windows(ids, 10, 30, [])) == 3  # the token budget
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(ids, 200, 1000, [])
