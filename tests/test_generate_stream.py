"""The `generate` command line's streaming: on a terminal (or with --stream) each answer prints as its
tokens commit, through the serving engine, and at temperature 0 the output is the batch path's, byte
for byte; characters cut between tokens and the tokenizer's spacing come out as offline decoding gives
them."""

from __future__ import annotations

import io

import pytest
from test_serve_http import char_tokenizer

from conftest import make_tiny_checkpoint
from jetspec_jax.generate import TerminalAnswer, main


class Terminal(io.StringIO):
    """stdout that records each write, and says whether it is a terminal."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty, self.writes = tty, []

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def run(monkeypatch, capsys, argv, tty: bool) -> tuple[Terminal, str]:
    out = Terminal(tty)
    with monkeypatch.context() as m:
        m.setattr("sys.stdout", out)
        assert main(argv) == 0
    return out, capsys.readouterr().err


def test_terminal_answer_prints_the_stripped_text_piece_by_piece(embedded_target):
    """Token by token, through characters that span tokens (byte-level BPE), spaces and newlines: the
    pieces join to what the batch path prints, and none holds half a character."""
    tok = embedded_target.tokenizer
    ids = tok("  \n Bonjour, café! 日本語です 🎉 Привет, мир.  \n\n", add_special_tokens=False)["input_ids"]
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))  # the case is exercised
    out = Terminal(tty=True)
    answer = TerminalAnswer(tok, out)
    for token in ids:
        answer.add([token])
    assert answer.finish() == tok.decode(ids, skip_special_tokens=True)
    assert out.getvalue() == tok.decode(ids, skip_special_tokens=True).strip() + "\n"
    assert len(out.writes) > 10 and not any("\ufffd" in w for w in out.writes)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3 with a character tokenizer (no head ships for it: AR by default)."""
    path = str(tmp_path_factory.mktemp("tiny-stream"))
    make_tiny_checkpoint("qwen3", path, seed=1)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("method", [["--method", "ar"],
                                    ["--method", "jetspec", "--budget", "8", "--width", "3", "--max-depth", "3",
                                     "--tree-temperature", "0.7"],
                                    ["--method", "jetspec-tc", "--budget", "8", "--width", "3", "--max-depth", "3"]],
                         ids=["ar", "jetspec", "jetspec-tc"])
def test_a_terminal_streams_what_the_batch_prints(tiny_model, monkeypatch, capsys, method):
    """stdout a terminal: the answers stream, one chunk of steps at a time; a pipe: one batch. At T=0 the
    two outputs are the same bytes, and both report tokens/s and compile time."""
    argv = ["Hi there", "What is 2+2? Tell me a long story.", "--model", tiny_model, "--max-new-tokens", "40",
            "--no-cache", *method]
    streamed, streamed_err = run(monkeypatch, capsys, argv, tty=True)
    batch, batch_err = run(monkeypatch, capsys, argv, tty=False)
    assert streamed.getvalue() == batch.getvalue()
    assert "streamed" in streamed_err and "batch 2" in batch_err
    for err in (streamed_err, batch_err):
        assert "tok/s" in err and "compile " in err and ("tau " in err) == (method[1] != "ar")
    answer_writes = [w for w in streamed.writes if w.strip() and not w.startswith("###")]
    assert len(answer_writes) > 2  # printed as chunks committed, not at the end
    assert len([w for w in batch.writes if w.strip()]) == 4  # two headers, two answers


def test_stream_flags_override_the_terminal_check(tiny_model, monkeypatch, capsys):
    argv = ["Hi there", "--model", tiny_model, "--max-new-tokens", "8", "--no-cache"]
    assert "batch 1" in run(monkeypatch, capsys, argv + ["--no-stream"], tty=True)[1]
    assert "streamed" in run(monkeypatch, capsys, argv + ["--stream"], tty=False)[1]


def test_stream_with_a_setting_the_engine_lacks_is_one_error_line(capsys):
    assert main(["hi", "--stream", "--method", "jetspec-tc", "--candidate-budget", "256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "--candidate-budget 256" in err


def test_streamed_answers_equal_the_batch_on_the_embedded_model(embedded_target, monkeypatch, capsys):
    """The main command with the shipped JetSpec head: streamed, the same text (multi-byte characters
    included) and the same verify passes as the batch path."""
    argv = ["Write 'hello' in Japanese, Russian and French.", "Name a prime.", "--max-new-tokens", "32"]
    streamed, streamed_err = run(monkeypatch, capsys, argv + ["--stream"], tty=False)
    batch, batch_err = run(monkeypatch, capsys, argv + ["--no-stream"], tty=False)
    assert streamed.getvalue() == batch.getvalue()
    assert "jetspec" in streamed_err and streamed_err.split("tau ")[1] == batch_err.split("tau ")[1]
