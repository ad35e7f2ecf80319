"""Smoke test of examples/train_mla.py and examples/generate.py on the CPU (a few steps)."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def test_train_then_generate(tmp_path, capsys):
    import generate
    import train_mla

    threads = torch.get_num_threads()
    try:
        first, last = train_mla.main(["--tiny", "--steps", "12", "--batch-size", "8", "--out", str(tmp_path),
                                      "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert last < first  # the loss falls even in a dozen steps
    ckpt = tmp_path / "mla_lm.pt"
    assert ckpt.exists() and (tmp_path / "train_log.json").exists()
    generate.main(["--checkpoint", str(ckpt), "--max-new-tokens", "12", "--device", "cpu", "--verify",
                   "--prompt", "The ", "--prompt", "A longer prompt "])
    out = capsys.readouterr().out
    assert "verify: max |cached - recomputed|" in out and "(OK" in out


def test_corpus_is_shipped():
    path = os.path.join(ROOT, "examples", "data", "corpus.txt")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert len(text) > 20000 and text.isascii()
